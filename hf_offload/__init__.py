"""hf-offload: sparse KV-cache offloading for Hugging Face transformers decoder models, through ``generate()``.

>>> from hf_offload import OffloadCache, OffloadConfig
>>> OffloadConfig(budget_tokens=2048).window_tokens
256
"""

from .attention import disable_offload_attention, enable_offload_attention
from .cache import OffloadCache, OffloadLayer
from .config import OffloadConfig
from .selectors import (
    HeadwiseSelector,
    MeanBoundSelector,
    OracleSelector,
    Selection,
    Selector,
    SoloHeadSelector,
    StreamingSelector,
    get_selector,
    register_selector,
)

__version__ = "0.1.0"

__all__ = [
    "HeadwiseSelector",
    "MeanBoundSelector",
    "OffloadCache",
    "OffloadConfig",
    "OffloadLayer",
    "OracleSelector",
    "Selection",
    "Selector",
    "SoloHeadSelector",
    "StreamingSelector",
    "__version__",
    "disable_offload_attention",
    "enable_offload_attention",
    "get_selector",
    "register_selector",
]
