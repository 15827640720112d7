"""Typed, validated settings of an :class:`~hf_offload.cache.OffloadCache`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def _round_to_block(tokens: int, block_tokens: int) -> int:
    return max(block_tokens, (tokens // block_tokens) * block_tokens)


DEFAULT_SELECTOR = "quantkey[bits=4,tail_bits=2,tail_near=3]"
"""The selector of :class:`OffloadConfig`: 4-bit keys rank the blocks, 2-bit values estimate the attention the
selection leaves out (``hf_offload.selectors.quantkey``). RULER at a budget of 1/16, 4K / 8K / 16K: 74.6 / 71.7 / 65.3
against dense 74.9 / 73.1 / 65.9 on Qwen2.5-Coder-0.5B-Instruct (``docs/results/ruler_qwen05_tail.md``), 85.3 / 77.9 /
73.5 against 85.9 / 78.8 / 73.5 on the 1.5B (``docs/results/ruler_qwen15.md``), both with the Triton estimate; with
the tensor-core estimate (the default on compute capability 9.0+) 74.7 / 70.9 / 65.0 on the 0.5B
(``docs/results/ruler_qwen05_tail_mma.md``)."""


@dataclass
class OffloadConfig:
    """Settings of an offloaded KV cache. Sizes carry their unit in the name; all token counts are per sequence and
    per layer.

    Attributes:
        budget_tokens: how many KV tokens one decode query attends to, sink and window included. A budget at least
            as large as the context means "attend to everything": the output equals dense attention.
        block_tokens: tokens per block, the unit of selection, storage and transfer. A positive power of two.
        sink_tokens: first tokens of each sequence (its first non-padding tokens) that every decode query attends
            to. ``None``: ``budget_tokens // 32`` clamped to ``[block_tokens, 64]``. A multiple of ``block_tokens``.
        window_tokens: most recent sealed tokens that every decode query attends to, besides the open block of fewer
            than ``block_tokens`` tokens that is always attended. ``None``: ``budget_tokens // 8`` clamped to
            ``[block_tokens, 256]``. A multiple of ``block_tokens``.
        selector: name of a registered selector (``"quantkey"``, ``"meanbound"``, ``"meanvar"``, ``"union"``,
            ``"solohead"``, ``"headwise"``, ``"streaming"``, ``"oracle"``), optionally with settings
            (``"quantkey[bits=4]"``), or a :class:`~hf_offload.selectors.Selector` instance. The default,
            :data:`DEFAULT_SELECTOR` (``"quantkey[bits=4,tail_bits=2,tail_near=3]"``), is SoloHead-style (one
            selection per layer and sequence, whole blocks): every key on the device at 4 bits ranks the blocks by
            their estimated attention mass, and the attention the selection leaves out is estimated and joins the
            softmax (2-bit values; token by token for the ``3k`` best unselected blocks, by block log-sum-exps for
            the rest). On RULER at a budget of 1/16 it is within 0.8 points of dense on Qwen2.5-Coder-0.5B and 0.5
            on 1.5B (4K-16K average). ``"quantkey"`` (2-bit keys, selection alone) is the fast choice: 1.6-2x the
            decode throughput (8B shape, H200) and 2/5 of the summary bytes, 1.6 points below dense on the 0.5B (3.1
            at 16K).
            ``docs/tuning.md`` compares the selectors, with links to the measurements.
        pool_tokens: capacity of the device slot pool (hot blocks kept across decode steps). ``None``: 1.25 x
            ``budget_tokens``, rounded up to whole blocks. A smaller pool still gives exact results; selected blocks
            are then attended in several rounds.
        prefill_chunk_tokens: queries (and keys) processed per attention tile during prefill; bounds the size of the
            score matrix, ``batch x heads x prefill_chunk_tokens**2`` floats.
        host_chunk_mib: size of one host pool allocation, in MiB; the pool grows by whole chunks.
        host_memory_gib: upper bound on the host pool of the whole cache, in GiB; ``None``: no bound beyond the
            machine's available memory.
        pin_memory: pin the host pool (page-locked, needed for fast asynchronous copies). ``None``: pin when the
            model runs on CUDA.
        transfer: how blocks move between host and device. ``"kernel"``: one Triton launch per layer and step that
            reads/writes pinned memory directly and never synchronises with the host (CUDA, pinned pool, Triton);
            ``"torch"``: the portable path (host-side gather, one copy); ``"auto"``: ``"kernel"`` where it can run.
        admission: where sealed blocks are stored. ``"always"``: every block goes to the host pool (offloaded).
            ``"auto"``: IO-adaptive admission (PulseInfer): block pool chunks stay in device memory while the cache
            fits ``device_memory_gib``, and only the rest is offloaded; selection and budget are unchanged, so the
            output is identical, only the recall traffic differs.
        device_memory_gib: device memory that ``admission="auto"`` may use for blocks, in GiB, for the whole cache.
            ``None``: 80% of the free device memory when the first block is sealed (nothing on CPU-only machines).
        transfer_cap_blocks: most blocks one decode step recalls per sequence, KV head and layer; beyond it a
            resident block within ``transfer_cap_margin`` of a missing block's score is attended instead (NOSA's
            locality idea). ``None``: no cap.
        transfer_cap_margin: relative score margin of the transfer cap.
        reselect_every: a decode step chooses its blocks anew every this many steps of a layer; the steps in between
            attend to the blocks the last choice made (with the open block and its new token), skipping the
            selector's scoring and top-k, and recalling nothing. A step that follows a seal always chooses anew (the
            sealed block count changed). 1 (default): every step chooses. Larger values trade the selection's
            freshness for speed: the step that reuses skips the work that costs the most at long contexts (with
            plain ``quantkey`` at 64K tokens on an H200, 8B shape, batch 12, about 143 of a layer's 326 us), and
            selection recall drops by how much consecutive queries differ (TokenSelect, Wu et al., 2024, reuses a
            selection while consecutive queries stay similar; this is the fixed-interval form). Needs a selector
            without an estimate of the unselected blocks (that estimate reads every step's scores): plain
            ``quantkey``, not ``quantkey[tail_bits=...]``. ``docs/tuning.md`` has the measured trade-off.
        timing: record per-phase times of decode steps (select, prefetch, recall, attention, rest; ms per step)
            into ``cache.stats()["timing"]``.
        lookahead: layer-ahead prefetch in decode (training-free, after InfiniGen / SparDA): a speculative plan of
            the next offloaded layer (with the query ``lookahead_query`` says) scores that layer's block summaries
            and its likely misses start moving on a side stream, so its exact plan finds them resident. Only moves data
            early: what is attended is decided by each layer's exact plan, so outputs do not change. ``False``
            (default): off: lookahead runs op by op (it excludes CUDA graphs), and there the step is bound by
            host-side launch work: 8B shape, 32K, batch 8, every block offloaded, on an H200, it hid 0.78-1.11 of
            the recall but took 166-192 ms per step, against 61-73 ms from the layer graphs without it
            (``results/recall/lookahead_next_h200/``); ``None``: on where blocks move
            through the copy kernels on CUDA, off elsewhere; ``True``: on everywhere (elsewhere the same
            speculative plan and recall run synchronously, for tests; no overlap).
        lookahead_query: what the speculative plan of the next layer scores with. ``"next"`` (default): the next
            layer's own query predicted from this layer's input (its input norm, query projection and rotary
            embedding applied to this layer's input hidden states, after InfiniGen; ``hf_offload.cache.lookahead``),
            planned before this layer runs, for decoder layers of the Llama / Mistral / Qwen form whose next
            offloaded layer is the adjacent one; elsewhere ``"same"``. ``"same"``: this layer's own query, planned
            right after this layer's plan.
        lookahead_blocks: most blocks per sequence (and KV head, for per-head selectors) that one speculative plan
            selects besides the sink and window blocks, which bounds the bytes a wrong guess costs. ``None``: as
            many as the budget selects.
        cuda_graphs: replay each offloaded layer's decode attention (selection, slot assignment, recall, attention)
            from a CUDA graph instead of launching its ~120 small operations one by one from Python. A layer's
            graph is captured at the first decode step of each block capacity (``decode_capacity_blocks``: the
            blocks a step scores fix the shapes) and replayed for the other steps; the outputs are those of the step
            run op by op.
            Needs a CUDA device and the kernel transfer path; the steps it cannot serve (timing or lookahead on,
            prefill, masks other than causal with padding) run op by op. ``None`` (default): on where it can run;
            ``False``: off; ``True``: on, and an error where it cannot run.
        graph_scope: what a replayed graph covers. ``"layer"``: the whole decoder layer of a decode step (its
            norms, projections and MLP, the cache update and the offloaded attention), one replay per layer instead
            of the model's own few dozen launches around the attention's graph; a step whose token fills the open
            block seals it after the replay. A layer whose code cannot be captured warns once and keeps
            ``"attention"``. ``"attention"``: the offloaded attention only. Used only while graphs are on
            (``cuda_graphs``).
        decode_capacity_blocks: a decode step scores the sealed blocks rounded up to a multiple of this, the blocks
            past the sealed ones masked out of the selection and the estimate, so its shapes (and its CUDA graph)
            stay the same over that many seals. Larger: fewer graph captures, a little more scoring work (at most
            ``decode_capacity_blocks - 1`` blocks of codes per step). ``None``: 64 where the selector leaves blocks
            it may not attend out of every block's score (``Selector.masks_invalid``: every built-in selector), with
            CUDA graphs or without, so that a step computes the same sums either way; else 1 (the sealed blocks).
            Other values need such a selector.
        fused_norms: compute the RMS norms of the decoder layer calls this cache runs (offloaded and sliding-window
            layers, prefill and decode: the norms before attention and MLP, and query / key norms) with one Triton
            launch each (:mod:`hf_offload.norms`) instead of
            transformers' nine small kernels; the same roundings, only the float32 sum of squares added in another
            order (an output element can move by one unit in the last place). ``None`` (default): on where Triton
            runs on the layer's CUDA device; ``True``: on wherever Triton runs (also its CPU interpreter), an error
            elsewhere; ``False``: off, transformers' own norms, bit for bit.
        fused_rotary: compute the rotary embedding of the query and key states in the decoder layer calls this
            cache runs with one Triton launch (:mod:`hf_offload.rotary`) instead of transformers' ten small kernels,
            bit for bit (for attention modules that call Llama's ``apply_rotary_pos_emb``: Llama, Mistral, Qwen2,
            Qwen3, Gemma 3, ...; others keep theirs). ``None`` (default): on where Triton runs on the layer's CUDA
            device; ``True``: on wherever Triton runs (also its CPU interpreter), an error elsewhere; ``False``:
            off, transformers' own function.
        fused_projections: compute each decoder layer's sibling projections (q, k and v; gate and up) as one matrix
            product in the decoder layer calls this cache runs (:mod:`hf_offload.projections`: their weights become
            row blocks of one tensor when the cache is built, the same values and no added memory). The same sums,
            possibly added in another order by the matrix library (an output element can differ in its last bits).
            ``None`` (default): on where the model's decoder layers are on CUDA; ``True``: on for any device;
            ``False``: off, the weights left as they are.
        decode_attention: how a decode step attends its selected blocks. ``"paged"``: one Triton kernel reads each
            block where it lies: blocks of admitted chunks (``admission="auto"``) in place, blocks in host memory
            from the slot pool after their recall, so only those are ever copied (needs the kernel transfer path).
            ``"pool"``: every selected block is made resident in the slot pool (admitted ones copied within the
            device) and one ``scaled_dot_product_attention`` reads the pool. ``"auto"``: ``"paged"`` on CUDA with the
            kernel transfer path, else ``"pool"``. The outputs agree to float rounding (both are exact attention over
            the same tokens).
    """

    budget_tokens: int = 2048
    block_tokens: int = 16
    sink_tokens: int | None = None
    window_tokens: int | None = None
    selector: object = DEFAULT_SELECTOR
    pool_tokens: int | None = None
    prefill_chunk_tokens: int = 1024
    host_chunk_mib: float = 16
    host_memory_gib: float | None = None
    pin_memory: bool | None = None
    transfer: str = "auto"
    admission: str = "always"
    device_memory_gib: float | None = None
    transfer_cap_blocks: int | None = None
    transfer_cap_margin: float = 0.1
    reselect_every: int = 1
    timing: bool = False
    lookahead: bool | None = False
    lookahead_query: str = "next"
    lookahead_blocks: int | None = None
    cuda_graphs: bool | None = None
    graph_scope: str = "layer"
    decode_capacity_blocks: int | None = None
    decode_attention: str = "auto"
    fused_norms: bool | None = None
    fused_rotary: bool | None = None
    fused_projections: bool | None = None
    # Fields that were None and got a value derived from the others (recomputed by replace()).
    _derived: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._derived = tuple(n for n in ("sink_tokens", "window_tokens", "pool_tokens") if getattr(self, n) is None)
        self.validate()

    def validate(self) -> None:
        """Fill the ``None`` defaults and raise ``ValueError`` with what to change if a setting is invalid."""
        if isinstance(self.host_chunk_mib, bool) or not isinstance(self.host_chunk_mib, (int, float)) or not self.host_chunk_mib > 0:
            raise ValueError(f"host_chunk_mib must be a positive number, got {self.host_chunk_mib!r}.")
        for name in ("budget_tokens", "block_tokens", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        block = self.block_tokens
        if block & (block - 1):
            raise ValueError(
                f"block_tokens must be a positive power of two (e.g. 16 or 32), got {block}: blocks are the unit of "
                "selection and transfer, and power-of-two blocks keep host chunks and kernels aligned."
            )
        if self.sink_tokens is None:
            self.sink_tokens = min(64, _round_to_block(self.budget_tokens // 32, block))
        if self.window_tokens is None:
            self.window_tokens = min(256, _round_to_block(self.budget_tokens // 8, block))
        for name in ("sink_tokens", "window_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % block:
                raise ValueError(
                    f"{name} must be a non-negative multiple of block_tokens={block}, got {value!r}; "
                    f"try {_round_to_block(max(int(value or 0), 0), block)}."
                )
        # The open block (up to block_tokens - 1 tokens) is always attended besides sink and window.
        needed = self.sink_tokens + self.window_tokens + block
        if self.budget_tokens < needed:
            raise ValueError(
                f"budget_tokens={self.budget_tokens} is smaller than sink_tokens + window_tokens + block_tokens = "
                f"{self.sink_tokens} + {self.window_tokens} + {block} = {needed}. Raise budget_tokens to at least "
                f"{needed}, or lower sink_tokens / window_tokens."
            )
        if self.pool_tokens is None:
            if self.selector == "streaming":  # reads only the sink and the window (plus the block being sealed)
                self.pool_tokens = self.sink_tokens + self.window_tokens + 2 * block
            else:
                blocks = -(-self.budget_tokens * 5 // 4 // block)
                self.pool_tokens = blocks * block
        if isinstance(self.pool_tokens, bool) or not isinstance(self.pool_tokens, int) or self.pool_tokens < block:
            raise ValueError(f"pool_tokens must be an integer >= block_tokens={block}, got {self.pool_tokens!r}.")
        if self.pool_tokens % block:
            raise ValueError(f"pool_tokens must be a multiple of block_tokens={block}, got {self.pool_tokens}.")
        if self.host_memory_gib is not None and not self.host_memory_gib > 0:
            raise ValueError(f"host_memory_gib must be positive or None, got {self.host_memory_gib!r}.")
        if self.transfer not in ("auto", "kernel", "torch"):
            raise ValueError(f"transfer must be 'auto', 'kernel' or 'torch', got {self.transfer!r}.")
        cap = self.transfer_cap_blocks
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"transfer_cap_blocks must be a non-negative integer or None, got {cap!r}.")
        if not self.transfer_cap_margin >= 0:
            raise ValueError(f"transfer_cap_margin must be >= 0, got {self.transfer_cap_margin!r}.")
        every = self.reselect_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"reselect_every must be a positive integer (1: every decode step chooses its blocks; 2: every "
                f"second step, the others reuse that choice), got {every!r}."
            )
        if self.admission not in ("always", "auto"):
            raise ValueError(f"admission must be 'always' or 'auto', got {self.admission!r}.")
        if self.device_memory_gib is not None and not self.device_memory_gib >= 0:
            raise ValueError(f"device_memory_gib must be >= 0 or None, got {self.device_memory_gib!r}.")
        if self.lookahead is not None and not isinstance(self.lookahead, bool):
            raise ValueError(
                f"lookahead must be True, False or None (None: on where blocks move through the copy kernels on "
                f"CUDA), got {self.lookahead!r}."
            )
        if self.lookahead_query not in ("next", "same"):
            raise ValueError(
                f"lookahead_query must be 'next' (the next layer's query predicted from this layer's input) or 'same' "
                f"(this layer's query), got {self.lookahead_query!r}."
            )
        ahead = self.lookahead_blocks
        if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0):
            raise ValueError(
                f"lookahead_blocks must be a non-negative integer (blocks per sequence beyond sink and window) or "
                f"None (as many as the budget selects), got {ahead!r}."
            )
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(
                f"cuda_graphs must be True, False or None (None: on where it can run), got {self.cuda_graphs!r}."
            )
        if self.cuda_graphs and (self.timing or self.lookahead):
            raise ValueError(
                "cuda_graphs=True cannot be combined with timing=True or lookahead=True (both run per-phase host work "
                "inside the decode step); set cuda_graphs=None to use graphs only where neither is on."
            )
        if self.graph_scope not in ("layer", "attention"):
            raise ValueError(
                f"graph_scope must be 'layer' (the whole decoder layer) or 'attention' (the offloaded attention only), "
                f"got {self.graph_scope!r}."
            )
        capacity = self.decode_capacity_blocks
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0):
            raise ValueError(
                f"decode_capacity_blocks must be a positive integer (blocks a decode step's scored blocks are rounded "
                f"up to) or None (64 with CUDA graphs, else 1), got {capacity!r}."
            )
        for name in ("fused_norms", "fused_rotary", "fused_projections"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                where = "on CUDA" if name == "fused_projections" else "where Triton runs on CUDA"
                raise ValueError(f"{name} must be True, False or None (None: on {where}), got {value!r}.")
        if self.decode_attention not in ("auto", "paged", "pool"):
            raise ValueError(f"decode_attention must be 'auto', 'paged' or 'pool', got {self.decode_attention!r}.")
        if not isinstance(self.selector, str) and not hasattr(self.selector, "select"):
            raise TypeError(
                f"selector must be a selector name or a Selector instance, got {type(self.selector).__name__}."
            )

    @property
    def sink_blocks(self) -> int:
        """Sink size in blocks."""
        return self.sink_tokens // self.block_tokens

    @property
    def window_blocks(self) -> int:
        """Window size in blocks (sealed blocks only)."""
        return self.window_tokens // self.block_tokens

    @property
    def pool_blocks(self) -> int:
        """Device slot pool capacity in blocks, per sequence and layer."""
        return self.pool_tokens // self.block_tokens

    def replace(self, **changes) -> "OffloadConfig":
        """Return a validated copy with ``changes`` applied; sizes that were derived (sink, window, pool left at
        ``None``) are derived again from the new values."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        values.update({name: None for name in self._derived})
        values.update(changes)
        return OffloadConfig(**values)
