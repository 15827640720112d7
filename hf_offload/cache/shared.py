"""What the offloaded layers of one cache share per device: admission budget, side streams, decode inputs, the
memory pool and stream of their CUDA graphs, and the phase timer."""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable

import torch

from ..attention import prefill
from ..attention.inputs import DecodeInputs
from ..attention.prefill import repeat_rows
from ..config import OffloadConfig
from ..selectors import Selector, get_selector
from ..store import DeviceAdmission, transfer
from ..timing import PhaseTimer
from .capture import (
    CapturedDecode,
    CapturedLayer,
    CapturedWork,
    StaticInputs,
    _capture_on,
    capture,
    capture_decoder_layer,
    capture_work,
)


class _PoolLease:
    """A CUDA graph memory pool held open by an anchor graph (a one-element fill captured into it), so that it outlives
    the graphs captured into it and can be handed to the next cache: the allocator frees the memory of a pool whose
    every graph is gone only on ``torch.cuda.empty_cache()`` or when an allocation fails, so a pool per cache would
    keep one more pool's memory reserved after every cache (a process making a cache per request would grow)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream):
        self.handle = torch.cuda.graph_pool_handle()
        self.anchor = _capture_on(device, lambda: torch.zeros(1, device=device), self.handle, stream)


_IDLE_POOLS: dict[torch.device, list[_PoolLease]] = {}  # pools no live cache captures into, per device
_IDLE_LOCK = threading.Lock()
_IDLE_LIMIT = 1  # idle pools kept per device; one more returned is let go (its memory freed at empty_cache())


def _take_pool(device: torch.device, stream: torch.cuda.Stream) -> _PoolLease:
    """An idle graph pool of ``device`` (its freed memory reused), or a new one. At most as many pools exist per device
    as caches have graphs on it at once."""
    with _IDLE_LOCK:
        idle = _IDLE_POOLS.get(device)
        if idle:
            return idle.pop()
    return _PoolLease(device, stream)


def _return_pool(device: torch.device, lease: _PoolLease) -> None:
    """Give back a pool none of whose graphs (but its anchor) lives any more; past :data:`_IDLE_LIMIT` idle pools
    on the device it is let go."""
    with _IDLE_LOCK:
        idle = _IDLE_POOLS.setdefault(device, [])
        if len(idle) < _IDLE_LIMIT:
            idle.append(lease)


def release_graph_pools() -> int:
    """Let go of the CUDA graph memory pools that no cache uses: the caches of a process hand their pool on to the
    next cache (so that a cache per request does not grow the memory the allocator reserves), and one idle pool per
    device stays reserved after the last cache is gone. The states collected caches parked for the next cache of
    their model (:func:`~hf_offload.cache.parking.release_parked`) are freed first, their pools with them. Call this,
    then ``torch.cuda.empty_cache()``, to give that memory back. Returns how many pools were let go."""
    from .parking import release_parked

    release_parked()
    with _IDLE_LOCK:
        released = sum(len(idle) for idle in _IDLE_POOLS.values())
        _IDLE_POOLS.clear()
    return released


class DeviceResources:
    """Per-device objects the offloaded layers of one cache share, created on first use: the device admission
    budget, the side streams and the phase timer; and what is the cache's as a whole: its settings and selector as
    they stand (:meth:`coarsen_summaries` changes both). Holds no strong reference to the cache or its layers."""

    def __init__(self, config: OffloadConfig, selector: Selector | None = None):
        self.config = config
        self.selector = get_selector(config.selector) if selector is None else selector
        self.initial = (config.selector, self.selector)  # the level reset() goes back to
        self.layers: weakref.WeakSet = weakref.WeakSet()  # the cache's offloaded layers (OffloadLayer.set_selector)
        self.coarsenings: list[dict] = []  # one entry per coarsening of the summaries (stats()["summary_levels"])
        self.admissions: dict[torch.device, DeviceAdmission] = {}
        self.transfer_streams: dict[torch.device, transfer.TransferStreams] = {}
        self.phase_timer: PhaseTimer | None = None
        self.inputs: dict[torch.device, DecodeInputs] = {}
        self.graph_pools: dict[torch.device, tuple] = {}
        self.live_graphs: dict[torch.device, int] = {}
        self.graph_bytes: dict[torch.device, int] = {}  # device memory the captures reserved, while a graph lives
        self.pool_leases: dict[torch.device, _PoolLease] = {}
        self.statics: dict[torch.device, StaticInputs] = {}

    def admission(self, device: torch.device) -> DeviceAdmission | None:
        """The device memory of the cache on ``device`` (one per device): admission of blocks where ``admission`` is
        "auto", the bound ``device_memory_gib`` where set; ``None`` where neither applies."""
        config = self.config
        if config.admission != "auto" and config.device_memory_gib is None:
            return None
        if device not in self.admissions:
            gib = config.device_memory_gib
            admission = DeviceAdmission(
                device, None if gib is None else int(gib * (1 << 30)), admits=config.admission == "auto"
            )
            admission.coarsen = weakref.WeakMethod(self.coarsen_summaries)
            self.admissions[device] = admission
        return self.admissions[device]

    def restore_level(self) -> None:
        """After a reset (no summaries held): the selector the cache was built with again, in every layer (also in
        those a coarsening that failed part-way had reached)."""
        spec, selector = self.initial
        if self.selector is not selector:
            self.selector = selector
            self.config = self.config.replace(selector=spec)
        for layer in self.layers:
            if layer.selector is not selector:
                layer.set_selector(selector)
                layer.set_config(self.config)
        self.coarsenings.clear()

    def coarsen_summaries(self) -> bool:
        """Re-encode the block summaries of every offloaded layer at the selector's next coarser level
        (:meth:`Selector.coarser <hf_offload.selectors.base.Selector.coarser>`) and use that level from now on (the
        layers' captured graphs are dropped first: they hold the old buffers). Called where a growth of the
        summaries would not fit the device (:meth:`BlockStore.make_summary_room
        <hf_offload.cache.blocks.BlockStore.make_summary_room>`); warns once per level.

        Returns:
            Whether the summaries changed: ``False`` with ``coarsen_summaries=False``, at the coarsest level, or
            while a CUDA graph is being captured.
        """
        if not self.config.coarsen_summaries or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return False
        coarser = self.selector.coarser()
        if coarser is None:
            return False
        from .persist import selector_spec

        layers = sorted(self.layers, key=lambda layer: layer.layer_idx)
        before = sum(layer.blocks.device_summary_bytes() for layer in layers if layer.blocks.is_initialized)
        for layer in layers:
            layer.graphs.reset()  # the graphs hold the old buffers, and their kernels were compiled for the old level
        for layer in layers:
            layer.set_selector(coarser)
        after = sum(layer.blocks.device_summary_bytes() for layer in layers if layer.blocks.is_initialized)
        old, new = selector_spec(self.selector), selector_spec(coarser)
        tokens = max((layer.blocks.n_tokens for layer in layers if layer.blocks.is_initialized), default=0)
        self.selector = coarser
        self.config = self.config.replace(selector=new)
        for layer in layers:
            layer.set_config(self.config)
        self.coarsenings.append({"from": old, "to": new, "tokens": tokens, "summary_bytes_before": before,
                                 "summary_bytes_after": after})  # fmt: skip
        warnings.warn(
            f"The block summaries no longer fit the device at {tokens} tokens per sequence: re-encoded from "
            f"{old!r} ({before / (1 << 20):.1f} MiB) to {new!r} ({after / (1 << 20):.1f} MiB); decoding goes on at "
            "that level (docs/tuning.md, 'Summaries that fit', has each level's accuracy). More device memory for the "
            "cache (device_memory_gib), a smaller batch or a shorter context keeps the finer level; "
            "coarsen_summaries=False raises MemoryError instead.",
            RuntimeWarning,
            stacklevel=2,
        )
        return True

    def streams(self, device: torch.device) -> transfer.TransferStreams:
        """The side streams of a CUDA device: one set per device and process
        (:func:`~hf_offload.store.transfer.device_streams`)."""
        if device not in self.transfer_streams:
            self.transfer_streams[device] = transfer.device_streams(device)
        return self.transfer_streams[device]

    def decode_inputs(self, device: torch.device) -> DecodeInputs:
        """The shared inputs of the decode step on ``device`` (one per device)."""
        return self.inputs.setdefault(device, DecodeInputs())

    def capture_graph(self, device: torch.device, body, query: torch.Tensor, held: tuple) -> CapturedDecode:
        """Capture a layer's decode step (:func:`~hf_offload.cache.capture.capture`) into the memory pool that the graphs of
        the cache's layers on ``device`` share: they replay one after the other, in the order they were captured,
        so their temporaries may share memory, which needs one capture stream for all of them (the allocator reuses
        a block only on the stream that freed it). The cache holds the pool while one of its graphs lives; after the
        last one is dropped (a reset, the cache let go of) the pool goes back to the process's idle pools, and the
        next capture of this or another cache takes one from there."""
        return self._in_pool(device, lambda pool, stream: capture(body, query, pool, held, stream))

    def capture_layer(self, device: torch.device, forward, args: tuple, kwargs: dict, held: tuple,
                      pad=None) -> CapturedLayer:  # fmt: skip
        """Capture a whole decoder layer's decode step or question
        (:func:`~hf_offload.cache.capture.capture_decoder_layer`) into the same pool and on the same stream as
        :meth:`capture_graph`, its tensor arguments read from :meth:`static_inputs` (``pad``: padded as a
        question's)."""
        statics = self.static_inputs(device)
        return self._in_pool(
            device, lambda pool, stream: capture_decoder_layer(forward, args, kwargs, statics, pool, held, stream, pad)
        )

    def capture_work(self, device: torch.device, enqueue, held: tuple) -> CapturedWork:
        """Capture work without arguments (:func:`~hf_offload.cache.capture.capture_work`; a layer's seal of a block) into
        the same pool and on the same stream as :meth:`capture_graph`."""
        return self._in_pool(device, lambda pool, stream: capture_work(enqueue, device, pool, held, stream))

    def _in_pool(self, device: torch.device, capture_with: Callable):
        """``capture_with(pool, stream)`` with the pool and capture stream the cache's graphs on ``device`` share;
        the captured graph is counted as one of the pool's (a failed capture sends later ones to a new pool)."""
        self._pool(device)
        before = _reserved_bytes(device)
        try:
            captured = capture_with(self.graph_pools[device], self.streams(device).capture)
        except Exception:
            self._pool_failed(device)
            raise
        finally:
            grown = _reserved_bytes(device) - before
            if grown > 0:
                self.graph_bytes[device] = self.graph_bytes.get(device, 0) + grown
        return self._count_graph(device, captured)

    def graph_pool_bytes(self, device: torch.device) -> int:
        """Device memory this cache's graph captures on ``device`` reserved (the allocator's growth while they ran)
        while one of its graphs lives; 0 once its last graph is dropped (the pool, and what it reserved, then serves
        the next cache). Reported by ``stats()["graph_pool_bytes"]``; not counted under ``device_memory_gib``."""
        return self.graph_bytes.get(device, 0) if self.live_graphs.get(device) else 0

    def static_inputs(self, device: torch.device) -> StaticInputs:
        """The fixed-address input buffers of the decoder-layer graphs on ``device``."""
        return self.statics.setdefault(device, StaticInputs())

    def _pool(self, device: torch.device) -> None:
        if device not in self.pool_leases:
            lease = _take_pool(device, self.streams(device).capture)
            self.pool_leases[device] = lease
            self.graph_pools[device] = lease.handle

    def _pool_failed(self, device: torch.device) -> None:
        """After a failed capture: later captures go to a new pool (the allocator may still count the failed
        capture as recording into the old one, which refuses every later capture into it); the old pool is not
        handed to another cache, and the next capture takes a pool (:meth:`_pool`)."""
        self.pool_leases.pop(device, None)

    def _count_graph(self, device: torch.device, captured):
        self.live_graphs[device] = self.live_graphs.get(device, 0) + 1
        weakref.finalize(captured, self._graph_dropped, device, self.pool_leases[device])
        return captured

    def _graph_dropped(self, device: torch.device, lease: _PoolLease) -> None:
        self.live_graphs[device] -= 1
        if self.live_graphs[device] == 0:
            self.graph_bytes.pop(device, None)
            if self.pool_leases.get(device) is lease:
                del self.pool_leases[device]
                _return_pool(device, lease)

    def timer(self, device: torch.device) -> PhaseTimer:
        """The cache's phase timer."""
        if self.phase_timer is None:
            self.phase_timer = PhaseTimer(device)
        return self.phase_timer


def _reserved_bytes(device: torch.device) -> int:
    """Device memory the allocator holds on ``device`` (0 off CUDA)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    return torch.cuda.memory_reserved(device)


def forward_transient_bytes(model_config, batch: int, q_len: int, dtype_bytes: int, tile_tokens: int,
                            cached_tokens: int = 0, segmented: bool = True, cpu: bool = False) -> int:  # fmt: skip
    """Device bytes a forward of ``batch x q_len`` new tokens holds at its peak besides weights and cache, as its
    shapes predict them: the MLP's intermediate activations (three of them), a few hidden-size copies (residual,
    norm, attention output), the query, the prefill attention's score tile (``batch x heads x tile**2`` floats),
    the last position's logits in float32 and, for a prefill chunk after ``cached_tokens`` tokens, what its
    attention holds (:func:`~hf_offload.attention.prefill.chunk_prefill`): one layer's earlier keys and values
    recalled to the device with the chunk's behind them, plus one KV head's repeated for its query heads over a
    slice of the batch; or, where ``segmented`` and query heads share KV heads or segments hold less
    (``segments_pay``), one segment of them (at most :data:`~hf_offload.attention.prefill.SEGMENT_BYTES`), the
    chunk's own keys and values repeated for the query heads, the stacked queries and their output, and twice the
    float32 accumulator of a slice of the batch. An estimate for admission, which
    learns the real peak after the forward.

    Args:
        model_config: the decoder's text config.
        batch, q_len: the forward's shape.
        dtype_bytes: bytes per activation element.
        tile_tokens: queries per prefill attention tile (``prefill_chunk_tokens``).
        cached_tokens: tokens per sequence the cache holds before this forward.
        segmented: a later chunk may attend its earlier blocks in segments (the device's fused attention gives its
            log-sum-exp: :func:`~hf_offload.attention.prefill.lse_attention_available`).
        cpu: the forward runs on the CPU (a later chunk then attends in parts wherever query heads share a KV head:
            :func:`~hf_offload.attention.prefill.in_parts`).
    """
    hidden = getattr(model_config, "hidden_size", 0) or 0
    inter = getattr(model_config, "intermediate_size", None) or 4 * hidden
    heads = getattr(model_config, "num_attention_heads", 0) or 0
    head_dim = getattr(model_config, "head_dim", None) or (hidden // heads if heads else 0)
    vocab = getattr(model_config, "vocab_size", 0) or 0
    tokens = batch * q_len
    tile = min(q_len, tile_tokens)
    scores = batch * heads * tile * tile * 4 if q_len > 1 else 0
    recalled = 0
    if q_len > 1 and cached_tokens:
        kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
        group = heads // kv_heads if kv_heads else 1
        keys = batch * (cached_tokens + q_len) * head_dim * dtype_bytes  # one head's keys
        repeated = 0
        if group > 1:  # one KV head's repeated for its query heads, over a slice of the batch
            rows = min(batch, repeat_rows(group, cached_tokens + q_len, head_dim, dtype_bytes))
            repeated = 2 * group * keys // batch * rows
        recalled = 2 * kv_heads * keys + repeated
        earlier = 2 * kv_heads * batch * cached_tokens * head_dim * dtype_bytes
        if segmented and prefill.in_parts(cpu, group, earlier, batch, heads, q_len, head_dim):
            accumulator = prefill.accumulator_bytes(batch, heads, q_len, head_dim)
            own = 0  # the earlier parts are attended without repeats; the chunk's own keys are repeated
            if group > 1:
                rows = min(batch, repeat_rows(group, q_len, head_dim, dtype_bytes))
                own = 2 * group * q_len * head_dim * dtype_bytes * rows
            # The stacked call's query copy and output, a slice of the sequences at a time.
            stacked = 2 * accumulator // (4 * (head_dim + 1)) * head_dim * dtype_bytes if group > 1 else 0
            recalled = min(earlier, prefill.SEGMENT_BYTES) + own + stacked + 2 * accumulator
    return (tokens * (3 * inter + 4 * hidden + heads * head_dim) * dtype_bytes + scores + 2 * batch * vocab * 4
            + recalled)  # fmt: skip
