"""``OffloadCache``: a transformers ``Cache`` whose full-attention layers keep their KV in host memory.

Per full-attention layer (:class:`OffloadLayer`):

* the open block (fewer than ``block_tokens`` most recent tokens) stays on the compute device;
* every sealed block is written to the layer's host pool (one contiguous block = K and V of all KV heads) and
  summarised on the device for scoring;
* a device slot pool keeps recently used blocks across decode steps; decode recalls only the selected blocks that
  are not resident;
* with lookahead, a decode step scores the next offloaded layer's blocks with that layer's query predicted from this
  layer's input (or with this layer's query) and starts their recall early (on a side stream on CUDA); the next
  layer's own plan then finds them resident.

Sliding-window layers of hybrid models (e.g. Gemma 3) keep transformers' own dense sliding-window layer on the
device: their KV is bounded by the window.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from . import transfer
from .attention import Handoff, OffloadMask, _plain_causal, leave_handoff, take_handoff
from .config import OffloadConfig
from .kernels.append import append_token
from .kernels.seal import seal_block, seal_block_supported
from .graphs import (
    CapturedDecode,
    CapturedLayer,
    CapturedWork,
    DecodeInputs,
    StaticInputs,
    call_signature,
    capture,
    capture_decoder_layer,
    capture_work as _capture_work,
    forced_blocks,
    replay_layer,
)
from .lookahead import speculative_query
from .patches import install as install_patches, installed as installed_patches
from .patches.layers import decoder_layers
from .patches.norms import FusedNorm, fused_norms_active
from .patches.projections import fused_groups, fused_projections_active, projections_on
from .patches.rotary import RotaryForward, fused_rotary_active
from .selectors import Selection, Selector, get_selector
from .selectors.base import unselected_tokens
from .selectors.quantkey import QuantKeySelector
from .selectors.transfer_cap import cap_transfers, resident_blocks
from .store import DeviceAdmission, DeviceSlotPool, HostBlockPool, HostMemoryBudget
from .timing import PhaseTimer

_SLIDING_TYPES = ("sliding_attention", "chunked_attention")
# Block summaries are allocated this many blocks at a time per layer: a seal writes in place, and the buffers grow
# (one copy) only every SUMMARY_CHUNK_BLOCKS blocks, instead of a new allocation of every summary at every seal,
# whose freed predecessors fragment device memory when it is nearly full.
SUMMARY_CHUNK_BLOCKS = 256
# Blocks by which a decode step's scored blocks grow (decode_capacity_blocks=None and a selector with masks_invalid):
# one graph capture per this many seals where the layer replays CUDA graphs, and the same rounding op by op, so that a
# step's sums run over the same blocks with graphs or without.
GRAPH_CAPACITY_BLOCKS = 64


class LayerStats:
    """Counters of one layer.

    Counters are Python ints or 0-d device tensors. Device counts of decode steps may be queued with
    :meth:`add_later` (no operation per step) and are summed when a counter is read, or when the queue is long.
    Counts added while a CUDA graph is being captured go into a persistent device tensor instead, one entry per
    distinct ``(fields, factor)`` of :meth:`add_later` (one in-place add per call, recorded in the graph; the factor
    and the fields are applied when a counter is read), so that every replay of the graph counts; masks counted with
    :meth:`count_later` go into a persistent count per element instead (one launch per replay).
    """

    FIELDS = (
        "lookups",  # kept (sequence, head, block) entries looked up in decode
        "hits",
        "recalled_blocks",  # host-to-device transfers (whole blocks or single-head pieces)
        "recalled_bytes",
        "decode_recalled_blocks",  # the part of the two above recalled by decode steps
        "decode_recalled_bytes",
        "decode_host_bytes",  # the part of decode_recalled_bytes read from host memory (the rest: admitted blocks)
        "offloaded_bytes",
        "decode_steps",
        "prefetched_blocks",  # speculative recalls (lookahead); included in the recall counters above
        "prefetched_bytes",
        "prefetch_used_blocks",  # prefetched blocks that the exact plan that followed attended
        "graph_captures",  # decode steps captured into a CUDA graph (op by op first unless their geometry was warm)
        "graph_replays",  # decode steps replayed from a captured graph
        "graph_capture_us",  # host wall time of the decode steps that captured (any op-by-op run + the capture)
        "graph_capture_retries",  # captures of a warm geometry that failed; the step then ran op by op
        "layer_graph_captures",  # decode steps of a whole decoder layer captured into a CUDA graph
        "layer_graph_replays",  # decode steps of a whole decoder layer replayed (included in graph_replays)
        "seal_graph_captures",  # seals of a full block after a replayed step, captured into a CUDA graph
        "seal_graph_replays",  # seals of a full block after a replayed step, replayed from that graph
        "tail_ppm",  # estimated attention share outside the selection (tail_bits), millionths, summed over steps
        "tail_steps",  # decode steps with that estimate
        "reused_selections",  # decode steps that attended the previous step's selection (reselect_every)
    )
    _QUEUE = 256  # queued counts summed at once in the decode loop (bounds the tensors kept alive)
    _CAPTURE_SLOTS = 64  # distinct (fields, factor) counts that captured graphs may add into

    def __init__(self) -> None:
        # (fields, factor, mask shape) -> per-element counts of the masks captured graphs add (count_later)
        self._captured_masks: dict[tuple[tuple[str, ...], int, tuple[int, ...]], torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Zero every counter."""
        self._totals = dict.fromkeys(self.FIELDS, 0)
        self._queued: dict[tuple[tuple[str, ...], int], list[torch.Tensor]] = {}
        self._n_queued = 0
        with torch.inference_mode():  # made in whatever mode the decode ran; in place, as graphs add into them
            if getattr(self, "_captured", None) is not None:
                self._captured.zero_()
            for buffer in self._captured_masks.values():
                buffer.zero_()

    def prepare_capture(self, device: torch.device) -> None:
        """Allocate the device counters that captured graphs add into (before the first capture; idempotent)."""
        if getattr(self, "_captured", None) is None:
            self._captured = torch.zeros(self._CAPTURE_SLOTS, dtype=torch.int64, device=device)
            self._capture_slots: dict[tuple[tuple[str, ...], int], int] = {}  # (fields, factor) -> entry

    def add(self, fields: tuple[str, ...], value) -> None:
        """Add ``value`` (an int or a 0-d device tensor) to each of ``fields`` now."""
        for name in fields:
            self._totals[name] = self._totals[name] + value

    def add_later(self, fields: tuple[str, ...], value: torch.Tensor, factor: int = 1) -> None:
        """Add ``factor * value`` to each of ``fields`` when the counters are next read (an int: now).

        Args:
            fields: counter names.
            value: a 0-d integer tensor on the compute device, or an int.
            factor: a constant multiplier (e.g. bytes per block, or ``-1``).
        """
        if not isinstance(value, torch.Tensor):
            self.add(fields, value * factor)
            return
        if value.is_cuda and torch.cuda.is_current_stream_capturing():
            slot = self._capture_slots.get((fields, factor))
            if slot is None:
                if len(self._capture_slots) == self._CAPTURE_SLOTS:
                    raise RuntimeError(f"LayerStats: more than {self._CAPTURE_SLOTS} distinct counts in captured graphs")
                slot = self._capture_slots[(fields, factor)] = len(self._capture_slots)
            self._captured.select(0, slot).add_(value)
            return
        self._queued.setdefault((fields, factor), []).append(value)
        self._n_queued += 1
        if self._n_queued >= self._QUEUE:
            self.settle()

    def count_later(self, fields: tuple[str, ...], mask: torch.Tensor, factor: int = 1) -> None:
        """Add ``factor`` times the number of ``True`` elements of ``mask`` to each of ``fields`` when the counters
        are next read. While a CUDA graph is being captured, the mask itself is added into a persistent per-element
        count of its shape (one launch per replay, where a sum and an add would take three), summed when read; that
        count is allocated at the first call outside a capture (an allocation inside one would be the graph's, its
        zeros replayed), so a capture that finds none counts through :meth:`add_later`.

        Args:
            fields: counter names.
            mask: ``torch.bool``, any shape, on the compute device.
            factor: a constant multiplier.
        """
        key = (fields, factor, tuple(mask.shape))
        if mask.is_cuda and torch.cuda.is_current_stream_capturing():
            buffer = self._captured_masks.get(key)
            if buffer is not None:
                buffer.add_(mask)
                return
        elif mask.is_cuda and key not in self._captured_masks:  # made in the decode's own mode, as the graphs' adds
            self._captured_masks[key] = torch.zeros(mask.shape, dtype=torch.int64, device=mask.device)
        self.add_later(fields, mask.sum(), factor)

    def settle(self) -> None:
        """Sum the queued device counts into the counters (device operations only, no host synchronisation)."""
        queued, self._queued, self._n_queued = self._queued, {}, 0
        for (fields, factor), values in queued.items():
            total = torch.stack(values).sum() * factor
            self.add(fields, total)


def _counter(name: str) -> property:
    def get(self: LayerStats):
        if self._n_queued:
            self.settle()
        total = self._totals[name]
        for (fields, factor), slot in getattr(self, "_capture_slots", {}).items():
            if name in fields:
                total = total + self._captured[slot] * factor
        for (fields, factor, _), buffer in getattr(self, "_captured_masks", {}).items():
            if name in fields:
                total = total + buffer.sum() * factor
        return total

    def set(self: LayerStats, value) -> None:
        self._totals[name] = value

    return property(get, set)


for _name in LayerStats.FIELDS:
    setattr(LayerStats, _name, _counter(_name))


@dataclass
class _LayerCapture:
    """What a decode step of a whole decoder layer being captured uses: the step's shared inputs, the blocks it
    scores, the blocks the budget selects, and whether it reuses the layer's kept selection (``reselect_every``)."""

    inputs: DecodeInputs
    n: int
    k: int
    reuse: bool = False


@dataclass
class _KeptSelection:
    """The selection a layer's decode steps reuse (``OffloadConfig.reselect_every`` above 1).

    Attributes:
        pos: cache position of the token of the step that chose it.
        key: ``(sealed blocks, blocks selected, blocks scored, batch)`` of that step; a step reuses the selection
            only with the same key (a seal changes it).
        blocks: ``[batch, 1 or kv_heads, k]``, ``torch.int64``, compute device: the chosen blocks, written by the
            choosing step's device work (in place, so that captured graphs read and write the same buffer).
        keep: same shape, ``torch.bool``: which entries are attended.
    """

    pos: int
    key: tuple
    blocks: torch.Tensor
    keep: torch.Tensor


def _hidden_states(args: tuple, kwargs: dict):
    """The hidden states of a decoder layer call (its first positional argument or ``hidden_states``)."""
    return args[0] if args else kwargs.get("hidden_states")


def call_fusions(config: OffloadConfig, args: tuple, kwargs: dict) -> tuple[bool, bool, bool]:
    """Whether a decoder layer call runs its RMS norms and its rotary embedding with the kernels and its sibling
    projections as one product: :func:`fusions_on` for the device of its hidden states."""
    hidden = _hidden_states(args, kwargs)
    return fusions_on(config, hidden.device) if isinstance(hidden, torch.Tensor) else (False, False, False)


def fusions_on(config: OffloadConfig, device: torch.device) -> tuple[bool, bool, bool]:
    """Whether decoder layer calls on ``device`` run their RMS norms (``config.fused_norms``) and their rotary
    embedding (``config.fused_rotary``) with the kernels, and their sibling projections as one product
    (``config.fused_projections``, :func:`~hf_offload.patches.projections.projections_on`).

    Raises:
        RuntimeError: either set to ``True`` where Triton cannot run.
    """
    from .kernels.gather import kernels_available  # looked up at call time (benchmarks stand in for it)

    triton_here = kernels_available(device)
    on = []
    for name in ("fused_norms", "fused_rotary"):
        setting = getattr(config, name)
        if setting and not triton_here:
            raise RuntimeError(
                f"{name}=True needs Triton on the layer's device ({device}); use {name}=None (on where Triton runs on "
                "CUDA) or False."
            )
        on.append(bool(triton_here and (device.type == "cuda" if setting is None else setting)))
    return on[0], on[1], projections_on(config, device)


@contextlib.contextmanager
def fused(fusions: tuple[bool, bool, bool]):
    """Run the enclosed decoder layer call with its norms, rotary embedding and projections fused as ``fusions``
    says (:func:`fusions_on`)."""
    with fused_norms_active(fusions[0]), fused_rotary_active(fusions[1]), fused_projections_active(fusions[2]):
        yield


