"""Block selection policies. Each is a small dataclass on the :class:`Selector` contract.

The default of :class:`~hf_offload.config.OffloadConfig` is ``quantkey``, a SoloHead-style selector (one selection
per layer and sequence, shared by all heads, so a selected block moves whole).

>>> from hf_offload.selectors import get_selector
>>> get_selector("quantkey").per_head
False
>>> get_selector("quantkey[bits=4]").bits
4
"""

from __future__ import annotations

import dataclasses

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
    """A selector instance from a registered name, or ``selector`` itself if it is already one.

    A name may carry settings of the selector's dataclass fields in brackets, ``"quantkey[bits=4]"`` or
    ``"union[share=0.5,head_score=quest]"`` (what a recipe or a command line can pass); each value is converted to
    the type of the field's default.
    """
    if isinstance(selector, Selector):
        return selector
    if not isinstance(selector, str):
        raise TypeError(f"selector must be a registered name or a Selector instance, got {selector!r}")
    name, settings = selector, {}
    if "[" in selector:
        if not selector.endswith("]"):
            raise ValueError(f"Selector {selector!r}: settings go in brackets at the end, e.g. 'quantkey[bits=4]'.")
        name, body = selector[:-1].split("[", 1)
        for pair in filter(None, (p.strip() for p in body.split(","))):
            if "=" not in pair:
                raise ValueError(f"Selector {selector!r}: write each setting as field=value, got {pair!r}.")
            key, value = (part.strip() for part in pair.split("=", 1))
            settings[key] = value
    if name not in SELECTORS:
        raise ValueError(f"Unknown selector {name!r}; choose one of {sorted(SELECTORS)} or pass a Selector.")
    cls = SELECTORS[name]
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    for key, value in settings.items():
        if key not in fields:
            raise ValueError(f"Selector {name!r} has no setting {key!r}; its settings: {sorted(fields)}.")
        default = getattr(cls, key, None)
        if isinstance(default, bool):
            if value.lower() not in ("true", "false"):
                raise ValueError(f"Selector {name!r}: {key} takes true or false, got {value!r}.")
            settings[key] = value.lower() == "true"
        elif isinstance(default, (int, float)):
            try:
                settings[key] = type(default)(value)
            except ValueError:
                raise ValueError(f"Selector {name!r}: {key} takes {type(default).__name__} values, got {value!r}.") from None
    return cls(**settings)


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
