"""The cache: :class:`OffloadCache` (the container) and :class:`OffloadLayer` (one full-attention layer), composed of
parts that each own their state: ``blocks`` (storage), ``planner`` (selection), ``recaller`` (recall, prefetch,
lookahead), ``graphs`` (capture and replay), ``stats`` (counters); ``execution`` holds how a layer runs."""

from .blocks import SUMMARY_CHUNK_BLOCKS, BlockStore
from .container import OffloadCache, forward_cache_kwarg, generate_cache_kwarg, layer_types
from .execution import GRAPH_CAPACITY_BLOCKS, LayerExecution
from .graphs import GraphRunner
from .layer import OffloadLayer
from .parking import parked_bytes, release_parked
from .persist import FORMAT_VERSION, CacheFileError
from .planner import DecodePlanner
from .recaller import Recaller
from .shared import release_graph_pools
from .stats import LayerStats
from .warmup import warm_up

__all__ = [
    "FORMAT_VERSION",
    "GRAPH_CAPACITY_BLOCKS",
    "SUMMARY_CHUNK_BLOCKS",
    "BlockStore",
    "CacheFileError",
    "DecodePlanner",
    "GraphRunner",
    "LayerExecution",
    "LayerStats",
    "OffloadCache",
    "OffloadLayer",
    "Recaller",
    "forward_cache_kwarg",
    "generate_cache_kwarg",
    "layer_types",
    "parked_bytes",
    "release_graph_pools",
    "release_parked",
    "warm_up",
]
