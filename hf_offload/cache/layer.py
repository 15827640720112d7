"""``OffloadLayer``: the transformers cache layer of one full-attention layer, composed of parts that own its state.

* :class:`~.blocks.BlockStore` (``layer.blocks``): open block, sealing, block tables, summaries, host and slot pools;
* :class:`~.planner.DecodePlanner` (``layer.planner``): which blocks a query attends to;
* :class:`~.recaller.Recaller` (``layer.recaller``): slot rounds, recalls, prefetch and lookahead;
* :class:`~.graphs.GraphRunner` (``layer.graphs``): capture and replay of decode steps;
* :class:`~.stats.LayerStats` (``layer.stats``): the counters.

The layer itself keeps only the ``CacheLayerMixin`` surface (``update``, lengths, ``reset``) and the resolution of
how it runs (:class:`~.execution.LayerExecution`), which every part reads.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import CacheLayerMixin

from ..attention.handoff import Handoff, leave_handoff
from ..attention.prefill import lse_attention_available
from ..config import OffloadConfig
from ..kernels.append import append_token
from ..selectors import Selector
from ..store import HostMemoryBudget
from .blocks import BlockStore
from ..attention.inputs import DecodeInputs
from .execution import LayerExecution, call_fusions, fused, resolve, want_kernels, want_paged
from .graphs import GraphRunner
from .modes import normal_tensors
from .planner import DecodePlanner
from .recaller import Recaller
from .shared import forward_transient_bytes
from .stats import LayerStats


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
        resources: the per-device objects the cache's layers share (:class:`~.shared.DeviceResources`).
        is_first_offload_layer: whether this layer marks the start of each decode step for the timer.
    """

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(
        self,
        config: OffloadConfig,
        selector: Selector,
        layer_idx: int,
        budget: HostMemoryBudget,
        cache_id: int,
        model_config,
        resources,
        is_first_offload_layer: bool = True,
    ):
        self.stats = LayerStats()
        self.execution = LayerExecution()
        self.blocks = BlockStore(config, selector, layer_idx, budget, resources.admission, self.stats, self.execution)
        self.planner = DecodePlanner(config, selector, self.blocks, self.execution, self.stats)
        self.recaller = Recaller(config, selector, self.blocks, self.planner, self.execution, self.stats)
        self.graphs = GraphRunner(
            config, selector, layer_idx, self.blocks, self.planner, self.recaller, self.execution, self.stats,
            resources.decode_inputs, resources.capture_graph, resources.capture_layer, resources.capture_work,
        )  # fmt: skip
        super().__init__()
        self.config = config
        self.selector = selector
        self.layer_idx = layer_idx
        self.block_tokens = config.block_tokens
        self.resources = resources
        self.is_first_offload_layer = is_first_offload_layer
        self.cache_id = cache_id
        self.model_config = model_config
        self.model_name = getattr(model_config, "model_type", "?")
        self.timer = None  # the cache's PhaseTimer when timing is on
        self._decode_noted = False  # the admission saw a decode step since the last prefill
        resources.layers.add(self)

    # The CacheLayerMixin surface reads and writes these; the block store owns them.
    @property
    def keys(self):
        return self.blocks.keys

    @keys.setter
    def keys(self, value) -> None:
        self.blocks.keys = value

    @property
    def values(self):
        return self.blocks.values

    @values.setter
    def values(self, value) -> None:
        self.blocks.values = value

    @property
    def is_initialized(self) -> bool:
        return self.blocks.is_initialized

    @is_initialized.setter
    def is_initialized(self, value: bool) -> None:
        self.blocks.is_initialized = value

    @property
    def device(self) -> torch.device:
        """The compute device (known after the first update)."""
        return self.blocks.device

    @property
    def n_tokens(self) -> int:
        """Tokens cached per sequence (padding included)."""
        return self.blocks.n_tokens

    @property
    def n_blocks(self) -> int:
        """Sealed blocks per sequence."""
        return self.blocks.n_blocks

    # ------------------------------------------------------------------------------------------------- life cycle
    @normal_tensors
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, host=None) -> None:
        """Allocate the device slot pool and an empty host pool (or share ``host``, see :meth:`BlockStore.allocate`)
        for the shapes of the first update, and resolve how the layer runs on that device."""
        pinned = self.blocks.allocate(key_states, value_states, host)
        device = self.blocks.device
        execution = self.execution
        execution.use_kernels = want_kernels(self.config, device, pinned)
        if execution.use_kernels:
            self.blocks.start_device_table()
        execution.paged = want_paged(self.config, execution.use_kernels, device, self.blocks.pool.data)
        # Side streams only where the kernel path runs asynchronously (CUDA); elsewhere every copy is synchronous.
        use_streams = execution.use_kernels and device.type == "cuda"
        execution.streams = self.resources.streams(device) if use_streams else None
        self.resolve()

    def resolve(self) -> None:
        """Resolve lookahead, CUDA graphs, the fused kernels and the block capacity from the config (again after
        ``OffloadCache.set_options``); drops captured graphs."""
        device = self.blocks.device if self.blocks.is_initialized else None
        resolve(self.execution, self.config, device, self.selector.masks_invalid)
        self.graphs.clear()

    def set_selector(self, selector) -> None:
        """Use ``selector``, a coarser level of the current one (``Selector.coarser``), from now on: the summaries
        are re-encoded for it (``DeviceResources.coarsen_summaries`` drops the graphs first)."""
        self.blocks.coarsen(selector)
        for part in (self, self.planner, self.recaller, self.graphs):
            part.selector = selector

    def set_config(self, config: OffloadConfig) -> None:
        """Use ``config`` for the coming steps (only settings that leave the layout alone may differ)."""
        self.config = config
        for part in (self.blocks, self.planner, self.recaller, self.graphs):
            part.config = config
        if self.blocks.is_initialized:
            self.timer = self.resources.timer(self.device) if config.timing else None
            self.recaller.timer = self.timer
        self.resolve()

    def use_torch_transfer(self) -> None:
        """Move the coming steps to the portable transfer path (``transfer="torch"``): no paged decode attention and
        no CUDA graphs (a step of the torch path synchronises with the host). Host contents, block table and
        summaries are the same on both paths."""
        if self.blocks.is_initialized:
            self.execution.use_kernels = False
            self.execution.paged = want_paged(self.config, False, self.device, self.blocks.pool.data)
        self.resolve()

    @normal_tensors
    def reset(self) -> None:
        """Drop all tokens and free the pools; the next update starts afresh (any batch size)."""
        if self.blocks.is_initialized:
            self.resources.decode_inputs(self.device).invalidate()
        self.blocks.release()
        self.graphs.reset()
        self.planner.reset()
        self.recaller.clear()

    @normal_tensors
    def recycle(self) -> None:
        """Drop all tokens but keep the buffers and the captured graphs, for the next cache of the model
        (:mod:`~hf_offload.cache.parking`, :meth:`BlockStore.recycle`); the counters start at zero."""
        self._emptied_in_place(self.blocks.recycle)

    def _emptied_in_place(self, empty: Callable[[], None]) -> None:
        """``empty()`` (the block store emptied, or refilled, in its own buffers), then the step's shared inputs,
        the plan, the recall state and the counters start afresh; the graphs that can still replay stay."""
        live_rows: set[int] = set()
        if self.blocks.is_initialized:
            inputs = self.resources.decode_inputs(self.device)
            inputs.invalidate()
            live_rows = inputs.kept_rows()
        empty()
        self.planner.kept = None
        self.recaller.recycle()
        self.stats.reset()
        self._decode_noted = False
        self.graphs.recycle(live_rows)

    # ------------------------------------------------------------------------------------------------------ update
    def _note_forward(self, key_states: torch.Tensor) -> None:
        """At the first offloaded layer of a forward: let the device admission learn the forward's temporaries (a
        prefill chunk, and the first decode step after one, which sees the prefill's peak) and make room for them."""
        admission = self.blocks.host.admission
        q_len = key_states.shape[-2]
        if admission is None or (q_len == 1 and self._decode_noted):
            return
        self._decode_noted = q_len == 1
        batch = key_states.shape[0]
        # A later chunk attends its earlier blocks in segments where the device's fused attention gives its
        # log-sum-exp (checked once per device, dtype and head size).
        segmented = q_len > 1 and lse_attention_available(key_states.device, key_states.dtype, key_states.shape[-1])
        admission.note_forward(
            forward_transient_bytes(self.model_config, batch, q_len, key_states.element_size(),
                                    self.config.prefill_chunk_tokens, self.blocks.n_tokens, segmented,
                                    cpu=key_states.device.type == "cpu")  # fmt: skip
        )

    def _note_question(self, tokens: int) -> None:
        """:meth:`_note_forward` for a question replayed from its graph (its keys are not made before the
        replay: a view of the open block's shape stands in for them)."""
        if self.is_first_offload_layer:
            store = self.blocks
            self._note_forward(store.open_k[:, :, :1].expand(store.batch, store.kv_heads, tokens, store.head_dim))

    @normal_tensors
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
        store = self.blocks
        if store.recycled and not store.fits(key_states):
            self.reset()  # another cache's buffers (parking) of other shapes: freed before this forward's
        store.recycled = False
        if not store.is_initialized:
            self.initialize_like(key_states, value_states)
        elif key_states.shape[0] != store.batch or key_states.shape[1] != store.kv_heads:
            raise ValueError(
                f"Layer {self.layer_idx} holds batch {store.batch} x {store.kv_heads} KV heads but got keys of shape "
                f"{tuple(key_states.shape)}; use a new OffloadCache for a new batch (or call cache.reset())."
            )
        if key_states.dtype != store.dtype:
            key_states, value_states = key_states.to(store.dtype), value_states.to(store.dtype)
        question = self.graphs.question_capture
        if question is not None:
            # A question's decoder layer being captured (or run once before that): the chunk is attended after the
            # open block's tokens, and appended to the cache only after each replay (GraphRunner.run_question).
            question.kv = (key_states.transpose(1, 2), value_states.transpose(1, 2))
            recent_k = torch.cat([store.keys, key_states], dim=-2)
            recent_v = torch.cat([store.values, value_states], dim=-2)
            leave_handoff(Handoff(self, recent_k, recent_v, store.n_blocks * self.block_tokens, store.n_blocks))
            return recent_k, recent_v
        capturing = self.graphs.layer_capture
        if capturing is None and self.is_first_offload_layer:
            self._note_forward(key_states)
        if capturing is not None:
            # A decode step captured with its whole decoder layer: the token goes into the open block at the position
            # the step's shared inputs hold, so that every replay writes where its token belongs; the host-side state
            # is left alone (each replay updates it). The whole open block is handed over, only its first tokens
            # filled (the step's shared inputs mask the rest).
            append_token(store.open_k, store.open_v, capturing.inputs.open_pos, key_states, value_states)
            n_recent = store.keys.shape[-2] + 1
            leave_handoff(Handoff(self, store.open_k, store.open_v, store.n_blocks * self.block_tokens, store.n_blocks,
                                  n_recent))  # fmt: skip
            return store.open_k, store.open_v
        if self.timer is not None and self.is_first_offload_layer and key_states.shape[-2] == 1:
            self.timer.step_start()
        # This forward reads only blocks sealed before it: their host writes are the ones recalls wait for.
        store.selectable_written = store.last_write
        first_recent, n_before = store.n_blocks * self.block_tokens, store.n_blocks
        recent_k, recent_v = store.append(key_states, value_states)
        leave_handoff(Handoff(self, recent_k, recent_v, first_recent, n_before))
        return recent_k, recent_v

    def decode_inputs(self, handoff: Handoff, mask, capacity: int | None = None) -> DecodeInputs:
        """The shared inputs of this decode step (built by the step's first offloaded layer on this device).

        Args:
            handoff: this step's handoff.
            mask: the forward's :class:`~hf_offload.attention.OffloadMask` (plain causal), or ``None``.
            capacity: blocks the step scores (:meth:`DecodePlanner.decode_capacity`); ``None``: the sealed blocks.
        """
        store = self.blocks
        return self.resources.decode_inputs(store.device).update(
            store.batch, handoff.n_blocks_before, self.block_tokens, handoff.first_recent_pos, handoff.key.shape[-2],
            None if mask is None else mask.padding, self.config.sink_blocks, self.config.window_blocks, store.device,
            step=mask, capacity=capacity,
        )  # fmt: skip

    @normal_tensors
    def finish_step(self) -> None:
        """After this step's attention: the blocks it sealed enter the slot pool (after any prefetch into it)."""
        self.recaller.wait_prefetch()  # the slot written next may be one a prefetch was filling
        self.blocks.finish_step()

    @normal_tensors
    def reserve(self, tokens: int) -> None:
        """Allocate the block summaries for ``tokens`` tokens per sequence now (and from the first seal on, if none
        is sealed yet), so that they never grow while the cache fills: growing buffers of a cache filled in many
        pieces (chunked prefill) leave freed buffers behind that fragment a nearly full device. Never shrinks; the
        reservation outlives :meth:`reset`.

        Args:
            tokens: tokens per sequence the cache will hold (prompt, padding and generated tokens).
        """
        if self.blocks.reserve(tokens):
            self.graphs.clear()  # captured graphs read the old buffers

    # ------------------------------------------------------------------------------------- whole decoder layers
    @normal_tensors
    def run_decoder_layer(self, forward: Callable, args: tuple, kwargs: dict):
        """One call of the decoder layer this cache layer belongs to: replayed from a CUDA graph of the whole layer
        (norms, projections, MLP, :meth:`update` and the offloaded attention) where the step allows it
        (``graph_scope="layer"``, :meth:`GraphRunner.layer_step`), else ``forward(*args, **kwargs)`` as transformers
        would call it (after starting the next layer's prefetch from this layer's input, ``lookahead_query="next"``).

        Args:
            forward: the decoder layer's own forward.
            args, kwargs: the call's arguments (the hidden states ``[batch, 1, hidden]``, the rotary embeddings, the
                lazy mask, this cache, ...).
        """
        fusions = self.execution.fusions
        if fusions is None:  # the layer's first call: its device is the hidden states'
            fusions = call_fusions(self.config, args, kwargs)
        with fused(fusions):
            step = self.graphs.layer_step(args, kwargs)
            if step is not None:
                return self.graphs.run_decoder_layer(step, forward, args, kwargs)
            question = self.graphs.question_step(args, kwargs)
            if question is not None:
                out = self.graphs.run_question(question, forward, self._note_question)
                if out is not None:
                    return out
            self.recaller.prefetched_ahead = self.recaller.lookahead_from_input(args, kwargs)
            try:
                return forward(*args, **kwargs)
            finally:
                self.recaller.prefetched_ahead = False

    # ------------------------------------------------------------------------------------------------ bookkeeping
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` for the mask: every cached token plus the new ones, from position 0."""
        return self.blocks.n_tokens + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens cached in this layer (padding included)."""
        return self.blocks.n_tokens

    def get_max_length(self) -> int:
        """No maximum (``-1``): the host pool grows."""
        return -1

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole KV of this layer re-assembled from all tiers (:meth:`BlockStore.dense_kv`)."""
        return self.blocks.dense_kv()

    @normal_tensors
    def load_state(self, other: "OffloadLayer") -> None:
        """Hold a copy of the tokens of ``other``, the same layer of another cache with the same settings (see
        :meth:`BlockStore.load`); used by ``copy.deepcopy`` of the cache."""
        if not other.blocks.is_initialized:
            return
        self.initialize_like(other.blocks.keys, other.blocks.values)
        self.blocks.load(other.blocks)

    @normal_tensors
    def share_rows(
        self, other: "OffloadLayer", rows: torch.Tensor, rows_dev: torch.Tensor | None = None, synced: bool = False
    ) -> None:
        """Continue the sequences ``rows`` (``[batch]``, ``torch.int64``, CPU) of ``other``, the same layer of
        another cache with the same settings, sharing its sealed host blocks (:meth:`BlockStore.share_rows`, which
        says what ``rows_dev`` and ``synced`` are); used by ``OffloadCache.fork``. This layer must be empty."""
        if not other.blocks.is_initialized:
            return
        dev = rows.to(other.device) if rows_dev is None else rows_dev
        self.initialize_like(other.blocks.keys[dev], other.blocks.values[dev], host=other.blocks.host)
        self.blocks.share_rows(other.blocks, rows, dev, synced)

    def refill_rows(self, other: "OffloadLayer", rows: torch.Tensor, rows_dev: torch.Tensor | None = None) -> None:
        """Drop this layer's tokens and continue the sequences ``rows`` of ``other`` again, keeping this layer's
        buffers and captured graphs (this layer is an earlier fork of ``other``: :meth:`share_rows`,
        :meth:`BlockStore.refill`, which says what it refuses and what it needs of the caller, and what
        ``rows_dev`` is); the counters start at zero."""
        self.recaller.wait_prefetch()
        self._emptied_in_place(lambda: self.blocks.refill(other.blocks, rows, rows_dev))
        # A refilled fork serves question after question over one prefix: its questions replay graphs (a new fork's
        # first question runs op by op, which a fork used once would not gain from capturing).
        self.graphs.questions = self.blocks.n_tokens

    @normal_tensors
    def initialize_like(self, key_states: torch.Tensor, value_states: torch.Tensor, host=None) -> None:
        """Initialise the layer for keys and values shaped like these (``[batch, kv_heads, any, head_dim]``) without
        caching them, as the first :meth:`update` would; ``host``: a host pool to share
        (:meth:`BlockStore.allocate`)."""
        if not self.blocks.is_initialized:
            self.lazy_initialization(key_states, value_states, host)
            if self.config.timing:
                self.timer = self.recaller.timer = self.resources.timer(self.device)

    # ------------------------------------------------------------------------------------------------- editing
    @normal_tensors
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens (assisted and prompt-lookup decoding roll back rejected candidates).

        Args:
            tokens_to_remove: ``-n`` drops the last ``n`` tokens (transformers 5.18 on); a positive value is the
                length to keep (``crop(max_length)``, transformers up to 5.17), a no-op when the layer holds no more;
                ``0`` does nothing.
        """
        n = self.blocks.n_tokens
        if not self.blocks.is_initialized or tokens_to_remove == 0:
            return
        keep = min(int(tokens_to_remove), n) if tokens_to_remove > 0 else max(n + int(tokens_to_remove), 0)
        if keep == n:
            return
        self.recaller.wait_prefetch()
        self.blocks.crop(keep)
        self._edited()

    @normal_tensors
    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every sequence ``repeats`` times in place (``[a, b]`` -> ``[a, a, b, b]``); the copies share the
        sealed host blocks."""
        if self.blocks.is_initialized:
            self._take_rows(torch.arange(self.blocks.batch).repeat_interleave(int(repeats)))

    @normal_tensors
    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the sequences ``indices`` (integer indices or a boolean mask over the batch), in that order."""
        if self.blocks.is_initialized:
            rows = torch.as_tensor(indices)
            rows = rows.nonzero().flatten() if rows.dtype == torch.bool else rows.flatten().long()
            self._take_rows(rows)

    @normal_tensors
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the sequences for beam search: sequence ``i`` becomes the old sequence ``beam_idx[i]``."""
        if self.blocks.is_initialized:
            self._take_rows(beam_idx.flatten().long())

    def _take_rows(self, rows: torch.Tensor) -> None:
        self.recaller.wait_prefetch()  # a prefetch may still fill the slot pool being reordered
        self.blocks.take_rows(rows)
        self.stats.take_rows(rows)
        self._edited()

    def _edited(self) -> None:
        """After a crop or a batch edit: forget what was planned or captured for the old contents."""
        self.recaller.wait_prefetch()
        self.recaller.clear()  # its index tensors are per sequence and block count
        self.planner.reset()
        self.graphs.clear()
        self.resources.decode_inputs(self.device).invalidate()
