"""Block selection policies. Each is a small dataclass on the :class:`Selector` contract.

>>> from hf_offload.selectors import get_selector
>>> get_selector("solohead").per_head
False
"""

from __future__ import annotations

from .base import Selection, Selector
from .headwise import HeadwiseSelector
from .oracle import OracleSelector
from .solohead import SoloHeadSelector
from .streaming import StreamingSelector

SELECTORS: dict[str, type[Selector]] = {
    cls.name: cls for cls in (SoloHeadSelector, HeadwiseSelector, StreamingSelector, OracleSelector)
}


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
    "OracleSelector",
    "Selection",
    "Selector",
    "SoloHeadSelector",
    "StreamingSelector",
    "get_selector",
]
