"""Block selection policies. Each is a small dataclass on the :class:`Selector` contract.

The default of :class:`~hf_offload.config.OffloadConfig` is ``meanbound``, a SoloHead-style selector (one selection
per layer and sequence, shared by all heads, so a selected block moves whole).

>>> from hf_offload.selectors import get_selector
>>> get_selector("meanbound").per_head
False
"""

from __future__ import annotations

from .base import Selection, Selector
from .headwise import HeadwiseSelector
from .meanbound import MeanBoundSelector
from .meanvar import MeanVarSelector
from .oracle import OracleSelector
from .quantkey import QuantKeySelector
from .solohead import SoloHeadSelector
from .streaming import StreamingSelector
from .union import UnionSelector

_BUILT_IN = (
    MeanBoundSelector, MeanVarSelector, SoloHeadSelector, HeadwiseSelector, StreamingSelector, OracleSelector,
    UnionSelector, QuantKeySelector,
)  # fmt: skip
SELECTORS: dict[str, type[Selector]] = {cls.name: cls for cls in _BUILT_IN}


def register_selector(cls: type[Selector]) -> type[Selector]:
    """Register a selector class under its ``name`` so that ``OffloadCache(model, selector=name)`` finds it.

    Usable as a class decorator. Selectors given by name are built without arguments, so every field of the class
    needs a default.
    """
    if not (isinstance(cls, type) and issubclass(cls, Selector)):
        raise TypeError(f"register_selector takes a Selector subclass, got {cls!r}")
    if not isinstance(cls.name, str) or cls.name == Selector.name:
        raise ValueError(f"{cls.__name__} needs its own class attribute `name`")
    SELECTORS[cls.name] = cls
    return cls


def get_selector(selector: str | Selector) -> Selector:
    """Return a selector instance from a registered name, or ``selector`` itself if it is already one."""
    if isinstance(selector, Selector):
        return selector
    if selector not in SELECTORS:
        raise ValueError(f"Unknown selector {selector!r}; choose one of {sorted(SELECTORS)} or pass a Selector.")
    return SELECTORS[selector]()


__all__ = [
    "SELECTORS",
    "HeadwiseSelector",
    "MeanBoundSelector",
    "MeanVarSelector",
    "OracleSelector",
    "QuantKeySelector",
    "Selection",
    "Selector",
    "SoloHeadSelector",
    "StreamingSelector",
    "UnionSelector",
    "get_selector",
    "register_selector",
]
