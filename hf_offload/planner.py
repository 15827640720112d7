"""What fits: KV bytes per architecture, and device / host bytes of a cache for a batch and context.

The predictions follow the cache's own layout, so they equal what ``cache.stats()`` reports (tested), and need no
device: per full-attention layer the host holds every sealed block, the device the slot pool, the open block and
the block summaries; sliding-window layers keep their window on the device; ``DynamicCache`` and ``StaticCache``
keep everything on the device, and a decode step of theirs allocates one more layer's worth (``Plan.
step_transient_bytes``): ``DynamicCache`` concatenates each layer's keys and values with the new token, and with a
``StaticCache`` transformers' SDPA attention repeats one layer's keys and values to every query head (its mask
cannot be dropped, so the heads are not grouped inside SDPA).

Pure functions: the command line (``hf-offload plan``) is :mod:`hf_offload.tools.plan`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

from .cache import SUMMARY_CHUNK_BLOCKS, layer_types
from .cache.shared import forward_transient_bytes
from .config import OffloadConfig
from .selectors import get_selector

GIB = 1 << 30

# Shapes of common models (for planning without downloading a config).
PRESETS: dict[str, dict] = {
    "llama-3.1-8b": dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         params=8.03e9, hidden_size=4096, intermediate_size=14336, vocab_size=128256),
    "llama-3.2-1b": dict(num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         params=1.24e9, hidden_size=2048, intermediate_size=8192, vocab_size=128256),
    "llama-3.2-3b": dict(num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                         params=3.21e9, hidden_size=3072, intermediate_size=8192, vocab_size=128256),
    "qwen2.5-7b": dict(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                       params=7.62e9, hidden_size=3584, intermediate_size=18944, vocab_size=152064),
    "qwen2.5-coder-0.5b": dict(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                               params=0.63e9, hidden_size=896, intermediate_size=4864, vocab_size=151936),
    "qwen2.5-coder-1.5b": dict(num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                               params=1.54e9, hidden_size=1536, intermediate_size=8960, vocab_size=151936),
}


@dataclass(frozen=True)
class ModelShape:
    """What the KV size of a model depends on.

    Attributes:
        full_layers: full-attention layers (offloaded).
        sliding_layers: sliding-window layers (kept dense on the device).
        sliding_window: their window in tokens (``None`` without sliding layers).
        kv_heads: KV heads per layer.
        head_dim: head size.
        dtype_bytes: bytes per KV element (2 for bf16 / fp16).
        weights_bytes: bytes of the weights, when known (for the largest-batch search).
        query_heads: query heads per layer, when known (``StaticCache``'s decode step repeats the KV heads to
            them); ``None``: as many as KV heads.
        hidden_size, intermediate_size, vocab_size: the decoder's, when known (a prefill chunk's temporaries,
            :attr:`Plan.prefill_transient_bytes`).
    """

    full_layers: int
    sliding_layers: int
    sliding_window: int | None
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    weights_bytes: int | None = None
    query_heads: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V bytes of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes


def shape_from_config(config, dtype_bytes: int = 2, weights_bytes: int | None = None) -> ModelShape:
    """The :class:`ModelShape` of a transformers config (the decoder's text config is used)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types = layer_types(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    sliding = sum(t != "full_attention" for t in types)
    return ModelShape(
        full_layers=len(types) - sliding,
        sliding_layers=sliding,
        sliding_window=getattr(config, "sliding_window", None) if sliding else None,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        dtype_bytes=dtype_bytes,
        weights_bytes=weights_bytes,
        query_heads=heads,
        hidden_size=getattr(config, "hidden_size", None),
        intermediate_size=getattr(config, "intermediate_size", None),
        vocab_size=getattr(config, "vocab_size", None),
    )


def shape_from_preset(name: str) -> ModelShape:
    """The :class:`ModelShape` of a preset (bf16 weights and KV)."""
    if name not in PRESETS:
        raise KeyError(f"Unknown preset {name!r}; presets: {sorted(PRESETS)}")
    p = PRESETS[name]
    return ModelShape(p["num_hidden_layers"], 0, None, p["num_key_value_heads"], p["head_dim"], 2, int(2 * p["params"]),
                      p["num_attention_heads"], p["hidden_size"], p["intermediate_size"], p["vocab_size"])


@dataclass(frozen=True)
class Plan:
    """Predicted bytes of one cache.

    Attributes:
        method: ``"dense"`` (``DynamicCache``), ``"static"`` (``StaticCache`` of ``context_tokens``) or
            ``"offload"`` (``OffloadCache``).
        batch, context_tokens: the workload.
        device_kv_bytes: KV on the device (``stats()["device_kv_bytes"]`` for the offloaded cache).
        device_summary_bytes: block summaries on the device.
        host_kv_bytes: sealed blocks in host memory.
        host_reserved_bytes: host memory the block pools allocate (whole chunks).
        admitted_kv_bytes: sealed blocks that ``admission="auto"`` keeps in device memory (part of
            ``device_kv_bytes``).
        admitted_reserved_bytes: device memory of the block-pool chunks admitted to the device (whole chunks).
        step_transient_bytes: device bytes a decode step allocates beyond the cache for a moment, where the
            cache's own layout fixes them: one layer's KV for ``"dense"`` (the concatenation with the new token),
            one layer's KV per query head group member for ``"static"`` (SDPA's repeated keys and values); ``0``
            for ``"offload"``.
        disk_kv_bytes: sealed blocks in chunks spilled to the disk tier (``disk_dir``; ``host_memory_gib`` caps
            the host chunks, each layer keeping at least its newest one in host memory).
        disk_reserved_bytes: bytes of the spill file's extents (whole chunks, rounded up to 4 KiB).
        summary_selector: the selector level whose summaries the cache holds at this context (``"offload"``): the
            configured one, or the coarser level ``coarsen_summaries`` moves to where that one's do not fit the
            room (``device_memory_gib``, or ``device_free_bytes`` less the margin); ``None`` for the others.
        prefill_chunk_tokens: the prefill chunk planned for (``generate(prefill_chunk_size=...)``), or ``None``.
        prefill_transient_bytes: with a prefill chunk (``"offload"``), the temporaries of the last chunk as the
            cache's admission estimates them (``hf_offload.cache.shared.forward_transient_bytes``: the MLP's
            activations, the query, the layer's earlier KV recalled with the chunk's behind it).
    """

    method: str
    batch: int
    context_tokens: int
    device_kv_bytes: int
    device_summary_bytes: int
    host_kv_bytes: int
    host_reserved_bytes: int
    admitted_kv_bytes: int = 0
    admitted_reserved_bytes: int = 0
    step_transient_bytes: int = 0
    disk_kv_bytes: int = 0
    disk_reserved_bytes: int = 0
    summary_selector: str | None = None
    prefill_chunk_tokens: int | None = None
    prefill_transient_bytes: int = 0

    @property
    def device_bytes(self) -> int:
        """All device bytes of the cache (admitted chunks counted whole)."""
        return self.device_kv_bytes - self.admitted_kv_bytes + self.admitted_reserved_bytes + self.device_summary_bytes

    @property
    def peak_device_bytes(self) -> int:
        """:attr:`device_bytes` plus :attr:`step_transient_bytes`: the cache's peak during a decode step."""
        return self.device_bytes + self.step_transient_bytes

    @property
    def prefill_peak_bytes(self) -> int:
        """The cache's device bytes less its admitted blocks (they make way for a forward's temporaries) plus
        :attr:`prefill_transient_bytes`: what the last prefill chunk needs on the device besides the weights."""
        return self.device_bytes - self.admitted_reserved_bytes + self.prefill_transient_bytes


def _summary_bytes_per_block(shape: ModelShape, config: OffloadConfig, selector=None) -> int:
    """Device bytes of one block's summaries: the selector's own ``summarize`` (and ``summarize_values``, where it
    estimates the unselected blocks) run on one block of ``meta`` keys (no memory, any registered selector); Quest
    bounds where that cannot run. ``selector``: this one instead of ``config.selector``'s."""
    import torch

    selector = get_selector(config.selector) if selector is None else selector
    dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}.get(shape.dtype_bytes, torch.bfloat16)
    keys = torch.empty((1, 1, shape.kv_heads, config.block_tokens, shape.head_dim), dtype=dtype, device="meta")
    try:
        summaries = selector.summarize(keys)
        if selector.estimates_tail:
            summaries.update(selector.summarize_values(keys))
        return sum(t.numel() * t.element_size() for t in summaries.values())
    except Exception:
        return 2 * shape.kv_heads * shape.head_dim * shape.dtype_bytes  # kmin and kmax per KV head


