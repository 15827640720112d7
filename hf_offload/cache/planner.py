"""The decode planner of one offloaded layer: which sealed blocks a query attends to.

It owns the selection a layer's steps may reuse (``OffloadConfig.reselect_every``) and asks the selector for the
rest: sink and window forced, the budget's top blocks, the transfer cap, and the selector's estimate of the blocks
left out. It reads the block store (summaries, slot pool residency) and moves no bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import OffloadConfig
from ..selectors import Selection, Selector
from ..selectors.adaptive import keep_to_target
from ..selectors.base import missed_share, unselected_tokens
from ..selectors.transfer_cap import cap_transfers, resident_blocks
from .blocks import BlockStore
from ..attention.handoff import Handoff
from ..attention.inputs import DecodeInputs, forced_blocks
from .execution import LayerExecution, decode_capacity
from .stats import LayerStats


@dataclass
class KeptSelection:
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


class DecodePlanner:
    """Selection for one offloaded layer.

    Args:
        config: the cache's settings (budget, sink, window, transfer cap, reselect_every).
        selector: the selection policy.
        blocks: the layer's block store.
        execution: the layer's execution decisions (``capacity_blocks``).
        stats: the layer's counters.
    """

    def __init__(
        self, config: OffloadConfig, selector: Selector, blocks: BlockStore, execution: LayerExecution,
        stats: LayerStats,
    ):  # fmt: skip
        self.config = config
        self.selector = selector
        self.blocks = blocks
        self.execution = execution
        self.stats = stats
        self.kept: KeptSelection | None = None
        self._kept_buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # by shape, for the layer's life

    def reset(self) -> None:
        """Forget the kept selection and its buffers."""
        self.kept = None
        self._kept_buffers.clear()

    def decode_blocks(self, n: int, recent: int) -> int:
        """Sealed blocks one decode query selects among ``n`` with ``recent`` tokens in the open block (all ``n`` if
        the budget holds them). With an adaptive budget whose base does not hold them all: the cap's blocks, at most
        :meth:`decode_capacity`'s (entries past the sealed blocks are never kept), so that the number stays the same
        over the seals of one capacity; :meth:`keeps_at_least` of them are always attended."""
        config, block = self.config, self.blocks.block_tokens
        k = min(n, (config.budget_tokens - recent) // block)
        if k >= n or not config.adaptive:
            return k
        capacity = decode_capacity(n, 0, self.execution.capacity_blocks, self.execution.capacity_share)
        return min(capacity, (config.max_budget_tokens - recent) // block)

    def keeps_at_least(self, k: int) -> int:
        """Of ``k`` selected entries (:meth:`decode_blocks`), those the base budget attends whatever the estimate:
        ``k`` with a fixed budget, else the base budget's blocks beside the open block (``budget_tokens`` is whole
        blocks and the open block holds 1 to ``block_tokens`` tokens with the step's own: one block less)."""
        if not self.config.adaptive:
            return k
        return min(k, self.config.budget_tokens // self.blocks.block_tokens - 1)

    def leaves_out(self, n: int, k: int) -> bool:
        """Whether a decode step that scores ``n`` blocks and selects ``k`` may leave blocks out (fewer selected, or
        an adaptive budget that may keep fewer): where it may not, it attends every sealed block exactly."""
        return k < n or self.keeps_at_least(k) < k

    def decode_capacity(self, n: int, k: int) -> int:
        """Blocks a decode step with ``n`` sealed blocks, ``k`` of them selected, scores: ``n`` rounded up as
        :func:`~hf_offload.cache.execution.decode_capacity` does (the blocks past ``n`` are never valid), or ``n``
        when every block is attended."""
        execution = self.execution
        kept = 0 if self.keeps_at_least(k) < min(k, n) else k
        return decode_capacity(n, kept, execution.capacity_blocks, execution.capacity_share)

    def select_all(self, n_blocks: int) -> Selection:
        """Every sealed block below ``n_blocks``, for every sequence (exact attention)."""
        store = self.blocks
        blocks = torch.arange(n_blocks, device=store.device).expand(store.batch, 1, n_blocks)
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
        return self.plan(query, mask, scaling, handoff.n_blocks_before, recent, handoff.first_recent_pos + recent - 1)

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
            self.kept = None
            return False
        store = self.blocks
        key = (n_sealed, k, n, store.batch)
        kept = self.kept
        if kept is not None and kept.key == key and 0 < pos - kept.pos < every:
            return True
        # One pair of buffers per shape for the layer's life (until reset): every graph that reads or writes a
        # selection of that shape uses the same memory, whichever step allocated it.
        shape = (store.batch, store.kv_heads if self.selector.per_head else 1, k)
        buffers = self._kept_buffers.get(shape)
        if buffers is None:
            buffers = self._kept_buffers[shape] = (
                torch.zeros(shape, dtype=torch.int64, device=store.device),
                torch.zeros(shape, dtype=torch.bool, device=store.device),
            )
        self.kept = KeptSelection(pos, key, *buffers)
        return False

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
            inputs: this step's :class:`~hf_offload.cache.capture.DecodeInputs`.
            reuse: the step attends the kept selection (:meth:`reuses_selection` said so): nothing is scored. A step
                that chooses while a selection is kept (``reselect_every`` above 1) writes its choice into it.
        """
        kept = self.kept
        if reuse:
            return Selection(blocks=kept.blocks, keep=kept.keep)
        selection = self.plan(query, None, scaling, n, 0, 0, inputs=inputs, k=k)
        if kept is not None and kept.blocks.shape == selection.blocks.shape and self.config.reselect_every > 1:
            kept.blocks.copy_(selection.blocks)
            kept.keep.copy_(selection.keep)
        return selection

    def plan(
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
        store = self.blocks
        if k is None:
            k = self.decode_blocks(n, recent)
        k = min(k, n)  # an adaptive cap's entries past n are for the decode step's capacity, not n sealed blocks
        base = self.keeps_at_least(k)
        if inputs is not None:
            valid = inputs.valid
        elif mask is None:
            valid = torch.ones((store.batch, n), dtype=torch.bool, device=store.device)
        else:
            valid = mask.block_valid(q_pos, n, store.block_tokens, store.device)
        if base >= n:
            selection = self.select_all(n)
            selection.keep = valid[:, None, :]
            return selection
        sink, window = self.config.sink_blocks, self.config.window_blocks

        # Every layer of one forward with the same geometry forces the same blocks: built once per forward.
        key = ("forced", q_pos, n, store.block_tokens, sink, window, store.device)
        if inputs is not None:
            forced = inputs.forced
        elif mask is None:
            forced = forced_blocks(valid, sink, window)
        else:
            forced = mask.memo(key, lambda: forced_blocks(valid, sink, window))
        selection = self.selector.select(query, store.summary_views(n), scaling, k, forced, valid)
        if base < k:  # the adaptive budget: the base budget's blocks, and more while the estimate asks for them
            heads = query.shape[1] * query.shape[2]
            selection = keep_to_target(selection, base, self.config.missed_mass_target, heads)
        cap = self.config.transfer_cap_blocks
        if cap is not None and selection.scores is not None:
            resident = resident_blocks(store.pool.block, selection.blocks.shape[1], n)
            selection = cap_transfers(selection, resident, cap, self.config.transfer_cap_margin)
        bound = self.config.disk_cap_blocks
        if bound is not None and selection.scores is not None and store.host.disk is not None:
            # Blocks read without the disk: those in the slot pool, in host (or device) memory, or staged.
            near = resident_blocks(store.pool.block, selection.blocks.shape[1], n) | ~self.on_disk(n)[:, None, :]
            capped = cap_transfers(selection, near, bound, None, drop=True)
            m = min(self.config.disk_stage_left_out, selection.blocks.shape[-1])
            if m:  # the best blocks the bound took out: the recall stages them for the coming steps
                before = torch.zeros_like(near).scatter_(-1, selection.blocks, selection.keep)
                out = before & ~torch.zeros_like(near).scatter_(-1, capped.blocks, capped.keep)
                top = selection.scores.masked_fill(~out, float("-inf")).topk(m, dim=-1)
                capped.left_out = torch.where(out.gather(-1, top.indices), top.indices, -1)
            selection = capped
        return selection

    def on_disk(self, n: int) -> torch.Tensor:
        """Which of the first ``n`` blocks of each sequence lie in chunks spilled to disk and are not staged,
        ``[batch, n]``, ``torch.bool``, compute device (from the device block table and the pool's chunk and staging
        tables: no host synchronisation, capturable; blocks past the sealed ones: ``False``)."""
        store = self.blocks
        table = store.block_table_dev
        if table is None:
            table = store.block_table.to(store.device)
        if table.shape[1] < n:
            table = torch.nn.functional.pad(table, (0, n - table.shape[1]), value=-1)
        table = table[:, :n]
        flags = store.host.chunk_on_disk(store.device)
        chunk = torch.where(table >= 0, table // store.host.chunk_blocks, flags.shape[0] - 1)
        config = self.config
        if not (config.disk_stage_left_out or config.disk_stage_near or config.lookahead):
            return flags[chunk]  # nothing is staged ahead: no table of staged blocks to read
        staged = store.host.block_staged(store.device)
        return flags[chunk] & ~staged[torch.where(table >= 0, table, staged.shape[0] - 1)]

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
        views = self.blocks.summary_views(n)
        return self.selector.tail_attention(query, views, scaling, tail, softcap, selection=selection)

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
        return self.selector.tail_attention_merged(query, self.blocks.summary_views(n), scaling, tokens_ok, out, lse,
                                                   selection=selection, out_dtype=out_dtype)  # fmt: skip

    def count_step(
        self,
        selection: Selection,
        query_heads: int,
        exact: bool,
        tail_lse: torch.Tensor | None = None,
        selection_lse: torch.Tensor | None = None,
    ) -> None:
        """Count one decode step's attended blocks and its estimated share of attention outside the selection (the
        accuracy certificate, ``stats()["missed_mass"]``), on the device, no host synchronisation, capturable.

        The share is, by what the step has: with the selector's estimate of the unselected blocks (``tail_lse``)
        that estimate's share of the whole softmax (open block included); else, for a selector whose scores are
        block masses (``Selector.mass_scores``), their share left out (:func:`missed_share`; the open block not
        counted); ``0`` for a step that attends every sealed block (``exact``); nothing otherwise (a reused
        selection, or a selector without such scores).

        Args:
            selection: the step's selection (``blocks`` / ``keep`` ``[batch, 1 or kv_heads, k]``).
            query_heads: query heads of the layer.
            exact: the step attended every sealed block.
            tail_lse: log-sum-exp of the estimate, ``[batch, kv_heads, group]``, float32, or ``None``.
            selection_lse: log-sum-exp of the exact attention over the selection, same shape as ``tail_lse``.
        """
        if tail_lse is not None:  # per sequence: the mean over its query heads (LayerStats.record_step)
            self.stats.record_step(selection.keep, None, "tail", tail_lse=tail_lse, selection_lse=selection_lse)
            return
        if exact:
            missed, source = None, "exact"
        elif self.selector.mass_scores and not self.selector.per_head and selection.scores is not None:
            missed, source = missed_share(selection, query_heads).to(torch.float64), "scores"
        else:
            missed, source = None, None
        self.stats.record_step(selection.keep, missed, source)
