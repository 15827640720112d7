"""hf-offload: sparse KV-cache offloading for Hugging Face transformers decoder models, through ``generate()``.

>>> from hf_offload import OffloadCache, OffloadConfig
>>> OffloadConfig(budget_tokens=2048).window_tokens
256

The public names load on first use (torch and transformers are imported then), so ``hf-offload --help`` and
``import hf_offload`` stay fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> submodule that defines it
_EXPORTS = {
    "CacheFileError": ".cache",
    "OffloadCache": ".cache",
    "OffloadLayer": ".cache",
    "OffloadConfig": ".config",
    "disable_offload_attention": ".patches",
    "enable_offload_attention": ".patches",
    "forward_cache_kwarg": ".cache",
    "generate_cache_kwarg": ".cache",
    "HeadwiseSelector": ".selectors",
    "MeanBoundSelector": ".selectors",
    "MeanVarSelector": ".selectors",
    "OracleSelector": ".selectors",
    "QuantKeySelector": ".selectors",
    "Selection": ".selectors",
    "Selector": ".selectors",
    "SoloHeadSelector": ".selectors",
    "StreamingSelector": ".selectors",
    "UnionSelector": ".selectors",
    "get_selector": ".selectors",
    "register_selector": ".selectors",
    "release_parked": ".cache",
    "warm_up": ".cache",
}

__all__ = sorted([*_EXPORTS, "__version__"])

if TYPE_CHECKING:
    from .patches import disable_offload_attention, enable_offload_attention
    from .cache import CacheFileError, OffloadCache, OffloadLayer, forward_cache_kwarg, generate_cache_kwarg
    from .cache import release_parked, warm_up
    from .config import OffloadConfig
    from .selectors import (
        HeadwiseSelector,
        MeanBoundSelector,
        MeanVarSelector,
        OracleSelector,
        QuantKeySelector,
        Selection,
        Selector,
        SoloHeadSelector,
        StreamingSelector,
        UnionSelector,
        get_selector,
        register_selector,
    )


def __getattr__(name: str):
    """Import a public name's submodule on first use (PEP 562)."""
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_offload' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