class OffloadLayer(CacheLayerMixin):
    """The KV state of one full-attention layer: open block on device, sealed blocks on host, hot blocks in slots.

    ``self.keys`` / ``self.values`` hold the open block, shape ``[batch, kv_heads, < block_tokens, head_dim]``: views
    of fixed buffers of one block, whose addresses never change (captured decode graphs read them in place).

    Args:
        config: the cache's validated settings.
        selector: the block selection policy.
        layer_idx: index of this layer in the model.
        budget: the cache-wide host memory budget.
        cache_id: identity of the owning cache.
        model_config: the (text) config object of the model the cache was built for.
        admission: returns the cache's :class:`~hf_offload.store.DeviceAdmission` for a device, or ``None``
            (every block offloaded).
        timer: returns the cache's :class:`~hf_offload.timing.PhaseTimer` for a device (called when timing is on).
        is_first_offload_layer: whether this layer marks the start of each decode step for the timer.
        streams: returns the cache's :class:`~hf_offload.transfer.TransferStreams` for a CUDA device.
        decode_inputs: returns the cache's :class:`~hf_offload.graphs.DecodeInputs` for a device.
        capture_graph: ``(device, body, query, held) -> CapturedDecode``: captures a decode step into a CUDA graph
            in the memory pool the cache's graphs on ``device`` share (see :func:`~hf_offload.graphs.capture`).
        capture_layer: ``(device, forward, args, kwargs, held) -> CapturedLayer``: captures a whole decoder layer's
            decode step in that pool (see :func:`~hf_offload.graphs.capture_decoder_layer`).
        capture_work: ``(device, enqueue, held) -> CapturedWork``: captures work without arguments in that pool (see
            :func:`~hf_offload.graphs.capture_work`; the seal of a full block, :meth:`seal_work`).

    Attributes:
        next_layer: the next offloaded layer of the model (the target of lookahead), or ``None``.
        next_decoder: the next offloaded layer's decoder layer module where it is the adjacent one (the source of
            the predicted query of ``lookahead_query="next"``), or ``None``.
        lookahead: whether decode steps of this layer prefetch for ``next_layer`` (resolved from the config).
        graphs: whether decode steps of this layer replay captured CUDA graphs (resolved from the config).
        capacity_blocks: a decode step scores the sealed blocks rounded up to a multiple of this (resolved from
            ``decode_capacity_blocks``; see :meth:`decode_capacity`).
        seal_graphs: whether the seals that follow replayed decode steps replay captured graphs
            (:meth:`_seal_replayed`); ``False`` once a capture failed, or set to seal op by op.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        config: OffloadConfig,
        selector: Selector,
        layer_idx: int,
        budget: HostMemoryBudget,
        cache_id: int,
        model_config,
        admission=lambda device: None,
        timer=lambda device: None,
        is_first_offload_layer: bool = True,
        streams=lambda device: None,
        decode_inputs: Callable[[torch.device], DecodeInputs] | None = None,
        capture_graph=None,
        capture_layer=None,
        capture_work=None,
    ):
        super().__init__()
        self.config = config
        self.selector = selector
        self.layer_idx = layer_idx
        self.block_tokens = config.block_tokens
        self.budget = budget
        self.cache_admission = admission
        self.cache_timer = timer
        self.is_first_offload_layer = is_first_offload_layer
        self.cache_streams = streams
        self._own_inputs: dict[torch.device, DecodeInputs] = {}
        self.cache_decode_inputs = decode_inputs or (lambda device: self._own_inputs.setdefault(device, DecodeInputs()))
        self.cache_capture_graph = capture_graph or (lambda device, body, query, held: capture(body, query, None, held))
        own_statics = StaticInputs()
        self.cache_capture_layer = capture_layer or (
            lambda device, forward, args, kwargs, held: capture_decoder_layer(forward, args, kwargs, own_statics, None, held)
        )
        self.cache_capture_work = capture_work or (
            lambda device, enqueue, held: _capture_work(enqueue, device, None, held)
        )
        self._layer_capture: _LayerCapture | None = None  # set while a whole decoder layer is being captured
        self.layer_graphs = True  # False once a capture of the whole decoder layer failed
        self.graphs = False
        self.paged = False  # decided at the first update (_want_paged)
        self.capacity_blocks = 1
        self._storage_epoch = 0  # counts replacements of the summary and block-table buffers (graphs read them)
        self._graphs: dict[tuple, CapturedDecode] = {}
        self.warm_geometries: set[tuple] = set()  # warm_for() values of the decode steps run op by op
        self.next_layer: OffloadLayer | None = None
        self.next_decoder: torch.nn.Module | None = None
        self._prefetched_ahead = False  # this step's lookahead ran before the layer (lookahead_query="next")
        self.lookahead = False
        self.streams = None
        self._clear_transfer_state()
        self.cache_id = cache_id
        self.model_config = model_config
        self.model_name = getattr(model_config, "model_type", "?")
        self.stats = LayerStats()
        self.timer = None  # a PhaseTimer shared by the cache's layers when timing is on
        self.n_tokens = 0
        self.n_blocks = 0
        self._reserved_blocks = 0  # summary capacity asked for by reserve()
        self._window_insert: tuple[int, torch.Tensor] | None = None
        self.seal_graphs = True
        self._seal_args: torch.Tensor | None = None  # [1 + batch], int64, device: what seal_work reads
        self._kept: _KeptSelection | None = None  # the selection reused by the next steps (reselect_every)
        self._kept_buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # its buffers, by shape

    # ------------------------------------------------------------------------------------------------- life cycle
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate the device slot pool and an empty host pool for the shapes of the first update."""
        batch, heads, _, head_dim = key_states.shape
        if value_states.shape[-1] != head_dim:
            raise NotImplementedError(
                f"Layer {self.layer_idx}: keys and values of different head sizes ({head_dim} vs "
                f"{value_states.shape[-1]}) are not supported."
            )
        self.batch, self.kv_heads, self.head_dim = batch, heads, head_dim
        self.dtype, self.device = key_states.dtype, key_states.device
        pin = self.config.pin_memory
        if pin is None:
            pin = self.device.type == "cuda"
        self.host = HostBlockPool(
            (2, heads, self.block_tokens, head_dim),
            self.dtype,
            pin_memory=bool(pin),
            chunk_bytes=int(self.config.host_chunk_mib * (1 << 20)),
            budget=self.budget,
            admission=self.cache_admission(self.device),
        )
        self.pool = DeviceSlotPool(
            batch, self.config.pool_blocks, heads, self.block_tokens, head_dim, self.dtype, self.device, open_slot=True
        )
        # CPU: host block id per (sequence, block): the first n_blocks columns of a buffer that grows by whole chunks.
        self._block_table_store = torch.full((batch, 0), -1, dtype=torch.int64)
        self.block_table = self._block_table_store
        self.use_kernels = self._want_kernels(bool(pin))
        if self.use_kernels:
            # Device copy of the block table, [batch, capacity]: -1 past the sealed blocks; grows like the summaries,
            # so that a seal writes in place and a captured graph reads it over several seals.
            self.block_table_dev = torch.full((batch, 0), -1, dtype=torch.int64, device=self.device)
        self.paged = self._want_paged()
        # Side streams only where the kernel path runs asynchronously (CUDA); elsewhere every copy is synchronous.
        self.streams = self.cache_streams(self.device) if self.use_kernels and self.device.type == "cuda" else None
        self.resolve_lookahead()
        # Block summaries: ``summaries[name]`` is a view of the first ``n_blocks`` blocks of a buffer that grows by
        # SUMMARY_CHUNK_BLOCKS at a time, so that a seal writes in place instead of re-allocating every summary.
        self.summaries: dict[str, torch.Tensor] = {}
        self._summary_store: dict[str, torch.Tensor] = {}
        self._entry_index_memo: dict[tuple[int, object], object] = {}
        # The open block lives in the slot pool's open slot (one block; positions past the filled ones are never
        # attended), so that decode attention reads it with the selected slots in one call.
        self._open_k, self._open_v = self.pool.open_keys, self.pool.open_values
        self.keys, self.values = self._open_k[:, :, :0], self._open_v[:, :, :0]
        self.is_initialized = True

    def _want_kernels(self, pinned: bool) -> bool:
        from .kernels.gather import kernels_available

        # On CUDA the kernels read and write host memory through unified addressing, which needs pinned memory.
        possible = kernels_available(self.device) and (pinned or self.device.type == "cpu")
        if self.config.transfer == "kernel" and not possible:
            raise RuntimeError(
                "transfer='kernel' needs a CUDA device, a pinned host pool and Triton; use transfer='auto' or 'torch'."
            )
        return possible and self.config.transfer != "torch"

    def _want_paged(self) -> bool:
        """Whether decode steps attend through :func:`~hf_offload.kernels.paged.paged_decode` (admitted blocks read
        in place); see ``OffloadConfig.decode_attention``."""
        from .kernels.paged import paged_decode_supported

        wanted = self.config.decode_attention
        if wanted == "pool":
            return False
        possible = self.use_kernels and paged_decode_supported(self.pool.data)
        if wanted == "paged" and not possible:
            raise RuntimeError(
                "decode_attention='paged' needs the kernel transfer path (CUDA, a pinned host pool and Triton), a "
                "float16, bfloat16 or float32 cache and a power-of-two head_dim >= 16; use decode_attention='auto' "
                "or 'pool'."
            )
        return possible and (wanted == "paged" or self.device.type == "cuda")

    def switch_to_torch_transfer(self) -> None:
        """Move this layer's coming decode steps to the portable transfer path (``transfer="torch"``) after its
        blocks were written through the kernels, and re-derive what the kernel path decided: no paged decode
        attention, no CUDA graphs (a step of the torch path synchronises with the host, which a capture refuses).
        Host contents, block table and summaries are the same on both paths."""
        self.use_kernels = False
        self.paged = self._want_paged()
        self.resolve_lookahead()

    def resolve_lookahead(self) -> None:
        """Set :attr:`lookahead` and :attr:`graphs` from the config: ``None`` means on with the kernel path on CUDA
        (for graphs: unless lookahead or timing is on)."""
        device = getattr(self, "device", None)  # known once the first update has fixed the device and transfer path
        kernels_on_cuda = getattr(self, "use_kernels", False) and device is not None and device.type == "cuda"
        wanted = self.config.lookahead
        self.lookahead = bool(kernels_on_cuda if wanted is None else wanted)
        graphs = self.config.cuda_graphs
        if graphs and device is not None and not kernels_on_cuda:
            raise RuntimeError(
                "cuda_graphs=True needs a CUDA device and the kernel transfer path (pinned host pool and Triton); "
                "use cuda_graphs=None (on where it can run) or False."
            )
        self.graphs = bool(kernels_on_cuda and graphs is not False and not self.lookahead and not self.config.timing)
        # Before the first update fixes the device, each layer call decides from its hidden states' device.
        self.fusions = None if device is None else fusions_on(self.config, device)
        capacity = self.config.decode_capacity_blocks
        if capacity is None:
            capacity = GRAPH_CAPACITY_BLOCKS if self.selector.masks_invalid else 1
        self.capacity_blocks = capacity
        self._graphs.clear()

    def _clear_transfer_state(self) -> None:
        # Events of the side streams (None: nothing pending, or no side streams).
        self._last_write = None  # after the host writes of every block sealed so far
        self._selectable_written = None  # after the host writes of the blocks this forward may read
        self._prefetch_event = None  # after the speculative recall into this layer's slot pool
        self._prefetched_slots: torch.Tensor | None = None  # [batch, kv_heads, slots] bool: filled by that recall
        self._fused_key: tuple | None = None  # the graph key of this layer's last fused decode step
        self._seal_offloaded = None  # after the side-stream write of the last seal replayed from a graph

    def reset(self) -> None:
        """Drop all tokens and free the pools; the next update starts afresh (any batch size)."""
        if self.is_initialized:
            if self.streams is not None:
                # Side streams may still read or write the pools (kernels over pinned memory are invisible to the
                # caching host allocator): finish them before the memory is freed.
                torch.cuda.synchronize(self.device)
            self.host.release()
            del self.pool, self.block_table, self._block_table_store, self.summaries, self._summary_store
            self.block_table_dev = None
            self.keys = self.values = self._open_k = self._open_v = None
            self.cache_decode_inputs(self.device).invalidate()
            self.is_initialized = False
        self._graphs.clear()
        self.warm_geometries.clear()
        self._seal_args = None
        self._kept = None
        self._kept_buffers.clear()
        self._clear_transfer_state()
        self.n_tokens = 0
        self.n_blocks = 0
        self._window_insert = None

    # ------------------------------------------------------------------------------------------------------ update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new tokens; seal full blocks to the host. Returns the device-resident recent tokens.

        Args:
            key_states: new keys, shape ``[batch, kv_heads, q_len, head_dim]``, compute device (after RoPE).
            value_states: new values, same shape.

        Returns:
            ``(keys, values)`` of the recent tokens: the previously open block followed by the new tokens, shape
            ``[batch, kv_heads, open + q_len, head_dim]``. The offload attention uses them together with the
            sealed blocks it selects.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            if self.config.timing:
                self.timer = self.cache_timer(self.device)
        elif key_states.shape[0] != self.batch or key_states.shape[1] != self.kv_heads:
            raise ValueError(
                f"Layer {self.layer_idx} holds batch {self.batch} x {self.kv_heads} KV heads but got keys of shape "
                f"{tuple(key_states.shape)}; use a new OffloadCache for a new batch (or call cache.reset())."
            )
        if self._layer_capture is not None:
            return self._update_captured(key_states, value_states)
        if self.timer is not None and self.is_first_offload_layer and key_states.shape[-2] == 1:
            self.timer.step_start()
        # This forward reads only blocks sealed before it: their host writes are the ones recalls wait for.
        self._selectable_written = self._last_write
        first_recent = self.n_blocks * self.block_tokens
        n_before = self.n_blocks
        if key_states.dtype != self.dtype:
            key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        T = self.block_tokens
        open_n, end = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
        if end <= T:  # decode, short chunks: the new tokens join the open block in its buffers
            self._open_k[:, :, open_n:end] = key_states
            self._open_v[:, :, open_n:end] = value_states
            recent_k, recent_v = self._open_k[:, :, :end], self._open_v[:, :, :end]
        else:
            recent_k = torch.cat([self.keys, key_states], dim=-2)
            recent_v = torch.cat([self.values, value_states], dim=-2)
        n_new = recent_k.shape[-2] // T
        left = recent_k.shape[-2] - n_new * T
        if n_new:
            self._seal(recent_k, recent_v, n_new)
            if left:  # only after a concatenation: recent_k is not the buffer
                self._open_k[:, :, :left] = recent_k[:, :, n_new * T :]
                self._open_v[:, :, :left] = recent_v[:, :, n_new * T :]
        self.keys, self.values = self._open_k[:, :, :left], self._open_v[:, :, :left]
        self.n_tokens += key_states.shape[-2]
        leave_handoff(Handoff(self, recent_k, recent_v, first_recent, n_before))
        return recent_k, recent_v

    def _update_captured(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """:meth:`update` of a decode step while the whole decoder layer is captured (:meth:`run_decoder_layer`):
        the new token goes into the open block at the position the step's shared inputs hold
        (:attr:`DecodeInputs.open_pos <hf_offload.graphs.DecodeInputs.open_pos>`), so that every replay writes
        where its step's token belongs; the host-side state is left alone (each replay updates it).

        Returns:
            The whole open block, ``[batch, kv_heads, block_tokens, head_dim]`` (positions past the step's token are
            never attended: the step's shared inputs mask them).
        """
        if key_states.dtype != self.dtype:
            key_states, value_states = key_states.to(self.dtype), value_states.to(self.dtype)
        append_token(self._open_k, self._open_v, self._layer_capture.inputs.open_pos, key_states, value_states)
        n_recent = self.keys.shape[-2] + 1
        leave_handoff(Handoff(self, self._open_k, self._open_v, self.n_blocks * self.block_tokens, self.n_blocks,
                              n_recent))  # fmt: skip
        return self._open_k, self._open_v

    def _seal(
        self, recent_k: torch.Tensor, recent_v: torch.Tensor, n_new: int, ids: torch.Tensor | None = None
    ) -> None:
        """Write the first ``n_new`` full blocks of the recent tokens to the host, summarise and cache the newest.

        Args:
            recent_k, recent_v: the recent tokens, ``[batch, kv_heads, >= n_new * block_tokens, head_dim]``, the
                cache dtype, compute device.
            n_new: full blocks to seal.
            ids: their host block ids, ``[batch * n_new]`` (sequence-major), ``torch.int64``, CPU; ``None``:
                allocated here.
        """
        batch, heads, T, D = self.batch, self.kv_heads, self.block_tokens, self.head_dim
        span = n_new * T
        keys = recent_k[:, :, :span].reshape(batch, heads, n_new, T, D).transpose(1, 2)  # [B, n, H, T, D]
        values = recent_v[:, :, :span].reshape(batch, heads, n_new, T, D).transpose(1, 2)
        blocks = torch.stack([keys, values], dim=2)  # [B, n, 2, H, T, D]: one contiguous block per (sequence, n)
        if ids is None:
            ids = self.host.allocate(batch * n_new)
        flat = blocks.reshape(-1, 2, heads, T, D)
        if self.use_kernels:
            # Stream order: the write runs on the offload stream behind the computation of these keys and values
            # (launch_on waits for the compute stream); every later recall of these blocks waits for its event.
            # The ids go through pinned memory so that their copy never blocks the host.
            ids_dev = (ids.pin_memory() if self.device.type == "cuda" else ids).to(self.device, non_blocking=True)
            self._last_write = self._offload_on_stream(ids_dev, flat)
            self.block_table_dev = self._appended(self.block_table_dev, ids_dev.view(batch, n_new), fill=-1)
            self.stats.add(("offloaded_bytes",), len(ids) * self.host.block_bytes)
        else:
            self.stats.add(("offloaded_bytes",), transfer.offload_blocks(self.host, ids, flat))
        for name, summary in self._summaries_of(keys, values).items():
            self._append_summary(name, summary)
        self._sealed(ids, blocks, n_new)

    def _summaries_of(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """The selector's summaries of new blocks (of their values too where it estimates the unselected blocks).

        Args:
            keys, values: the new blocks' keys and values, ``[batch, n_new, kv_heads, block_tokens, head_dim]``, the
                cache dtype, compute device.
        """
        summaries = self.selector.summarize(keys)
        if self.selector.estimates_tail:
            summaries.update(self.selector.summarize_values(values))
        return summaries

    def _offload_on_stream(self, ids: torch.Tensor, flat: torch.Tensor):
        """Write blocks into their host blocks on the offload stream, behind the computation of their keys and values
        (``launch_on`` waits for the compute stream); returns the write's event, which every later recall of these
        blocks waits for (``None`` without side streams: written now).

        Args:
            ids: host block ids, ``[n]``, ``torch.int64``, compute device.
            flat: the blocks, ``[n, 2, kv_heads, block_tokens, head_dim]``, contiguous, compute device.
        """
        addrs = self.host.chunk_addrs(self.device)  # refreshed on the compute stream
        return transfer.launch_on(
            self.streams.offload if self.streams is not None else None,
            lambda: transfer.offload_blocks_kernel(self.host, ids, flat),
            uses=(ids, flat, addrs),
        )

    def _sealed(self, ids: torch.Tensor, blocks: torch.Tensor | None, n_new: int) -> None:
        """The host side of a seal whose device work is done (summaries and device block table written after the
        :attr:`n_blocks` held blocks): the CPU block table, the views of the summaries, the window's entry into the
        slot pool, :attr:`n_blocks`.

        Args:
            ids: the new blocks' host ids, ``[batch * n_new]`` (sequence-major), ``torch.int64``, CPU.
            blocks: the new blocks, ``[batch, n_new, 2, kv_heads, block_tokens, head_dim]``, compute device; ``None``:
                not made (nothing copies them into the slot pool: :meth:`finish_step`).
            n_new: blocks sealed.
        """
        batch = self.batch
        # The CPU table grows like the device one, in place, instead of a copy of the whole table at every seal.
        self._block_table_store = self._appended(self._block_table_store, ids.view(batch, n_new), fill=-1)
        self.block_table = self._block_table_store[:, : self.n_blocks + n_new]
        for name, store in self._summary_store.items():
            self.summaries[name] = store[:, : self.n_blocks + n_new]
        # The newest blocks are the next steps' window: they enter the slot pool once this step's attention is done
        # (a prefill step first streams older blocks through the pool, which would evict them again).
        keep_n = min(n_new, max(self.config.window_blocks, 1), self.pool.slots)
        if blocks is None:
            self._window_insert = None
        else:
            self._window_insert = (self.n_blocks + n_new - keep_n, blocks[:, n_new - keep_n :])
        self.n_blocks += n_new

    # --------------------------------------------------------------------------- seals after a replayed decode step
    def seal_key(self) -> tuple:
        """What a captured seal (:meth:`seal_work`) depends on: the buffers it writes and the host pool's chunk
        tables (:meth:`storage_key`, which also says whether every chunk is admitted to the device: then the
        block's write is part of the graph) and the batch."""
        return ("seal", self.storage_key(), self.batch)

    def _seal_replayed(self) -> None:
        """Seal the open block that a replayed decode step filled (``block_tokens`` tokens in every sequence).

        The device work of a seal (:meth:`seal_work`: the block's copy, its summaries, its block-table column) is
        a few dozen small operations; launched one by one from Python, the seals of every layer cost the host
        several decode steps' worth of time. Here that work reads the block's position and host ids from a device
        buffer (filled by one copy), so that one CUDA graph serves every seal of one :meth:`seal_key`: the first
        seal of a key runs it op by op (so that every kernel in it has run before the capture) and captures it,
        the later ones replay it. A block whose host pool is not wholly admitted to the device is written to the
        host by the offload stream after the work, as :meth:`_seal` does.
        """
        ids = self.host.allocate(self.batch)
        if self.use_kernels:
            # A pool grown by these ids enters the chunk tables now, before seal_key() reads their version: tables
            # that had to be re-allocated are not the ones an earlier capture reads (it would miss the new chunk).
            self.host.chunk_addrs(self.device)
        if not self._seal_capturable():
            self._seal(self._open_k, self._open_v, 1, ids=ids)
            return
        key = self.seal_key()
        graph = self._graphs.get(key)
        if graph is None:
            self._seal_from(ids, self.seal_work)
            self._capture_seal(key)
            return

        def replay() -> torch.Tensor:
            graph.graph.replay()
            return graph.out

        self._seal_from(ids, replay)
        self.stats.add(("seal_graph_replays",), 1)

    def _seal_from(self, ids: torch.Tensor, work: Callable[[], torch.Tensor | None]) -> None:
        """Seal the open block with host ids ``ids`` (``[batch]``, ``torch.int64``, CPU) by ``work``
        (:meth:`seal_work` or its graph's replay; returns the block, or ``None`` where nothing reads it) reading the
        position and ids from the device buffer; then the block's host write if ``work`` did not make it, and the
        host side (:meth:`_sealed`)."""
        # The offload stream's write of the last seal read the buffers that this one overwrites.
        transfer.wait_event(self._seal_offloaded, self.device)
        args = torch.cat([torch.tensor([self.n_blocks]), ids])
        cuda = self.device.type == "cuda"
        self._seal_buffer().copy_(args.pin_memory() if cuda else args, non_blocking=cuda)  # no host synchronisation
        blocks = work()
        heads, T, D = self.kv_heads, self.block_tokens, self.head_dim
        if not (self.use_kernels and self.host.all_admitted):  # seal_work wrote only blocks on the device
            flat = blocks.reshape(-1, 2, heads, T, D)
            if self.use_kernels:
                self._last_write = self._seal_offloaded = self._offload_on_stream(self._seal_args[1:], flat)
            else:
                transfer.offload_blocks(self.host, ids, flat)
        self.stats.add(("offloaded_bytes",), len(ids) * self.host.block_bytes)
        self._sealed(ids, blocks, 1)

    def seal_work(self) -> torch.Tensor:
        """The device work of sealing the open block (full: ``block_tokens`` tokens in every sequence) at the block
        position and with the host ids that the device buffer ``_seal_args`` holds (``[1 + batch]``, ``torch.int64``:
        the position, then one id per sequence): the block's copy into its host block where every chunk of the host
        pool is admitted to the device (a device copy; else the caller writes it), its summaries and its column of
        the device block table, written at that position into their buffers (which must hold it). No host
        synchronisation and nothing allocated that outlives it, so that it can be captured.

        With the plain ``quantkey`` selector all of it is one launch (:func:`~hf_offload.kernels.seal.seal_block`).

        Returns:
            The block, ``[batch, 1, 2, kv_heads, block_tokens, head_dim]``, the cache dtype, compute device; ``None``
            where nothing reads it (every chunk admitted and the paged attention: no copy into the slot pool).
        """
        batch, heads, T, D = self.batch, self.kv_heads, self.block_tokens, self.head_dim
        pos, ids = self._seal_args[:1], self._seal_args[1:]
        keys = self._open_k.reshape(batch, heads, 1, T, D).transpose(1, 2)  # [B, 1, H, T, D]
        values = self._open_v.reshape(batch, heads, 1, T, D).transpose(1, 2)
        admitted = self.use_kernels and self.host.all_admitted
        one_launch = self._seal_kernel()
        needed = not (one_launch and admitted and self.paged)  # else nothing reads the stacked block
        blocks = torch.stack([keys, values], dim=2) if needed else None  # [B, 1, 2, H, T, D]
        if one_launch:
            bits, value_bits = self.selector.bits, self.selector.tail_bits
            addrs = self.host.chunk_addrs(self.device) if admitted else None
            seal_block(self._open_k, self._open_v, self._seal_args, self._summary_store, bits, value_bits, addrs,
                       self.host.chunk_blocks, self.block_table_dev)  # fmt: skip
            return blocks
        if self.use_kernels:
            if admitted:
                transfer.offload_blocks_kernel(self.host, ids, blocks.view(-1, 2, heads, T, D))
            self.block_table_dev.index_copy_(1, pos, ids.view(batch, 1))
        for name, summary in self._summaries_of(keys, values).items():
            self._summary_store[name].index_copy_(1, pos, summary)
        return blocks

    def _seal_buffer(self) -> torch.Tensor:
        """The device buffer :meth:`seal_work` reads, ``[1 + batch]``, ``torch.int64`` (made at first use)."""
        if self._seal_args is None:
            self._seal_args = torch.zeros(1 + self.batch, dtype=torch.int64, device=self.device)
        return self._seal_args

    def _seal_kernel(self) -> bool:
        """Whether :meth:`seal_work` is one launch of :func:`~hf_offload.kernels.seal.seal_block`: the kernel path,
        a :class:`~hf_offload.selectors.quantkey.QuantKeySelector` whose summaries are its class's, and a block
        and buffers the kernel takes."""
        selector = self.selector
        own = ("summarize", "summarize_values")
        plain = isinstance(selector, QuantKeySelector) and all(
            getattr(type(selector), name) is getattr(QuantKeySelector, name) for name in own
        )
        if not (self.use_kernels and plain and self.block_table_dev is not None):
            return False
        return seal_block_supported(self._open_k, self._summary_store, selector.bits, selector.tail_bits)

    def _seal_capturable(self) -> bool:
        """Whether this seal goes through :meth:`seal_work` and its graph: CUDA graphs on, :attr:`seal_graphs`, and
        buffers that hold the block (else the op-by-op seal grows them)."""
        if not (self.seal_graphs and self.graphs):
            return False
        n = self.n_blocks
        table = self.block_table_dev if self.use_kernels else None
        if table is not None and table.shape[1] <= n:
            return False
        return all(store.shape[1] > n for store in self._summary_store.values())

    def _capture_seal(self, key: tuple) -> None:
        """Capture :meth:`seal_work` for ``key`` (:meth:`seal_key`), dropping the seal graph of an earlier key; warns
        once and turns :attr:`seal_graphs` off if the capture fails."""
        self._graphs = {k: g for k, g in self._graphs.items() if k[0] != "seal"}
        tables = (self.block_table_dev, *self.host.chunk_tables(self.device)) if self.use_kernels else ()
        held = (*self._summary_store.values(), *tables, self._seal_buffer())
        try:
            graph = self.cache_capture_work(self.device, self.seal_work, held)
        except Exception as error:
            self.seal_graphs = False
            warnings.warn(
                f"Layer {self.layer_idx}: capturing the seal of a block into a CUDA graph failed ({error}); this "
                "layer seals op by op from now on.",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        self._graphs[key] = graph
        self.stats.add(("seal_graph_captures",), 1)

    def _append_summary(self, name: str, summary: torch.Tensor) -> torch.Tensor:
        """Write the summaries of ``n_new`` new blocks after the :attr:`n_blocks` held ones; returns the view of all
        (:meth:`_sealed` makes it :attr:`summaries`' entry).

        Args:
            name: the summary's name (a key of the selector's ``summarize`` output).
            summary: the new blocks' summary, ``[batch, n_new, ...]``, on the compute device.
        """
        store = self._summary_store[name] = self._appended(self._summary_store.get(name), summary)
        return store[:, : self.n_blocks + summary.shape[1]]

    def _appended(self, store: torch.Tensor | None, new: torch.Tensor, fill: int = 0) -> torch.Tensor:
        """``store`` (a per-block buffer: a summary, a block table; ``None``: none yet), grown by :meth:`_grown` if
        it cannot hold them, with ``new`` (``[batch, n_new, ...]``) written after its :attr:`n_blocks` blocks."""
        n, need = self.n_blocks, self.n_blocks + new.shape[1]
        if store is None or store.shape[1] < need:
            store = self._grown(store, new, need, fill)
        store[:, n:need] = new
        return store

    def _grown(self, store: torch.Tensor | None, like: torch.Tensor, blocks: int, fill: int = 0) -> torch.Tensor:
        """A per-block buffer (a summary, the device block table) for at least ``blocks`` blocks, the reservation
        and the decode capacity of ``blocks`` (in whole SUMMARY_CHUNK_BLOCKS), holding ``store``'s first
        :attr:`n_blocks` blocks and ``fill`` past them (blocks past the sealed ones are scored, masked, by a step of
        a larger capacity: zeros keep their arithmetic finite); ``like``: any tensor of this name, ``[batch, n,
        ...]``."""
        blocks = max(blocks, self._reserved_blocks, self.decode_capacity(blocks, 0))
        capacity = -(-blocks // SUMMARY_CHUNK_BLOCKS) * SUMMARY_CHUNK_BLOCKS
        grown = like.new_full((like.shape[0], capacity, *like.shape[2:]), fill)
        if store is not None and self.n_blocks:
            grown[:, : self.n_blocks] = store[:, : self.n_blocks]
        self._storage_epoch += 1
        return grown

    def summary_views(self, n: int) -> dict[str, torch.Tensor]:
        """Every summary over its first ``n`` blocks, ``[batch, n, ...]`` views of the buffers (``n`` may exceed
        :attr:`n_blocks` up to the decode capacity: those blocks hold zeros and are never valid)."""
        stores = self._summary_store
        if any(store.shape[1] < n for store in stores.values()):
            for name, store in stores.items():  # a capacity larger than the buffers were made for
                stores[name] = self._grown(store, store, n)
                self.summaries[name] = stores[name][:, : self.n_blocks]
        return {name: store[:, :n] for name, store in stores.items()}

    def reserve(self, tokens: int) -> None:
        """Allocate the block summaries for ``tokens`` tokens per sequence now (and from the first seal on, if none
        is sealed yet), so that they never grow while the cache fills: growing buffers of a cache filled in many
        pieces (chunked prefill) leave freed buffers behind that fragment a nearly full device. Never shrinks.

        The reservation outlives :meth:`reset` (a cache reused for a new batch keeps it).

        Args:
            tokens: tokens per sequence the cache will hold (prompt, padding and generated tokens).
        """
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"reserve(tokens) takes a number of tokens >= 0, got {tokens!r}")
        self._reserved_blocks = max(self._reserved_blocks, tokens // self.block_tokens)
        for name, store in getattr(self, "_summary_store", {}).items():
            if store.shape[1] < self._reserved_blocks:
                self._summary_store[name] = self._grown(store, store, self._reserved_blocks)
                self.summaries[name] = self._summary_store[name][:, : self.n_blocks]
                self._graphs = {}  # captured graphs read the old buffers
        table = getattr(self, "block_table_dev", None)
        if table is not None and table.shape[1] < self._reserved_blocks:
            self.block_table_dev = self._grown(table, table, self._reserved_blocks, fill=-1)
            self._graphs = {}

    def finish_step(self) -> None:
        """After this step's attention: put the blocks sealed by this step into the slot pool (a block just written
        is a hit next step), unless the paged attention reads every block of this layer in place."""
        self._wait_prefetch()  # the slot written below may be one a prefetch was filling
        if self._window_insert is None:
            return
        first, blocks = self._window_insert
        self._window_insert = None
        if self.paged and self.host.all_admitted:
            return  # the paged attention reads every block of this layer where it lies: the pool would hold a copy
        n = blocks.shape[1]
        idx = torch.arange(first, first + n, device=self.device).expand(self.batch, 1, n)
        slots, _ = self.pool.assign(idx, torch.ones_like(idx, dtype=torch.bool))
        self.pool.write(slots, blocks)

    # ---------------------------------------------------------------------------------------------------- planning
    def select_all(self, n_blocks: int) -> Selection:
        """Every sealed block below ``n_blocks``, for every sequence (exact attention)."""
        blocks = torch.arange(n_blocks, device=self.device).expand(self.batch, 1, n_blocks)
        return Selection(blocks=blocks, keep=torch.ones_like(blocks, dtype=torch.bool))

    def select(self, query: torch.Tensor, mask, scaling: float, handoff: Handoff) -> Selection:
        """The blocks one decode query attends to, within ``budget_tokens`` (sink, window and open block included).

        Args:
            query: shape ``[batch, kv_heads, group, head_dim]``, compute device.
            mask: the forward's :class:`~hf_offload.attention.OffloadMask`, or ``None``.
            scaling: softmax scale.
            handoff: this step's handoff (recent tokens and the number of selectable blocks).
        """
        recent = handoff.key.shape[-2]
        return self._plan(query, mask, scaling, handoff.n_blocks_before, recent, handoff.first_recent_pos + recent - 1)

    def decode_blocks(self, n: int, recent: int) -> int:
        """Sealed blocks one decode query selects among ``n`` with ``recent`` tokens in the open block (all ``n`` if
        the budget holds them)."""
        return min(n, (self.config.budget_tokens - recent) // self.block_tokens)

    def decode_capacity(self, n: int, k: int) -> int:
        """Blocks a decode step with ``n`` sealed blocks, ``k`` of them selected, scores: ``n`` rounded up to
        :attr:`capacity_blocks` (the blocks past ``n`` are never valid), or ``n`` when every block is selected."""
        step = self.capacity_blocks
        return n if k >= n or step == 1 else -(-n // step) * step

    def storage_key(self) -> tuple:
        """What a captured decode graph depends on besides its shapes: the versions of the summary and block-table
        buffers and of the host pool's chunk tables, whether any chunk is admitted to the device, and whether all
        are (a step then skips the slot pool: :meth:`resident_rounds`)."""
        return self._storage_epoch, self.host.table_version, self.host.admitted_chunks > 0, self.host.all_admitted

    # ------------------------------------------------------------------------------------------- decode graphs
    def decode_inputs(self, handoff: Handoff, mask, capacity: int | None = None) -> DecodeInputs:
        """The shared inputs of this decode step (built by the step's first offloaded layer on this device).

        Args:
            handoff: this step's handoff.
            mask: the forward's :class:`~hf_offload.attention.OffloadMask` (plain causal), or ``None``.
            capacity: blocks the step scores (:meth:`decode_capacity`); ``None``: the sealed blocks.
        """
        return self.cache_decode_inputs(self.device).update(
            self.batch, handoff.n_blocks_before, self.block_tokens, handoff.first_recent_pos, handoff.key.shape[-2],
            None if mask is None else mask.padding, self.config.sink_blocks, self.config.window_blocks, self.device,
            step=mask, capacity=capacity,
        )  # fmt: skip

    def captured(self, key: tuple) -> CapturedDecode | None:
        """This layer's graph for ``key`` (geometry of a decode step), or ``None``."""
        return self._graphs.get(key)

    def replay(self, graph: CapturedDecode, query: torch.Tensor) -> torch.Tensor:
        """One decode step of this layer's attention from its captured graph.

        Args:
            graph: from :meth:`captured`.
            query: ``[batch, q_heads, 1, head_dim]``, model dtype, CUDA.

        Returns:
            ``[batch, 1, q_heads, head_dim]``: the graph's output buffer (overwritten by its next replay).
        """
        self._wait_side_streams()
        graph.query.copy_(query)
        graph.graph.replay()
        self.stats.add(("decode_steps", "graph_replays"), 1)
        return graph.out

    def warm_for(self, n: int, k: int, query: torch.Tensor, scaling: float, reuse: bool = False) -> tuple:
        """What a decode step's work compiles and plans for, besides buffer addresses: the selected blocks, the
        query's shape and dtype, the scale, the branches that depend on the number of sealed blocks ``n`` (everything
        selected; the selector's branch, :meth:`Selector.decode_branch
        <hf_offload.selectors.base.Selector.decode_branch>`) and the integer specialisations Triton compiles for
        (``n`` equal to 1, or a multiple of 16), and whether the step reuses the kept selection (``reuse``). A
        geometry whose value is in :attr:`warm_geometries` has run op by op before and can be captured without
        running it op by op first."""
        return (k, tuple(query.shape), query.dtype, scaling, k >= n, n == 1, n % 16 == 0,
                self.selector.decode_branch(n, k), reuse)  # fmt: skip

    def _wait_side_streams(self) -> None:
        """Make the compute stream wait for the side-stream work a decode step depends on (a pending prefetch, the
        host writes of the blocks this forward may read) and forget those events. A replay or a capture does this
        outside the graph: a graph cannot wait on work recorded outside it."""
        # Stream order, as in resident_rounds: the recall in the graph reads host blocks the offload stream wrote.
        self._wait_prefetch()
        transfer.wait_event(self._selectable_written, self.device)
        self._selectable_written = None

    def capture_decode(self, key: tuple, body: Callable[[torch.Tensor], torch.Tensor], query: torch.Tensor,
                       inputs: DecodeInputs, retry_op_by_op: bool = False) -> CapturedDecode | None:
        """Capture ``body`` (this layer's decode attention) for ``key``; returns the graph, or ``None``.

        Graphs of an earlier geometry are dropped. If the capture fails, this layer runs op by op from then on
        (with ``cuda_graphs=True``: the error is raised), unless ``retry_op_by_op``: then the failure is only counted
        (``graph_capture_retries``) and the caller runs the step op by op and captures again.

        Args:
            key: the geometry (sealed blocks, selected blocks, query shape and dtype, scale, input buffers).
            body: enqueues the step's work on the current stream given the query buffer; returns the output.
            query: an example query, ``[batch, q_heads, 1, head_dim]``, model dtype, CUDA.
            inputs: the step's shared inputs (held by the graph).
            retry_op_by_op: the step has not run op by op for this geometry (a warm geometry, :meth:`warm_for`).
        """
        self._graphs = {k: g for k, g in self._graphs.items() if k[0] in (key[0], "seal")}
        self.stats.prepare_capture(self.device)
        self._wait_side_streams()
        held = (
            *self._summary_store.values(), self.block_table_dev, *self.host.chunk_tables(self.device),
            inputs.rows, inputs.valid, inputs.forced, inputs.sequence,
        )  # fmt: skip
        try:
            self._graphs[key] = self.cache_capture_graph(self.device, body, query, held)
            self.stats.add(("graph_captures",), 1)
            return self._graphs[key]
        except Exception as error:
            if retry_op_by_op:
                self.stats.add(("graph_capture_retries",), 1)
                return None
            if self.config.cuda_graphs:
                raise RuntimeError(f"Layer {self.layer_idx}: capturing the decode step failed: {error}") from error
            warnings.warn(
                f"Layer {self.layer_idx}: capturing the decode step into a CUDA graph failed ({error}); this layer "
                "runs op by op from now on.",
                RuntimeWarning,
                stacklevel=2,
            )
            self.graphs = False
            self._graphs.clear()
            return None

    # ------------------------------------------------------------------------------------- whole decoder layers
    def run_decoder_layer(self, forward: Callable, args: tuple, kwargs: dict):
        """One call of the decoder layer this cache layer belongs to: replayed from a CUDA graph of the whole layer
        (norms, projections, MLP, :meth:`update` and the offloaded attention) where the step allows it
        (``graph_scope="layer"``, :meth:`_layer_step`), else ``forward(*args, **kwargs)`` as transformers would call
        it.

        A layer's graph is captured at the first decode step of a geometry whose attention graph already exists
        (the attention's geometry, the buffers it reads and the call's argument shapes), so that every kernel in it
        has run op by op before; it is replayed for the other steps of that geometry, and a step whose token fills
        the open block seals it after the replay.

        Args:
            forward: the decoder layer's own forward.
            args, kwargs: the call's arguments (the hidden states ``[batch, 1, hidden]``, the rotary embeddings, the
                lazy mask, this cache, ...).
        """
        fusions = getattr(self, "fusions", None)
        if fusions is None:  # the layer's first call: its device is the hidden states'
            fusions = call_fusions(self.config, args, kwargs)
        with fused(fusions):
            return self._run_decoder_layer(forward, args, kwargs)

    def _run_decoder_layer(self, forward: Callable, args: tuple, kwargs: dict):
        step = self._layer_step(args, kwargs)
        if step is None:
            self._prefetched_ahead = self._lookahead_from_input(args, kwargs)
            try:
                return forward(*args, **kwargs)
            finally:
                self._prefetched_ahead = False
        key, inputs, n, k, flat = step
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture_layer(key, forward, args, kwargs, inputs, n, k)
            if graph is None:
                return forward(*args, **kwargs)
        if key[2][-1]:
            self.stats.add(("reused_selections",), 1)
        # What update() and the attention do on the host in a step run op by op; the graph does the rest.
        self._selectable_written = self._last_write
        self._wait_side_streams()
        out = replay_layer(graph, args, kwargs, flat)
        left = self.keys.shape[-2] + 1
        self.n_tokens += 1
        if left == self.block_tokens:
            # The token filled the open block: seal it now. A step run op by op seals it in update(), before its
            # attention, which still reads it as recent tokens and selects among the blocks sealed before; so the
            # same graph serves this step, and the seal (summaries, host write, slot) follows it.
            self._seal_replayed()
            left = 0
        self.keys, self.values = self._open_k[:, :, :left], self._open_v[:, :, :left]
        self.stats.add(("decode_steps", "graph_replays", "layer_graph_replays"), 1)
        self.finish_step()
        return out

    def _layer_step(self, args: tuple, kwargs: dict) -> tuple | None:
        """``(graph key, shared inputs, blocks scored, blocks selected, flattened arguments)`` of a decoder layer call
        that a graph of the whole layer can serve, or ``None``: not a decode step of one token per sequence on this
        layer's device, a mask other than plain causal, gradients on, or a geometry whose attention graph does not
        exist (the attention was never captured for it, or runs another path: soft-capping, sink logits, a
        selection larger than the slot pool)."""
        if not (self.graphs and self.layer_graphs and self.config.graph_scope == "layer" and self.is_initialized):
            return None
        if not self.n_blocks or torch.is_grad_enabled() or len(args) > 1:
            return None
        hidden = _hidden_states(args, kwargs)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[:2] != (self.batch, 1):
            return None
        recent = self.keys.shape[-2] + 1  # this step's token included (block_tokens: it fills the open block)
        if hidden.device != self.device:
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and not (isinstance(mask, OffloadMask) and _plain_causal(mask)):
            return None
        last = self._fused_key
        if last is None:
            return None
        n_before = self.n_blocks
        k = self.decode_blocks(n_before, recent)
        n = self.decode_capacity(n_before, k)
        inputs = self.cache_decode_inputs(self.device).update(
            self.batch, n_before, self.block_tokens, n_before * self.block_tokens, recent,
            None if mask is None else mask.padding, self.config.sink_blocks, self.config.window_blocks, self.device,
            step=mask, capacity=n,
        )  # fmt: skip
        reuse = self.reuses_selection(self.n_tokens, n_before, k, n)
        attention_key = (n, k, *last[2:5], inputs.rows.data_ptr(), self.storage_key(), reuse)
        # The last step's attention may have reused where this one chooses (or the reverse): the rest must match.
        if attention_key[:-1] != last[:-1] or attention_key not in self._graphs:
            return None
        flat = tree_flatten((args, kwargs))  # read once: by the signature and by the replay's copies
        return (n, "layer", attention_key, call_signature(args, kwargs, flat)), inputs, n, k, flat

    def _capture_layer(self, key: tuple, forward: Callable, args: tuple, kwargs: dict, inputs: DecodeInputs, n: int,
                       k: int) -> CapturedLayer | None:
        """Capture the whole decoder layer's decode step for ``key``; returns the graph, or ``None`` after warning
        once (the layer's code could not be captured: from then on this layer replays only its attention's graph).
        Graphs of the whole layer for other keys are dropped, except the one that differs from ``key`` only in
        whether the step reuses the kept selection (``reselect_every``: the two alternate)."""

        def twin(g: tuple) -> bool:  # the same geometry, signature and buffers; the other kind of step
            return g[0] == key[0] and g[2][:-1] == key[2][:-1] and g[3] == key[3]

        self._graphs = {g: v for g, v in self._graphs.items() if g[1:2] != ("layer",) or twin(g)}
        self.stats.prepare_capture(self.device)
        self._selectable_written = self._last_write
        self._wait_side_streams()
        held = (
            *self._summary_store.values(), self.block_table_dev, *self.host.chunk_tables(self.device),
            inputs.rows, inputs.valid, inputs.forced, inputs.sequence, inputs.open_pos,
        )  # fmt: skip
        start = time.perf_counter()
        self._layer_capture = _LayerCapture(inputs, n, k, key[2][-1])
        try:
            graph = self.cache_capture_layer(self.device, forward, args, kwargs, held)
        except Exception as error:
            take_handoff()  # an update the failed capture left for an attention that never ran
            self.layer_graphs = False
            warnings.warn(
                f"Layer {self.layer_idx}: capturing the whole decoder layer into a CUDA graph failed ({error}); this "
                "layer replays only its attention's graph from now on (graph_scope='attention').",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        finally:
            self._layer_capture = None
        self._graphs[key] = graph
        self.stats.add(("layer_graph_captures",), 1)
        self.stats.add(("graph_capture_us",), round((time.perf_counter() - start) * 1e6))
        return graph

    def plan_decode(
        self, query: torch.Tensor, scaling: float, n: int, k: int, inputs: DecodeInputs, reuse: bool = False
    ) -> Selection:
        """The selection of a decode step of a plain causal forward: ``k`` of ``n`` sealed blocks (all if ``k >= n``),
        valid and forced blocks from the step's shared ``inputs``. No host synchronisation.

        Args:
            query: ``[batch, kv_heads, group, head_dim]``, compute device.
            scaling: softmax scale.
            n: blocks the step scores: the sealed blocks before it, or its :meth:`decode_capacity` (blocks past the
                sealed ones are not valid in ``inputs``).
            k: blocks the budget selects (:meth:`decode_blocks`).
            inputs: this step's :class:`~hf_offload.graphs.DecodeInputs`.
            reuse: the step attends the kept selection (:meth:`reuses_selection` said so): nothing is scored. A step
                that chooses while a selection is kept (``reselect_every`` above 1) writes its choice into it.
        """
        kept = self._kept
        if reuse:
            return Selection(blocks=kept.blocks, keep=kept.keep)
        selection = self._plan(query, None, scaling, n, 0, 0, inputs=inputs, k=k)
        if kept is not None and kept.blocks.shape == selection.blocks.shape and self.config.reselect_every > 1:
            kept.blocks.copy_(selection.blocks)
            kept.keep.copy_(selection.keep)
        return selection

    def reuses_selection(self, pos: int, n_sealed: int, k: int, n: int) -> bool:
        """Whether the decode step of the token at cache position ``pos`` attends the selection an earlier step kept
        (``OffloadConfig.reselect_every``) instead of choosing. A step that chooses becomes the one the next
        ``reselect_every - 1`` steps reuse: its buffers are made here, on the host, before any capture. The answer
        depends only on this layer's state and the arguments, so the two places that ask within one step (a whole
        layer's graph, then the attention run op by op) get the same one.

        Args:
            pos: the step's token position (tokens in the cache before it).
            n_sealed: sealed blocks before the step; ``k``: blocks the budget selects; ``n``: blocks the step scores
                (:meth:`decode_capacity`).
        """
        every = self.config.reselect_every
        if every <= 1 or k >= n_sealed:
            self._kept = None
            return False
        key = (n_sealed, k, n, self.batch)
        kept = self._kept
        if kept is not None and kept.key == key and 0 < pos - kept.pos < every:
            return True
        # One pair of buffers per shape for the layer's life (until reset): every graph that reads or writes a
        # selection of that shape uses the same memory, whichever step allocated it.
        shape = (self.batch, self.kv_heads if self.selector.per_head else 1, k)
        buffers = self._kept_buffers.get(shape)
        if buffers is None:
            buffers = self._kept_buffers[shape] = (
                torch.zeros(shape, dtype=torch.int64, device=self.device),
                torch.zeros(shape, dtype=torch.bool, device=self.device),
            )
        self._kept = _KeptSelection(pos, key, *buffers)
        return False

    def _plan(
        self,
        query: torch.Tensor,
        mask,
        scaling: float,
        n: int,
        recent: int,
        q_pos: int,
        inputs: DecodeInputs | None = None,
        k: int | None = None,
    ) -> Selection:
        """:meth:`select` for ``n`` selectable blocks, ``recent`` device-resident tokens and query position ``q_pos``;
        with ``inputs`` (a decode step's, plain causal mask), valid and forced blocks come from there; ``k``: blocks
        to select (default: what the budget leaves beside ``recent``)."""
        if k is None:
            k = self.decode_blocks(n, recent)
        if inputs is not None:
            valid = inputs.valid
        elif mask is None:
            valid = torch.ones((self.batch, n), dtype=torch.bool, device=self.device)
        else:
            valid = mask.block_valid(q_pos, n, self.block_tokens, self.device)
        if k >= n:
            selection = self.select_all(n)
            selection.keep = valid[:, None, :]
            return selection
        sink, window = self.config.sink_blocks, self.config.window_blocks

        # Every layer of one forward with the same geometry forces the same blocks: built once per forward.
        key = ("forced", q_pos, n, self.block_tokens, sink, window, self.device)
        if inputs is not None:
            forced = inputs.forced
        elif mask is None:
            forced = forced_blocks(valid, sink, window)
        else:
            forced = mask.memo(key, lambda: forced_blocks(valid, sink, window))
        selection = self.selector.select(query, self.summary_views(n), scaling, k, forced, valid)
        cap = self.config.transfer_cap_blocks
        if cap is not None and selection.scores is not None:
            resident = resident_blocks(self.pool.block, selection.blocks.shape[1], n)
            selection = cap_transfers(selection, resident, cap, self.config.transfer_cap_margin)
        return selection

    def estimate_tail(
        self,
        query: torch.Tensor,
        scaling: float,
        n: int,
        selection: Selection,
        tokens_ok: torch.Tensor,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's estimate of the attention over the sealed blocks this decode step did not select.

        Args:
            query: ``[batch, kv_heads, group, head_dim]``, compute device.
            scaling: softmax scale.
            n: blocks the step scores (the sealed blocks before it, or its :meth:`decode_capacity`).
            selection: the step's selection (shared: ``blocks`` and ``keep`` ``[batch, 1, k]``).
            tokens_ok: tokens of the ``n`` blocks the query may attend to, ``[batch, n, block_tokens]``,
                ``torch.bool``, compute device.
            softcap: optional logit soft-capping.

        Returns:
            ``(out, lse)``, ``[batch, kv_heads, group, head_dim]`` and ``[batch, kv_heads, group]``, float32.
        """
        tail = unselected_tokens(tokens_ok, selection)
        return self.selector.tail_attention(query, self.summary_views(n), scaling, tail, softcap, selection=selection)

    def estimate_tail_merged(
        self,
        query: torch.Tensor,
        scaling: float,
        n: int,
        selection: Selection,
        tokens_ok: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`estimate_tail` merged with the selection's attention into one softmax (the selector's
        :meth:`~hf_offload.selectors.base.Selector.tail_attention_merged`).

        Args:
            query, scaling, n, selection, tokens_ok: as :meth:`estimate_tail`'s (no soft-capping).
            out: the exact attention over the selection, ``[batch, kv_heads, group, head_dim]``, float32.
            lse: its log-sum-exp, ``[batch, kv_heads, group]``, float32.
            out_dtype: dtype of the merged output.

        Returns:
            ``(out, tail_lse)``: ``[batch, kv_heads, group, head_dim]`` in ``out_dtype`` and the estimate's
            log-sum-exp, ``[batch, kv_heads, group]``, float32.
        """
        return self.selector.tail_attention_merged(query, self.summary_views(n), scaling, tokens_ok, out, lse,
                                                   selection=selection, out_dtype=out_dtype)  # fmt: skip

    def count_tail(self, tail_lse: torch.Tensor, selection_lse: torch.Tensor) -> None:
        """Count one decode step's estimated share of attention outside the selection (device-side, no sync).

        Args:
            tail_lse: log-sum-exp of the estimate, ``[batch, kv_heads, group]``, float32.
            selection_lse: log-sum-exp of the exact attention over the selection, same shape.
        """
        share = torch.sigmoid(tail_lse - selection_lse).mean()
        self.stats.add_later(("tail_ppm",), (share * 1e6).round().long())
        self.stats.add_later(("tail_steps",), torch.ones((), dtype=torch.long, device=share.device))

    def resident_rounds(
        self, selection: Selection, decode: bool, count_step: bool = True, gather: bool = True, in_place: bool = False
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Make the selected blocks resident, at most a pool's worth at a time, recalling misses from the host.

        Before its first recall the compute stream waits for the host writes of the blocks this forward may read
        and for this layer's pending prefetch, if any (events, no host synchronisation).

        With ``in_place`` (the paged decode attention reads blocks of admitted chunks where they are), only blocks
        in host memory take slots and are recalled; the others count as hits (no bytes move for them). A decode step
        of a layer whose every chunk is admitted skips the slot pool altogether (no assignment, no copy launch;
        every slot reads 0, which the paged attention never uses for such blocks).

        Yields:
            ``(blocks, keep, slots, keys, values)`` per round: block indices ``[batch, 1 or kv_heads, n]``, which are
            attended (same shape, bool), the slot of each entry (``[batch, kv_heads, n]``, int64), and the entries'
            keys and values gathered from the pool, ``[batch, kv_heads, n * block_tokens, head_dim]`` (``None``
            without ``gather``: the caller reads the pool in place).
        """
        total = selection.blocks.shape[-1]
        per_round = self.pool.slots
        prefetched, self._prefetched_slots = self._prefetched_slots, None
        if decode and count_step:
            self.stats.add(("decode_steps",), 1)
        shared, heads = not self.selector.per_head, self.kv_heads
        if in_place and decode and total <= per_round and self.host.all_admitted:
            # Every block lies in device memory: nothing to assign or recall (about 90 us per layer and step at 64K
            # tokens, batch 12, 8B shape on an H200: the assignment, its arguments and an empty copy launch).
            keep = selection.keep
            self.stats.count_later(("lookups", "hits"), keep, heads // keep.shape[1])
            self._wait_side_streams()  # blocks sealed on a side stream reach their chunks first
            yield selection.blocks, keep, self._zero_slots(total), None, None
            return
        for start in range(0, total, per_round):
            if total <= per_round:
                blocks, keep = selection.blocks, selection.keep
            else:
                blocks = selection.blocks[..., start : start + per_round]
                keep = selection.keep[..., start : start + per_round]
            slots, miss = self.pool.assign(blocks, self._pool_keep(blocks, keep) if in_place else keep)
            if decode:
                # Device-side counts, summed when stats() reads them.
                self.stats.count_later(("lookups", "hits"), keep, heads // keep.shape[1])
                if prefetched is not None:
                    used = keep.expand_as(miss) & ~miss & prefetched.gather(-1, slots)
                    used = used if self.selector.per_head else used[:, :1]
                    self.stats.count_later(("prefetch_used_blocks",), used)
            if start == 0:
                # Stream order: the recall below may overwrite slots a prefetch was filling, and the gather reads
                # them; both must come after the prefetch. Recalled blocks must have reached the host.
                self._wait_side_streams()
            count, unit, host_count = self._recall(blocks, slots, miss)
            self._count(count, unit, decode=decode, host_count=host_count)
            if decode:
                # A shared selection keeps all heads of a slot on the same block: one recalled block is a miss of
                # every head.
                self.stats.add_later(("hits",), count, -heads if shared else -1)
            keys, values = self.pool.gather(slots) if gather else (None, None)
            yield blocks, keep, slots, keys, values

    def _pool_keep(self, blocks: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``keep`` limited to the blocks in host memory (those the paged decode attention reads from slots).

        Args:
            blocks: block indices, ``[batch, 1 or kv_heads, n]``, ``torch.int64``, compute device (below the device
                block table's capacity).
            keep: which entries are wanted, same shape, ``torch.bool``.
        """
        if not self.host.admitted_chunks:
            return keep
        _, on_host = self.host.chunk_tables(self.device)
        table = self.block_table_dev
        # Entries past the sealed blocks (a step's capacity) are never kept: any column serves them.
        ids = table.gather(1, blocks.reshape(blocks.shape[0], -1).clamp(0, table.shape[1] - 1)).view(blocks.shape)
        chunk = torch.where(ids >= 0, ids // self.host.chunk_blocks, len(on_host) - 1)  # -1 reads False
        return keep & on_host[chunk]

    def _wait_prefetch(self) -> None:
        """Make the compute stream wait for this layer's pending speculative recall, if any."""
        if self._prefetch_event is not None:
            transfer.wait_event(self._prefetch_event, self.device)
            self._prefetch_event = None

    def _count(self, count, unit: int, decode: bool, prefetch: bool = False, host_count=None) -> None:
        """Add ``count`` recalled blocks (or pieces) of ``unit`` bytes each to the counters.

        Args:
            count: an int, or a 0-d integer tensor on the compute device (queued, no host synchronisation).
            unit: bytes per block or piece.
            host_count: how many of them were read from host memory (the rest from blocks admitted to the device);
                ``None``: all of them.
        """
        blocks = ("recalled_blocks",) + (("decode_recalled_blocks",) if decode else ()) + (
            ("prefetched_blocks",) if prefetch else ()
        )
        self.stats.add_later(blocks, count)
        self.stats.add_later(tuple(name.replace("_blocks", "_bytes") for name in blocks), count, unit)
        if decode:
            self.stats.add_later(("decode_host_bytes",), count if host_count is None else host_count, unit)

    def _recall(self, blocks: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor, stream=None):
        """Fill missed slots from the host pool (whole blocks for shared selections, head pieces otherwise).

        Args:
            blocks: block indices, ``[batch, 1 or kv_heads, n]``, ``torch.int64``, compute device.
            slots: slot per entry, ``[batch, kv_heads, n]``, ``torch.int64``, compute device.
            miss: entries to recall, ``[batch, kv_heads, n]``, ``torch.bool``, compute device.
            stream: kernel path on CUDA only: a side stream to run the copy on (its event goes to
                ``self._prefetch_event``); ``None``: the current stream.

        Returns:
            ``(count, unit, host_count)``: pieces moved (a 0-d device tensor on the kernel path, an int otherwise),
            the bytes of one piece, and how many of the pieces were read from host memory (``None``: all; the rest
            came from blocks admitted to the device).
        """
        if self.use_kernels:
            return self._recall_kernel(blocks, slots, miss, stream)
        if self.selector.per_head:
            b, h, j = miss.nonzero(as_tuple=True)
            block = blocks.expand_as(miss)[b, h, j]
            ids = self.block_table[b.cpu(), block.cpu()]
            transfer.recall_blocks(self.host, self.pool, ids, b, slots[b, h, j], head_idx=h)
            return len(ids), self.host.block_bytes // self.kv_heads, self.host.count_on_host(ids)
        else:
            # A shared selection keeps all heads of a slot on the same block: the misses of head 0 are all misses.
            b, j = miss[:, 0].nonzero(as_tuple=True)
            block = blocks[:, 0][b, j]
            ids = self.block_table[b.cpu(), block.cpu()]
            transfer.recall_blocks(self.host, self.pool, ids, b, slots[:, 0][b, j])
        return len(ids), self.host.block_bytes, self.host.count_on_host(ids)

    def _recall_kernel(self, blocks: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor, stream=None):
        """Kernel path of :meth:`_recall`: one launch over every candidate entry; no host synchronisation.

        The launch arguments are computed on the compute stream; only the copy runs on ``stream``.
        """
        batch, heads, n = miss.shape
        if self.selector.per_head:
            table = self.block_table_dev[:, None, :].expand(batch, heads, -1)
            ids = torch.where(miss, table.gather(-1, blocks.expand(batch, heads, n)), -1).view(-1)
            batch_idx, head_idx = self._entry_indices(n, per_head=True)
            slot_idx = slots.view(-1)
            count, unit = miss.sum(), self.host.block_bytes // heads
        else:
            missed = miss[:, :1]  # a shared selection: every head of a slot holds the same block
            ids = torch.where(missed, self.block_table_dev[:, None, :].gather(-1, blocks), -1).view(-1)
            batch_idx, head_idx = self._entry_indices(n, per_head=False)
            slot_idx = slots[:, :1].reshape(-1)
            count, unit = missed.sum(), self.host.block_bytes
        offsets = None if head_idx is not None else self._block_offsets(n)
        addrs = self.host.chunk_addrs(self.device)  # refreshed on the compute stream, before any side stream
        uses = (ids, batch_idx, slot_idx, addrs) + (() if head_idx is None else (head_idx,)) + (offsets or ())
        event = transfer.launch_on(
            stream,
            lambda: transfer.recall_blocks_kernel(self.host, self.pool, ids, batch_idx, slot_idx, head_idx, offsets),
            uses=uses,
            wait_for=(self._last_write,) if stream is not None else (),
        )
        if stream is not None:
            self._prefetch_event = event
        return count, unit, self.host.count_on_host(ids)

    def _block_offsets(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~hf_offload.transfer.block_piece_offsets` of the ``n`` whole-block entries per sequence of
        :meth:`_entry_indices`, built once per ``n`` (kept as long as the slot pool, like the indices)."""
        key = (n, "offsets")
        if key not in self._entry_index_memo:
            batch_idx, _ = self._entry_indices(n, per_head=False)
            self._entry_index_memo[key] = transfer.block_piece_offsets(self.host, self.pool, batch_idx)
        return self._entry_index_memo[key]

    def _zero_slots(self, n: int) -> torch.Tensor:
        """Slot 0 for each of ``n`` entries per sequence and KV head, ``[batch, kv_heads, n]``, ``torch.int64``,
        compute device: what a step that takes no slots hands the paged attention (built once per ``n``)."""
        key = (n, "zero_slots")
        if key not in self._entry_index_memo:
            self._entry_index_memo[key] = torch.zeros((self.batch, self.kv_heads, n), dtype=torch.long,
                                                      device=self.device)  # fmt: skip
        return self._entry_index_memo[key]

    def _entry_indices(self, n: int, per_head: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sequence (and, per head, KV head) of each of ``n`` entries per row, flattened like ``[batch, kv_heads or
        1, n]``: ``int64`` tensors on the compute device, built once per ``n``."""
        key = (n, per_head)
        if key not in self._entry_index_memo:
            heads = self.kv_heads if per_head else 1
            shape = (self.batch, heads, n)
            b = torch.arange(self.batch, device=self.device)[:, None, None].expand(shape).reshape(-1)
            h = torch.arange(heads, device=self.device)[None, :, None].expand(shape).reshape(-1) if per_head else None
            self._entry_index_memo[key] = (b, h)
        return self._entry_index_memo[key]

    # -------------------------------------------------------------------------------------------------- lookahead
    def _lookahead_from_input(self, args: tuple, kwargs: dict) -> bool:
        """Before this layer's decode step (``lookahead_query="next"``): plan :attr:`next_layer` with its own query
        predicted from this layer's input (:func:`~hf_offload.lookahead.speculative_query`) and start recalling its
        misses (:meth:`prefetch`). Returns whether it did; where it cannot (not a one-token decode step, lookahead
        off, no adjacent next decoder layer of the supported form), the step plans with its own query after its
        plan as before."""
        nxt, module = self.next_layer, self.next_decoder
        if not self.lookahead or self.config.lookahead_query != "next" or module is None or nxt is None:
            return False
        if not (self.is_initialized and nxt.is_initialized and nxt.n_blocks and nxt.device == self.device):
            return False
        hidden = _hidden_states(args, kwargs)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[:2] != (self.batch, 1):
            return False
        mask = kwargs.get("attention_mask")
        if mask is not None and not isinstance(mask, OffloadMask):
            return False
        timer = self.timer
        start = timer.mark() if timer is not None else None
        query = speculative_query(module, hidden, kwargs.get("position_embeddings"))
        scaling = getattr(getattr(module, "self_attn", None), "scaling", None)
        if query is None or scaling is None or query.shape[1] % nxt.kv_heads or query.shape[-1] != nxt.head_dim:
            return False
        batch, q_heads, _, head_dim = query.shape
        nxt.prefetch(query.view(batch, nxt.kv_heads, q_heads // nxt.kv_heads, head_dim), mask, scaling)
        if timer is not None:
            timer.add("prefetch", start, timer.mark())
        return True

    def lookahead_next(self, query: torch.Tensor, mask, scaling: float) -> None:
        """After this layer's decode plan: speculatively plan :attr:`next_layer` with this layer's query and start
        recalling its misses (see :meth:`prefetch`). A no-op unless :attr:`lookahead` is on and the next layer has
        the same geometry on the same device.

        Args:
            query: this layer's decode query, ``[batch, kv_heads, group, head_dim]``, compute device.
            mask: the forward's :class:`~hf_offload.attention.OffloadMask`, or ``None``.
            scaling: softmax scale.
        """
        nxt = self.next_layer
        if not self.lookahead or nxt is None or not nxt.is_initialized:
            return
        if nxt.device != self.device or (nxt.batch, nxt.kv_heads, nxt.head_dim) != (
            query.shape[0], query.shape[1], query.shape[-1]
        ):
            return
        nxt.prefetch(query, mask, scaling)

    def prefetch(self, query: torch.Tensor, mask, scaling: float) -> None:
        """Speculative plan of this layer's coming decode step from an earlier layer's query; recalls its misses.

        Runs before this layer's ``update`` of the step. The plan is :meth:`select` over the blocks sealed so far,
        bounded to ``lookahead_blocks`` blocks besides sink and window (forced blocks are always part of it, so
        the slots it takes are never those of the sink and window blocks the exact plan will need). Its misses get
        slots in this layer's pool (least recently used first, like any miss, but left ranked as never used, so a
        wrong guess is the first victim of the exact plan) and are recalled on the prefetch stream, whose event the
        exact plan waits on before it touches the pool's data (:meth:`resident_rounds`).
        Without side streams (CPU, torch path) the recall runs synchronously. Never changes what is attended.

        Args:
            query: ``[batch, kv_heads, group, head_dim]``, compute device (an earlier layer's decode query).
            mask: the forward's :class:`~hf_offload.attention.OffloadMask`, or ``None``.
            scaling: softmax scale.
        """
        n = self.n_blocks
        if n == 0:
            return
        selection = self._plan(query, mask, scaling, n, self.keys.shape[-2] + 1, self.n_tokens)
        if selection.blocks.shape[-1] > self.pool.slots:
            return  # the exact plan runs in rounds that cycle the whole pool: nothing would stay resident
        keep = self._bounded(selection)
        if self.paged:  # blocks of admitted chunks are read in place: nothing to prefetch for them
            keep = self._pool_keep(selection.blocks, keep)
        slots, miss = self.pool.assign(selection.blocks, keep, touch=False)
        stream = self.streams.prefetch if self.streams is not None else None
        count, unit, host_count = self._recall(selection.blocks, slots, miss, stream)
        self._count(count, unit, decode=True, prefetch=True, host_count=host_count)
        filled = torch.zeros(self.pool.block.shape, dtype=torch.int32, device=self.device)
        self._prefetched_slots = filled.scatter_add_(-1, slots, miss.int()) > 0

    def _bounded(self, selection: Selection) -> torch.Tensor:
        """``selection.keep`` limited to the forced blocks plus the ``lookahead_blocks`` best-scored others."""
        limit = self.config.lookahead_blocks
        keep = selection.keep
        k = keep.shape[-1]
        if limit is None or limit >= k:
            return keep
        rank = torch.arange(k, device=keep.device)
        if selection.scores is None:  # every block is attended (select_all): the newest ones
            return keep & (rank >= k - limit)
        scores = selection.scores.gather(-1, selection.blocks)
        forced = scores == float("inf")
        others = scores.masked_fill(forced | ~keep, float("-inf"))
        best = torch.zeros_like(keep).scatter_(-1, others.topk(limit, dim=-1).indices, True)
        return keep & (forced | best)

    # ------------------------------------------------------------------------------------------------ bookkeeping
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the mask: every cached token plus the new ones, from position 0."""
        return self.n_tokens + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens cached in this layer (padding included)."""
        return self.n_tokens

    def get_max_length(self) -> int:
        """No maximum (``-1``): the host pool grows."""
        return -1

    def device_kv_bytes(self) -> int:
        """Device bytes of KV held by this layer: the slot pool (with the open block's slot) and admitted blocks."""
        if not self.is_initialized:
            return 0
        return self.pool.nbytes + self.host.used_bytes_on(True)  # the pool holds the open block too

    def device_summary_bytes(self) -> int:
        """Device bytes of the block summaries (their buffers, allocated by SUMMARY_CHUNK_BLOCKS blocks)."""
        return sum(s.numel() * s.element_size() for s in getattr(self, "_summary_store", {}).values())

    def host_kv_bytes(self) -> int:
        """Host bytes of the sealed blocks (blocks admitted to the device excluded)."""
        return self.host.used_bytes_on(False) if self.is_initialized else 0

    def sealed_kv(self, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first ``n_blocks`` sealed blocks of every sequence, recalled onto the device in
        one pass (a prefill chunk attends to all of them; counted as recalled, not as decode traffic).

        Args:
            n_blocks: sealed blocks to read per sequence, at most :attr:`n_blocks`.

        Returns:
            ``(keys, values)``, each ``[batch, kv_heads, n_blocks * block_tokens, head_dim]``, compute device.
        """
        batch, heads, T, D = self.batch, self.kv_heads, self.block_tokens, self.head_dim
        if self.use_kernels:
            scratch = DeviceSlotPool(batch, n_blocks, heads, T, D, self.dtype, self.device)
            transfer.wait_event(self._selectable_written, self.device)
            self._selectable_written = None
            slots = torch.arange(n_blocks, device=self.device).repeat(batch)
            rows = torch.arange(batch, device=self.device).repeat_interleave(n_blocks)
            transfer.recall_blocks_kernel(self.host, scratch, self.block_table_dev[:, :n_blocks].flatten(), rows, slots)
            keys, values = scratch.keys, scratch.values  # slot j holds block j: the pool is the sequence in order
        else:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # host writes may still be in flight
            blocks = self.host.read(self.block_table[:, :n_blocks].flatten()).to(self.device)
            blocks = blocks.view(batch, n_blocks, 2, heads, T, D).permute(2, 0, 3, 1, 4, 5)
            keys, values = blocks.reshape(2, batch, heads, n_blocks * T, D).unbind(0)
        self._count(batch * n_blocks, self.host.block_bytes, decode=False)
        return keys, values

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole KV of this layer re-assembled from the host pool and the open block (for checks and export).

        Returns:
            ``(keys, values)``, each ``[batch, kv_heads, n_tokens, head_dim]``, on the compute device.
        """
        if self.n_blocks == 0:
            return self.keys.clone(), self.values.clone()  # the open slot is overwritten by later steps
        if self.use_kernels and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the kernels write the host pool asynchronously
        blocks = self.host.read(self.block_table.flatten()).to(self.device)
        blocks = blocks.view(self.batch, self.n_blocks, 2, self.kv_heads, self.block_tokens, self.head_dim)
        kv = blocks.permute(2, 0, 3, 1, 4, 5).reshape(2, self.batch, self.kv_heads, -1, self.head_dim)
        return torch.cat([kv[0], self.keys], dim=-2), torch.cat([kv[1], self.values], dim=-2)

    def _unsupported(self, what: str):
        raise NotImplementedError(
            f"OffloadCache does not support {what} yet (beam search, assisted or contrastive decoding); use greedy "
            "or sampling with one sequence per prompt."
        )

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Not supported yet (beam search)."""
        self._unsupported("reordering the batch")

    def crop(self, tokens_to_remove: int) -> None:
        """Not supported yet (assisted decoding)."""
        if tokens_to_remove:
            self._unsupported("cropping")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Only allowed while empty (generate expands inputs before the first forward)."""
        if self.n_tokens and repeats != 1:
            self._unsupported("expanding a filled cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Not supported yet."""
        if self.n_tokens:
            self._unsupported("selecting sequences of a filled cache")


class _SharedResources:
    """Per-device objects the offloaded layers of one cache share, created on first use: the device admission
    budget, the side streams and the phase timer. Holds no reference to the cache or its layers."""

    def __init__(self, config: OffloadConfig):
        self.config = config
        self.admissions: dict[torch.device, DeviceAdmission] = {}
        self.transfer_streams: dict[torch.device, transfer.TransferStreams] = {}
        self.phase_timer: PhaseTimer | None = None
        self.inputs: dict[torch.device, DecodeInputs] = {}
        self.graph_pools: dict[torch.device, tuple] = {}
        self.capture_streams: dict[torch.device, torch.cuda.Stream] = {}
        self.live_graphs: dict[torch.device, int] = {}
        self.statics: dict[torch.device, StaticInputs] = {}

    def admission(self, device: torch.device) -> DeviceAdmission | None:
        """The device admission budget of ``device`` (one per device), or ``None`` unless admission is "auto"."""
        if self.config.admission != "auto":
            return None
        if device not in self.admissions:
            gib = self.config.device_memory_gib
            self.admissions[device] = DeviceAdmission(device, None if gib is None else int(gib * (1 << 30)))
        return self.admissions[device]

    def streams(self, device: torch.device) -> transfer.TransferStreams:
        """The side streams of a CUDA device (one set per device)."""
        if device not in self.transfer_streams:
            self.transfer_streams[device] = transfer.TransferStreams(device)
        return self.transfer_streams[device]

    def decode_inputs(self, device: torch.device) -> DecodeInputs:
        """The shared inputs of the decode step on ``device`` (one per device)."""
        return self.inputs.setdefault(device, DecodeInputs())

    def capture_graph(self, device: torch.device, body, query: torch.Tensor, held: tuple) -> CapturedDecode:
        """Capture a layer's decode step (:func:`~hf_offload.graphs.capture`) into the memory pool that the graphs of
        the cache's layers on ``device`` share: they replay one after the other, in the order they were captured,
        so their temporaries may share memory, which needs one capture stream for all of them (the allocator reuses
        a block only on the stream that freed it). A pool lives as long as one of its graphs does; after the last
        one is dropped (a reset), the next capture starts a new pool."""
        return self._in_pool(device, lambda pool, stream: capture(body, query, pool, held, stream))

    def capture_layer(self, device: torch.device, forward, args: tuple, kwargs: dict, held: tuple) -> CapturedLayer:
        """Capture a whole decoder layer's decode step (:func:`~hf_offload.graphs.capture_decoder_layer`) into the same pool
        and on the same stream as :meth:`capture_graph`, its tensor arguments read from :meth:`static_inputs`."""
        statics = self.static_inputs(device)
        return self._in_pool(
            device, lambda pool, stream: capture_decoder_layer(forward, args, kwargs, statics, pool, held, stream)
        )

    def capture_work(self, device: torch.device, enqueue, held: tuple) -> CapturedWork:
        """Capture work without arguments (:func:`~hf_offload.graphs.capture_work`; a layer's seal of a block) into
        the same pool and on the same stream as :meth:`capture_graph`."""
        return self._in_pool(device, lambda pool, stream: _capture_work(enqueue, device, pool, held, stream))

    def _in_pool(self, device: torch.device, capture_with: Callable):
        """``capture_with(pool, stream)`` with the pool and capture stream the cache's graphs on ``device`` share;
        the captured graph is counted as one of the pool's (a failed capture sends later ones to a new pool)."""
        self._pool(device)
        try:
            captured = capture_with(self.graph_pools[device], self.capture_streams[device])
        except Exception:
            self._pool_failed(device)
            raise
        return self._count_graph(device, captured)

    def static_inputs(self, device: torch.device) -> StaticInputs:
        """The fixed-address input buffers of the decoder-layer graphs on ``device``."""
        return self.statics.setdefault(device, StaticInputs())

    def _pool(self, device: torch.device) -> None:
        if not self.live_graphs.get(device):
            self.graph_pools[device] = torch.cuda.graph_pool_handle()
        if device not in self.capture_streams:
            self.capture_streams[device] = torch.cuda.Stream(device)

    def _pool_failed(self, device: torch.device) -> None:
        """After a failed capture: later captures go to a new pool (the allocator may still count the failed
        capture as recording into the old one, which refuses every later capture into it)."""
        self.graph_pools[device] = torch.cuda.graph_pool_handle()

    def _count_graph(self, device: torch.device, captured):
        self.live_graphs[device] = self.live_graphs.get(device, 0) + 1
        weakref.finalize(captured, self._graph_dropped, device)
        return captured

    def _graph_dropped(self, device: torch.device) -> None:
        self.live_graphs[device] -= 1

    def timer(self, device: torch.device) -> PhaseTimer:
        """The cache's phase timer."""
        if self.phase_timer is None:
            self.phase_timer = PhaseTimer(device)
        return self.phase_timer


def _layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types is None:
        n = config.num_hidden_layers
        if getattr(config, "sliding_window", None) is not None:
            types = ["sliding_attention"] * n
        elif getattr(config, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        else:
            types = ["full_attention"] * n
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    return list(types[: len(types) - shared] if shared else types)



def generate_cache_kwarg() -> str:
    """The keyword under which the installed transformers' ``generate()`` takes a cache: ``"cache"`` where its
    generation inputs are named so (transformers 5.24 renamed ``past_key_values`` and warns about the old name until
    6.0), else ``"past_key_values"`` (transformers 5.17)."""
    import inspect

    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


class OffloadCache(Cache):
    """A KV cache that keeps full-attention layers in host memory and attends to a budget of blocks per step.

    Building it switches ``model`` to the offload attention (idempotent); with any other cache the switched model
    behaves exactly as before.

    Args:
        model: the transformers decoder model that will use this cache.
        budget_tokens: KV tokens one decode query attends to, per sequence and layer (sink and window included).
        config: a full :class:`~hf_offload.config.OffloadConfig`; other keyword arguments override its fields.
        **overrides: any :class:`~hf_offload.config.OffloadConfig` field (``block_tokens``, ``sink_tokens``,
            ``window_tokens``, ``selector``, ``pool_tokens``, ...).

    Example:
        >>> from hf_offload import OffloadCache
        >>> cache = OffloadCache(model, budget_tokens=2048)  # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)  # doctest: +SKIP
        >>> cache.stats()["host_kv_bytes"]  # doctest: +SKIP

        ``past_key_values=`` works on every supported transformers; newer releases (5.24) renamed it ``cache=`` and
        warn about the old name. ``**cache.generate_kwargs()`` passes the cache under the name the installed
        version expects: ``model.generate(**inputs, **cache.generate_kwargs(), max_new_tokens=64)``.
    """

    def __init__(self, model: torch.nn.Module, budget_tokens: int | None = None, *, config=None, **overrides):
        if config is None:
            config = OffloadConfig(**({} if budget_tokens is None else {"budget_tokens": budget_tokens}), **overrides)
        else:
            changes = dict(overrides, **({} if budget_tokens is None else {"budget_tokens": budget_tokens}))
            config = config.replace(**changes) if changes else config
        text_config = _check_model(model)
        self.config = config
        self.selector = get_selector(config.selector)
        if (config.decode_capacity_blocks or 1) > 1 and not self.selector.masks_invalid:
            raise ValueError(
                f"decode_capacity_blocks={config.decode_capacity_blocks} scores blocks past the sealed ones, masked, "
                f"which selector {self.selector.name!r} does not support (its scores of valid blocks depend on every "
                "block: Selector.masks_invalid is False). Use decode_capacity_blocks=None or 1, or give the selector a "
                "masked_score() (every built-in selector has one or needs none)."
            )
        _check_reselect(config, self.selector)
        self.model_config = text_config
        self.host_budget = HostMemoryBudget(config.host_memory_gib)
        # What the layers share lives outside the cache, so that no layer refers back to the cache: a cache nobody
        # holds is freed at once (its pinned host pools with it), not at the next cyclic garbage collection.
        self._shared = _SharedResources(config)
        layer_types = _layer_types(text_config)
        unsupported = sorted(set(layer_types) - {"full_attention", *_SLIDING_TYPES})
        if unsupported:
            raise ValueError(
                f"OffloadCache serves attention layers only; {model.__class__.__name__} has layer types {unsupported} "
                "(linear attention / state-space layers) that it cannot hold."
            )
        if "full_attention" not in layer_types:
            raise ValueError(
                f"Every attention layer of {model.__class__.__name__} is a sliding-window layer "
                f"(sliding_window={getattr(text_config, 'sliding_window', None)}); sliding layers stay on the device, "
                "so nothing would be offloaded. Load the model with config.sliding_window=None if it was trained "
                "with full attention, or use DynamicCache."
            )
        layers: list[CacheLayerMixin] = []
        for idx, kind in enumerate(layer_types):
            if kind == "full_attention":
                first = not any(isinstance(layer, OffloadLayer) for layer in layers)
                layers.append(
                    OffloadLayer(
                        config, self.selector, idx, self.host_budget, id(self), text_config, self._shared.admission,
                        self._shared.timer, first, self._shared.streams, self._shared.decode_inputs,
                        self._shared.capture_graph, self._shared.capture_layer, self._shared.capture_work,
                    )
                )  # fmt: skip
            else:
                window = text_config.sliding_window if kind == "sliding_attention" else text_config.attention_chunk_size
                layers.append(DynamicSlidingWindowLayer(sliding_window=window))
        super().__init__(layers=layers)
        offload = self.offload_layers
        modules = dict((idx, module) for module, idx in decoder_layers(model))
        for layer, nxt in zip(offload, offload[1:]):
            layer.next_layer = nxt  # lookahead goes from each offloaded layer to the next one
            if nxt.layer_idx == layer.layer_idx + 1:  # its query predicted from this layer's input (same layer type)
                layer.next_decoder = modules.get(nxt.layer_idx)
        # The attention switch, whole-layer calls, fused norms / rotary / projections (shared by every cache of
        # the model; hf_offload.patches.remove(model) or disable_offload_attention(model) gives the model back).
        self.patches = install_patches(model, config)
        self.original_attn_implementation = self.patches.original_attn_implementation
        self._model_ref = weakref.ref(model)

    def run_decoder_layer(self, layer_idx: int, forward: Callable, args: tuple, kwargs: dict):
        """Run one call of the model's decoder layer ``layer_idx`` (its own forward ``forward`` with transformers'
        arguments): offloaded layers may replay it from a CUDA graph (:meth:`OffloadLayer.run_decoder_layer`); other
        layers call ``forward``. Called by the routing :func:`~hf_offload.patches.layers.install_layer_calls` puts in
        front of each decoder layer."""
        layer = self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else None
        if not isinstance(layer, OffloadLayer):  # a sliding-window layer: its norms still run the kernel
            with fused(call_fusions(self.config, args, kwargs)):
                return forward(*args, **kwargs)
        return layer.run_decoder_layer(forward, args, kwargs)

    def set_lookahead(self, lookahead: bool | None) -> None:
        """Switch layer-ahead lookahead on (``True``), off (``False``) or to on-where-the-kernels-run (``None``) for the coming
        decode steps, e.g. to compare both on one filled cache; see :class:`~hf_offload.config.OffloadConfig`."""
        self.set_options(lookahead=lookahead)

    def set_options(self, **changes) -> None:
        """Change settings that only affect coming decode steps (``lookahead``, ``cuda_graphs``, ``graph_scope``,
        ``timing``, ``fused_norms``, ``fused_rotary``, ``fused_projections``, ``reselect_every``) on a filled cache,
        e.g. to compare them on one cache. Captured decode graphs are dropped (captured again).

        Raises:
            ValueError: for any other field, or an invalid value (nothing is changed then).
        """
        options = {"lookahead", "cuda_graphs", "graph_scope", "timing", "fused_norms", "fused_rotary",
                   "fused_projections", "reselect_every"}  # fmt: skip
        other = set(changes) - options
        if other:
            raise ValueError(
                f"set_options() changes {', '.join(sorted(options))} only; "
                f"{sorted(other)} fix the cache's layout: build a new OffloadCache for them."
            )
        config = self.config.replace(**changes)
        _check_reselect(config, self.selector)
        self.config = config
        model = self._model_ref()
        if config.fused_projections is not False and model is not None and installed_patches(model) is not None:
            install_patches(model, config)  # projection groups not built when the cache was
        for layer in self.offload_layers:
            layer.config = config
            if layer.is_initialized:
                layer.timer = self._shared.timer(layer.device) if config.timing else None
            layer.resolve_lookahead()

    def drop_graphs(self) -> None:
        """Drop every captured decode graph; each layer captures again at its next decode step (e.g. after a
        function its decode step calls was replaced)."""
        for layer in self.offload_layers:
            layer._graphs.clear()

    @property
    def offload_layers(self) -> list[OffloadLayer]:
        """The offloaded (full-attention) layers."""
        return [layer for layer in self.layers if isinstance(layer, OffloadLayer)]

    def generate_kwargs(self) -> dict:
        """``{name: self}`` for ``model.generate(**inputs, **cache.generate_kwargs())``: ``name`` is
        :func:`generate_cache_kwarg`'s, so no deprecation warning on any supported transformers."""
        return {generate_cache_kwarg(): self}

    def stats(self) -> dict:
        """Bytes per tier, recall counters and hit rates (overall and per offloaded layer).

        Returns:
            A dict with ``device_kv_bytes`` (slot pools, open blocks and dense sliding layers),
            ``device_summary_bytes``, ``host_kv_bytes`` (sealed blocks), ``host_reserved_bytes``,
            ``recalled_blocks``, ``recalled_bytes`` (prefill and decode), ``decode_recalled_blocks``,
            ``decode_recalled_bytes`` (decode steps only, prefetches included), ``decode_host_bytes`` (the part of
            ``decode_recalled_bytes`` read from host memory; the rest were blocks that ``admission="auto"`` keeps
            on the device), ``prefetched_blocks``,
            ``prefetched_bytes`` (speculative recalls of lookahead), ``prefetch_used_blocks`` (prefetched blocks
            that the exact plan right after attended), ``offloaded_bytes``, ``graph_captures`` and
            ``graph_replays`` (layer decode steps captured into / replayed from CUDA graphs), ``graph_capture_ms``
            (host wall time of the layer decode steps that captured: the capture, and an op-by-op run first where the
            geometry's kind had not run op by op yet; a graph is captured at the first decode step of each block
            capacity, ``decode_capacity_blocks``, so this is what graphs cost), ``graph_capture_retries`` (captures without an op-by-op run first
            that failed and were redone after one; expected 0), ``seal_graph_captures`` and ``seal_graph_replays``
            (seals of a full block after a replayed step captured into / replayed from a CUDA graph), ``timing``
            (with ``timing=True``: mean ms per decode step of select, prefetch, recall, attention, rest and the whole step; else ``None``),
            ``hit_rate`` (share of selected blocks already resident during decode, prefetched ones included;
            with the paged decode attention, blocks of admitted chunks are read in place and count as resident;
            ``None`` before the first decode step), ``tail_share`` (with a selector that estimates the unselected
            blocks, ``quantkey[tail_bits=b]``: the estimated share of attention outside the selection, mean over
            decode steps, sequences and query heads; else ``None``), ``reused_selections`` (layer decode steps that
            attended the previous step's selection, ``reselect_every``), ``decode_steps`` and ``layers`` (the same
            counters per
            offloaded layer, keyed by layer index), ``fusions`` (``norm_modules`` and ``rotary_modules``: the
            model's RMS norm and attention modules that run one kernel where ``fused_norms`` / ``fused_rotary`` are
            on, see :mod:`hf_offload.patches.norms` and :mod:`hf_offload.patches.rotary`; ``projection_groups``: the
            groups of sibling projections computed as one product where ``fused_projections`` is on,
            :mod:`hf_offload.patches.projections`; ``norms``, ``rotary`` and ``projections``: whether the offloaded
            layers' calls run them, ``None`` before the first call). Blocks are counted per KV head for
            per-head selectors.
        """
        per_layer = {}
        device = summaries = host = reserved = 0
        for layer in self.layers:
            if isinstance(layer, OffloadLayer):
                s = layer.stats
                lookups, hits = int(s.lookups), int(s.hits)
                per_layer[layer.layer_idx] = {
                    "device_kv_bytes": layer.device_kv_bytes(),
                    "host_kv_bytes": layer.host_kv_bytes(),
                    "recalled_blocks": int(s.recalled_blocks),
                    "recalled_bytes": int(s.recalled_bytes),
                    "decode_recalled_bytes": int(s.decode_recalled_bytes),
                    "decode_host_bytes": int(s.decode_host_bytes),
                    "prefetched_blocks": int(s.prefetched_blocks),
                    "prefetch_used_blocks": int(s.prefetch_used_blocks),
                    "hit_rate": hits / lookups if lookups else None,
                    "lookups": lookups,
                    "tail_share": int(s.tail_ppm) / 1e6 / int(s.tail_steps) if int(s.tail_steps) else None,
                    "reused_selections": int(s.reused_selections),
                }
                device += layer.device_kv_bytes()
                summaries += layer.device_summary_bytes()
                host += layer.host_kv_bytes()
                reserved += layer.host.reserved_bytes if layer.is_initialized else 0
            elif layer.is_initialized and layer.keys is not None:
                device += 2 * layer.keys.numel() * layer.keys.element_size()
        offload = self.offload_layers

        def total(name: str) -> int:
            return sum(int(getattr(layer.stats, name)) for layer in offload)

        lookups = total("lookups")
        return {
            "device_kv_bytes": device,
            "device_summary_bytes": summaries,
            "host_kv_bytes": host,
            "host_reserved_bytes": reserved,
            "recalled_blocks": total("recalled_blocks"),
            "recalled_bytes": total("recalled_bytes"),
            "decode_recalled_blocks": total("decode_recalled_blocks"),
            "decode_recalled_bytes": total("decode_recalled_bytes"),
            "decode_host_bytes": total("decode_host_bytes"),
            "prefetched_blocks": total("prefetched_blocks"),
            "prefetched_bytes": total("prefetched_bytes"),
            "prefetch_used_blocks": total("prefetch_used_blocks"),
            "offloaded_bytes": total("offloaded_bytes"),
            "graph_captures": total("graph_captures"),
            "graph_replays": total("graph_replays"),
            "graph_capture_ms": total("graph_capture_us") / 1000,
            "graph_capture_retries": total("graph_capture_retries"),
            "seal_graph_captures": total("seal_graph_captures"),
            "seal_graph_replays": total("seal_graph_replays"),
            "hit_rate": total("hits") / lookups if lookups else None,
            "tail_share": total("tail_ppm") / 1e6 / tail_steps if (tail_steps := total("tail_steps")) else None,
            "reused_selections": total("reused_selections"),
            "decode_steps": max((layer.stats.decode_steps for layer in offload), default=0),
            "layers": per_layer,
            "timing": self._shared.phase_timer.summary() if self._shared.phase_timer is not None else None,
            "fusions": self._fusions(),
        }

    def _fusions(self) -> dict:
        """``stats()["fusions"]``: how many of the model's modules have a fused forward, and whether the offloaded
        layers' calls run them."""
        model = self._model_ref()
        modules = list(model.modules()) if model is not None else []
        on = next((f for layer in self.offload_layers if (f := getattr(layer, "fusions", None)) is not None), None)
        return {
            "norm_modules": sum(isinstance(m.__dict__.get("forward"), FusedNorm) for m in modules),
            "rotary_modules": sum(isinstance(m.__dict__.get("forward"), RotaryForward) for m in modules),
            "projection_groups": len(fused_groups(model)) if model is not None else 0,
            "norms": None if on is None else on[0],
            "rotary": None if on is None else on[1],
            "projections": None if on is None else on[2],
        }

    def reserve(self, tokens: int) -> None:
        """Allocate every offloaded layer's block summaries for ``tokens`` tokens per sequence up front (see
        :meth:`OffloadLayer.reserve`): useful before a chunked prefill of a known length, near the device's limit.

        >>> cache.reserve(prompt_tokens + max_new_tokens)  # doctest: +SKIP
        """
        for layer in self.offload_layers:
            layer.reserve(tokens)

    def reset_stats(self) -> None:
        """Zero the counters and the phase timing of :meth:`stats` (the cached tokens stay)."""
        for layer in self.offload_layers:
            layer.stats.reset()
        if self._shared.phase_timer is not None:
            self._shared.phase_timer.reset()

    def dense_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole KV of one offloaded layer re-assembled from all tiers; see :meth:`OffloadLayer.dense_kv`."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, OffloadLayer):
            raise ValueError(f"Layer {layer_idx} is a sliding-window layer; its KV is layers[{layer_idx}].keys.")
        return layer.dense_kv()


def _check_reselect(config: OffloadConfig, selector: Selector) -> None:
    """Raise ``ValueError`` where ``config.reselect_every`` above 1 meets a selector whose estimate of the unselected
    blocks needs every step's scores."""
    if config.reselect_every > 1 and selector.estimates_tail:
        raise ValueError(
            f"reselect_every={config.reselect_every} reuses a selection without scoring, but selector "
            f"{selector.name!r} estimates the attention outside its selection from every step's scores "
            "(tail_bits). Use reselect_every=1 with it, or a selector without the estimate (e.g. 'quantkey')."
        )


def _check_model(model) -> object:
    """Return the decoder text config of ``model`` or raise a clear error if the cache cannot serve it."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"OffloadCache(model, ...) takes the transformers model itself (it switches the model's attention), "
            f"got {type(model).__name__}."
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{model.__class__.__name__} is an encoder-decoder model; OffloadCache serves decoder-only models."
        )
    if not model.can_generate():
        raise ValueError(
            f"{model.__class__.__name__} is not a generative decoder model with a KV cache (it cannot generate); "
            "load it with AutoModelForCausalLM."
        )
    return model.config.get_text_config(decoder=True)