def admission_margin_bytes(device_free_bytes: int) -> int:
    """Device bytes admission leaves free for the model's temporaries when nothing bounds the cache: 4% of
    ``device_free_bytes``, at least 256 MiB (the cache's floor; it also learns each forward's real peak)."""
    return max(256 << 20, int(0.04 * device_free_bytes))


def plan(shape: ModelShape, context_tokens: int, batch: int, method: str = "offload",
         config: OffloadConfig | None = None, device_free_bytes: int | None = None,
         prefill_chunk_tokens: int | None = None) -> Plan:  # fmt: skip
    """Predict the bytes of a cache holding ``context_tokens`` tokens for ``batch`` sequences.

    With ``admission="auto"`` the first block-pool chunks, up to the admission limit, are device memory; the split
    follows a prefill in one forward (layer by layer: the first layers' chunks are admitted). A chunked prefill or a
    long decode grows the layers' pools in turn instead: the same chunks are admitted in number, and the sealed
    bytes on each side differ by at most one partly filled chunk per layer.

    Args:
        shape: the model's :class:`ModelShape`.
        context_tokens: tokens per sequence (prompt, padding and generated tokens).
        batch: sequences.
        method: ``"dense"`` (``DynamicCache``), ``"static"`` (``StaticCache`` of ``context_tokens``; transformers'
            SDPA attention) or ``"offload"``.
        config: the offloaded cache's settings (default ``OffloadConfig()``).
        device_free_bytes: device memory the process may give the cache and the model's temporaries, in bytes
            (what it may allocate less the weights). With ``admission="auto"`` and no ``device_memory_gib``, blocks
            are admitted into what it leaves after the cache's other device bytes and
            :func:`admission_margin_bytes`; ``None``: nothing admitted (as on a CPU).
        prefill_chunk_tokens: the prompt's prefill chunk (``"offload"``): :attr:`Plan.prefill_transient_bytes`
            is then its last chunk's temporaries; ``None``: not planned.

    Raises:
        ValueError: an unknown method.
    """
    per_token = shape.kv_bytes_per_token
    # A sliding layer keeps its last ``sliding_window - 1`` tokens.
    sliding_tokens = min(context_tokens, shape.sliding_window - 1) if shape.sliding_layers else 0
    sliding_bytes = shape.sliding_layers * batch * sliding_tokens * per_token
    if method in ("dense", "static"):
        if method == "static" and shape.sliding_layers:  # a static sliding layer holds its whole window
            sliding_bytes = shape.sliding_layers * batch * min(context_tokens, shape.sliding_window) * per_token
        kv = shape.full_layers * batch * context_tokens * per_token + sliding_bytes
        layer = batch * context_tokens * per_token if shape.full_layers else sliding_bytes // shape.sliding_layers
        n_rep = max(1, (shape.query_heads or shape.kv_heads) // shape.kv_heads)
        transient = layer if method == "dense" else n_rep * layer
        return Plan(method, batch, context_tokens, kv, 0, 0, 0, step_transient_bytes=transient)
    if method != "offload":
        raise ValueError(f"method must be 'dense', 'static' or 'offload', got {method!r}")
    config = config or OffloadConfig()
    block_tokens = config.block_tokens
    blocks = context_tokens // block_tokens
    block_bytes = block_tokens * per_token
    pool_bytes = batch * config.pool_blocks * block_bytes
    # The open block lives in a buffer of one whole block (per sequence and layer), filled or not.
    open_bytes = batch * block_bytes if context_tokens else 0
    device = shape.full_layers * (pool_bytes + open_bytes) + sliding_bytes
    summary_blocks = -(-blocks // SUMMARY_CHUNK_BLOCKS) * SUMMARY_CHUNK_BLOCKS  # allocated by SUMMARY_CHUNK_BLOCKS
    selector = get_selector(config.selector)
    summaries = shape.full_layers * batch * summary_blocks * _summary_bytes_per_block(shape, config, selector)
    bounded = config.device_memory_gib is not None or (config.admission == "auto" and device_free_bytes is not None)
    if config.coarsen_summaries and bounded:
        # Where the summaries do not fit the room the cache's other device buffers leave, it re-encodes them at
        # coarser levels until they do (or none is left).
        if config.device_memory_gib is not None:
            room = int(config.device_memory_gib * GIB) - (device - sliding_bytes)
        else:
            room = device_free_bytes - device - admission_margin_bytes(device_free_bytes)
        while summaries > room and (coarser := selector.coarser()) is not None:
            selector = coarser
            summaries = shape.full_layers * batch * summary_blocks * _summary_bytes_per_block(shape, config, selector)
    layer_kv = batch * blocks * block_bytes
    chunk_blocks = max(1, int(config.host_chunk_mib * (1 << 20)) // block_bytes)
    chunk_bytes = chunk_blocks * block_bytes
    chunks = math.ceil(batch * blocks / chunk_blocks)  # per layer
    admitted = 0  # chunks in device memory, all layers
    if config.admission == "auto":
        if config.device_memory_gib is not None:  # the bound holds the cache's buffers too
            limit = int(config.device_memory_gib * GIB) - (device - sliding_bytes) - summaries
        elif device_free_bytes is not None:
            limit = device_free_bytes - device - summaries - admission_margin_bytes(device_free_bytes)
        else:
            limit = 0  # no device named: nothing admitted, as on a CPU
        admitted = min(shape.full_layers * chunks, max(0, limit) // chunk_bytes)
    whole, part = divmod(admitted, chunks) if chunks else (0, 0)
    admitted_kv = whole * layer_kv + (min(layer_kv, part * chunk_bytes) if part else 0)
    host = shape.full_layers * layer_kv - admitted_kv
    host_chunks = shape.full_layers * chunks - admitted
    disk = disk_reserved = 0
    if config.disk_dir is not None and config.host_memory_gib is not None and host_chunks:
        # Past the cap the least recently used full chunks spill (store/disk.py); partly filled ones (at most one per
        # layer) stay.
        kept = min(host_chunks, max(shape.full_layers, int(config.host_memory_gib * GIB) // chunk_bytes))
        spilled = host_chunks - kept
        disk, disk_reserved = spilled * chunk_bytes, spilled * (-(-chunk_bytes // 4096) * 4096)
        host, host_chunks = host - disk, kept
    reserved = host_chunks * chunk_bytes
    from .cache.persist import selector_spec

    try:
        level = selector_spec(selector)
    except ValueError:
        level = repr(selector)
    prefill = 0
    if prefill_chunk_tokens:
        chunk = min(prefill_chunk_tokens, context_tokens)
        prefill = forward_transient_bytes(_shape_config(shape), batch, chunk, shape.dtype_bytes,
                                          config.prefill_chunk_tokens, context_tokens - chunk)  # fmt: skip
    return Plan("offload", batch, context_tokens, device + admitted_kv, summaries, host, reserved, admitted_kv,
                admitted * chunk_bytes, disk_kv_bytes=disk, disk_reserved_bytes=disk_reserved,
                summary_selector=level, prefill_chunk_tokens=prefill_chunk_tokens,
                prefill_transient_bytes=prefill)  # fmt: skip


def _shape_config(shape: ModelShape) -> SimpleNamespace:
    """The config attributes :func:`~hf_offload.cache.shared.forward_transient_bytes` reads, from a shape."""
    if shape.hidden_size is None or shape.intermediate_size is None:
        raise ValueError("Planning a prefill chunk needs the model's hidden_size and intermediate_size: plan from a "
                         "preset or a model's config.json, or leave the prefill chunk out.")  # fmt: skip
    return SimpleNamespace(hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
                           num_attention_heads=shape.query_heads or shape.kv_heads, head_dim=shape.head_dim,
                           num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab_size or 0)  # fmt: skip


def suggested_device_memory_gib(shape: ModelShape, context_tokens: int, batch: int, config: OffloadConfig,
                                device_free_bytes: int, margin_gib: float) -> float:  # fmt: skip
    """The ``device_memory_gib`` (the bound on all the cache's device bytes) that leaves ``margin_gib`` of
    ``device_free_bytes`` (the device's memory less the weights) free for the model's temporaries, CUDA graphs and
    allocator fragmentation. The shape, context, batch and config do not change it; they are kept for callers that
    plan per batch."""
    return max(0.0, device_free_bytes / GIB - margin_gib)


def largest_batch(shape: ModelShape, context_tokens: int, method: str, device_free_bytes: int,
                  host_free_bytes: int, config: OffloadConfig | None = None, limit: int = 4096,
                  disk_free_bytes: int | None = None, prefill_chunk_tokens: int | None = None) -> int:  # fmt: skip
    """The largest batch whose cache, with its decode step's transient bytes, fits ``device_free_bytes`` (after
    weights), ``host_free_bytes`` and, with a disk tier, ``disk_free_bytes`` (``None``: unbounded). With
    ``admission="auto"`` blocks are admitted as :func:`plan` says (into what the cache's other device bytes and the
    margin leave, or within ``device_memory_gib``), the rest go to the host, and past ``host_memory_gib`` to disk.
    With ``prefill_chunk_tokens`` (``"offload"``) the last prefill chunk must fit too
    (:attr:`Plan.prefill_peak_bytes`)."""
    config = config or OffloadConfig()
    chunk = prefill_chunk_tokens if method == "offload" else None

    def fits(batch: int) -> bool:
        p = plan(shape, context_tokens, batch, method, config, device_free_bytes=device_free_bytes,
                 prefill_chunk_tokens=chunk)  # fmt: skip
        disk_ok = disk_free_bytes is None or p.disk_reserved_bytes <= disk_free_bytes
        prefill_ok = p.prefill_peak_bytes <= device_free_bytes
        return (p.peak_device_bytes <= device_free_bytes and p.host_reserved_bytes <= host_free_bytes and disk_ok
                and prefill_ok)  # fmt: skip

    return _largest(fits, limit)


def _largest(fits: Callable[[int], bool], limit: int) -> int:
    """The largest batch in ``[1, limit]`` for which ``fits`` holds (``fits`` monotone: true up to some batch),
    by bisection; ``0`` where it holds for none."""
    best, lo, hi = 0, 1, limit
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def largest_resident_batch(shape: ModelShape, context_tokens: int, device_free_bytes: int,
                           config: OffloadConfig | None = None, margin_gib: float = 8.0,
                           limit: int = 4096) -> int:  # fmt: skip
    """The largest batch whose every sealed block ``admission="auto"`` keeps in device memory, with ``margin_gib``
    of ``device_free_bytes`` (the device's memory less the weights) left for the model's temporaries, CUDA graphs and
    allocator fragmentation (the cache bounded by :func:`suggested_device_memory_gib`).

    Past this batch part of the KV is read from host memory at every step that selects it. ``0`` where not even
    one sequence fits that way.
    """
    gib = suggested_device_memory_gib(shape, context_tokens, 1, config, device_free_bytes, margin_gib)
    config = (config or OffloadConfig()).replace(admission="auto", device_memory_gib=gib)

    def fits(batch: int) -> bool:
        p = plan(shape, context_tokens, batch, "offload", config)
        return p.host_kv_bytes == 0 and p.peak_device_bytes + margin_gib * GIB <= device_free_bytes

    return _largest(fits, limit)
