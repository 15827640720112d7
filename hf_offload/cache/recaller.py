"""The recaller of one offloaded layer: slot rounds, recalls of missed blocks, prefetch and lookahead.

It owns what is in flight between the host pool and the device slot pool: the event of the pending speculative
recall (prefetch), the slots it filled, and the index tensors its launches reuse. Stream order: every recall waits
for the host writes of the blocks it may read (the block store's write events) and for the layer's pending
prefetch; a prefetch runs on the prefetch stream behind everything issued so far on the compute stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..attention.handoff import OffloadMask
from ..config import OffloadConfig
from ..kernels import recall as recall_kernels
from .lookahead import speculative_query
from ..selectors import Selection, Selector
from ..store import transfer, writes
from .blocks import BlockStore
from .capture import between_graphs
from .execution import LayerExecution, hidden_states
from .planner import DecodePlanner
from .stats import LayerStats, count_recall


FUSED_RECALL = True
"""Whether a decode step's recall of a shared selection on the kernel path runs as one launch that also counts
(:meth:`Recaller._recall_entries`); ``False``: the index tensors, the copy launch and the counters as separate
operations (the path of prefill rounds, per-head selections and the disk tier)."""


class Recaller:
    """Makes a layer's selected blocks resident in its slot pool.

    Args:
        config: the cache's settings (``lookahead_query``, ``lookahead_blocks``).
        selector: the selection policy (``per_head``: head pieces move instead of whole blocks).
        blocks: the layer's block store (host pool, slot pool, block tables, write events).
        planner: the layer's planner (a prefetch plans the coming step speculatively).
        execution: the layer's execution decisions (kernel path, paged attention, streams, lookahead).
        stats: the layer's counters.

    Attributes:
        next: the next offloaded layer's recaller (the target of lookahead), or ``None``.
        next_decoder: the next offloaded layer's decoder layer module where it is the adjacent one (the source of
            the predicted query of ``lookahead_query="next"``), or ``None``.
        prefetched_ahead: this step's lookahead ran before the layer (``lookahead_query="next"``).
        timer: the cache's phase timer when timing is on, else ``None``.
    """

    def __init__(
        self, config: OffloadConfig, selector: Selector, blocks: BlockStore, planner: DecodePlanner,
        execution: LayerExecution, stats: LayerStats,
    ):  # fmt: skip
        self.config = config
        self.selector = selector
        self.blocks = blocks
        self.planner = planner
        self.execution = execution
        self.stats = stats
        self.next: Recaller | None = None
        self.next_decoder: torch.nn.Module | None = None
        self.prefetched_ahead = False
        self.timer = None
        self._memo: dict[tuple, object] = {}
        self.clear()

    def clear(self) -> None:
        """Forget the pending prefetch and the index tensors (the pools they refer to are gone)."""
        self._prefetch_event = None  # after the speculative recall into this layer's slot pool
        # [batch, kv_heads, slots] int32, nonzero where this step's prefetch filled a slot; a fixed buffer, so that
        # a graph of the previous layer writes it and this layer's own graph reads and clears it.
        self._prefetch_marks: torch.Tensor | None = None
        self._memo = {}

    def recycle(self) -> None:
        """Forget the pending prefetch but keep the buffers graphs read (the prefetch marks, zeroed) and the index
        tensors (the block store keeps its shapes): :meth:`BlockStore.recycle`."""
        self._prefetch_event = None
        if self._prefetch_marks is not None:
            writes.zero_(self._prefetch_marks)

    # ------------------------------------------------------------------------------------------------- stream order
    def wait_prefetch(self) -> None:
        """Make the compute stream wait for this layer's pending speculative recall, if any."""
        if self._prefetch_event is not None:
            transfer.wait_event(self._prefetch_event, self.blocks.device)
            self._prefetch_event = None

    def wait_side_streams(self) -> None:
        """Make the compute stream wait for the side-stream work a decode step depends on (a pending prefetch, the
        host writes of the blocks this forward may read) and forget those events. A replay or a capture does this
        outside the graph: a graph cannot wait on work recorded outside it."""
        # Stream order, as in resident_rounds: the recall in the graph reads host blocks the offload stream wrote.
        self.wait_prefetch()
        transfer.wait_event(self.blocks.selectable_written, self.blocks.device)
        self.blocks.selectable_written = None

    # ------------------------------------------------------------------------------------------------------- rounds
    def resident_rounds(
        self, selection: Selection, decode: bool, count_step: bool = True, gather: bool = True, in_place: bool = False,
        stage: Selection | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Make the selected blocks resident, at most a pool's worth at a time, recalling misses from the host.
        With ``stage`` (a decode step's plan, chunks on disk) the blocks ranked just below it start moving from
        disk with the first round's recall (:meth:`stage_near`).

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
        store, pool = self.blocks, self.blocks.pool
        total = selection.blocks.shape[-1]
        per_round = pool.slots
        prefetched = self._prefetch_marks
        if prefetched is not None and prefetched.shape != pool.block.shape:
            prefetched = None
        if decode and count_step:
            self.stats.add(("decode_steps",), 1)
        shared, heads = not self.selector.per_head, store.kv_heads
        if in_place and decode and total <= per_round and store.host.all_admitted:
            # Every block lies in device memory: nothing to assign or recall (the assignment, its arguments and an
            # empty copy launch would cost more than the step's attention).
            keep = selection.keep
            self.stats.count_later(("lookups", "hits"), keep, heads // keep.shape[1])
            self.wait_side_streams()  # blocks sealed on a side stream reach their chunks first
            yield selection.blocks, keep, self._zero_slots(total), None, None
            return
        # A decode step's single round of a shared selection on the kernel path recalls and counts in one launch.
        counts = self._entry_counts() if decode and total <= per_round and stage is None else None
        for start in range(0, total, per_round):
            if total <= per_round:
                blocks, keep = selection.blocks, selection.keep
            else:
                blocks = selection.blocks[..., start : start + per_round]
                keep = selection.keep[..., start : start + per_round]
            slots, miss = pool.assign(blocks, self.pool_keep(blocks, keep) if in_place else keep)
            if decode:
                if counts is None:  # device-side counts, summed when stats() reads them
                    self.stats.count_later(("lookups", "hits"), keep, heads // keep.shape[1])
                if prefetched is not None and start == 0:
                    used = keep.expand_as(miss) & ~miss & (prefetched.gather(-1, slots) > 0)
                    prefetched.zero_()  # counted once: the next step's prefetch marks anew
                    used = used if self.selector.per_head else used[:, :1]
                    self.stats.count_later(("prefetch_used_blocks",), used)
            if start == 0:
                # Stream order: the recall below may overwrite slots a prefetch was filling, and the gather reads
                # them; both must come after the prefetch. Recalled blocks must have reached the host.
                self.wait_side_streams()
            if counts is not None:
                self._recall_entries(blocks, keep, slots, miss, counts)
            else:
                count, unit, host_count = self.recall(blocks, slots, miss, stage=stage if start == 0 else None)
                count_recall(self.stats, count, unit, decode=decode, host_count=host_count)
                if decode:
                    # A shared selection keeps all heads of a slot on the same block: one recalled block is a miss
                    # of every head.
                    self.stats.add_later(("hits",), count, -heads if shared else -1)
            keys, values = pool.gather(slots) if gather else (None, None)
            yield blocks, keep, slots, keys, values

    def pool_keep(self, blocks: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``keep`` limited to the blocks in host memory (those the paged decode attention reads from slots).

        Args:
            blocks: block indices, ``[batch, 1 or kv_heads, n]``, ``torch.int64``, compute device (below the device
                block table's capacity).
            keep: which entries are wanted, same shape, ``torch.bool``.
        """
        host = self.blocks.host
        if not host.admitted_chunks:
            return keep
        _, on_host = host.chunk_tables(self.blocks.device)
        # Entries past the sealed blocks (a step's capacity) are never kept: any column serves them.
        if self.execution.use_kernels:
            return recall_kernels.pool_keep(blocks, keep, self.blocks.block_table_dev, on_host, host.chunk_blocks)
        return recall_kernels.pool_keep_reference(blocks, keep, self.blocks.block_table_dev, on_host,
                                                  host.chunk_blocks)  # fmt: skip

    def _entry_counts(self) -> torch.Tensor | None:
        """The counter a decode step's :meth:`_recall_entries` adds into (kept entries, recalled blocks, recalled
        blocks read from host memory, :data:`~hf_offload.kernels.recall.COUNTS`), or ``None`` where that launch does
        not serve the step: not the kernel path or no Triton on the device, a selection per head, a disk tier (the
        host reads blocks on disk between plan and copy), :data:`FUSED_RECALL` off, or a capture that finds no counter
        made before it."""
        store = self.blocks
        if not (FUSED_RECALL and self.execution.use_kernels) or self.selector.per_head or store.host.disk is not None:
            return None
        if not recall_kernels.supported(store.device):
            return None
        heads, unit = store.kv_heads, store.host.block_bytes
        meanings = (
            ((("lookups", "hits"), heads),),
            ((("recalled_blocks", "decode_recalled_blocks"), 1), (("recalled_bytes", "decode_recalled_bytes"), unit),
             (("hits",), -heads)),  # a shared selection: one recalled block is a miss of every head
            ((("decode_host_bytes",), unit),),
        )  # fmt: skip
        return self.stats.kernel_counts(store.device, meanings)

    def _recall_entries(self, blocks: torch.Tensor, keep: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor,
                        counts: torch.Tensor) -> None:  # fmt: skip
        """A decode step's recall of a shared selection and its counts, in one launch on the compute stream
        (:func:`~hf_offload.kernels.recall.recall_entries`); arguments as :meth:`recall`'s, ``keep`` the
        selection's kept entries and ``counts`` :meth:`_entry_counts`'."""
        store = self.blocks
        host = store.host
        addrs, on_host = host.chunk_tables(store.device)
        recall_kernels.recall_entries(blocks, keep, miss, slots, store.block_table_dev, addrs, on_host,
                                      host.chunk_blocks, host.block_words, store.pool.data, counts,
                                      **transfer.RECALL_LAUNCH)  # fmt: skip

    # ------------------------------------------------------------------------------------------------------- recall
    def recall(self, blocks: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor, stream=None,
               stage: Selection | None = None, guess: bool = False):
        """Fill missed slots from the host pool (whole blocks for shared selections, head pieces otherwise).

        Args:
            blocks: block indices, ``[batch, 1 or kv_heads, n]``, ``torch.int64``, compute device.
            slots: slot per entry, ``[batch, kv_heads, n]``, ``torch.int64``, compute device.
            miss: entries to recall, ``[batch, kv_heads, n]``, ``torch.bool``, compute device.
            stream: kernel path on CUDA only: a side stream to run the copy on (its event becomes the pending
                prefetch); ``None``: the current stream.
            stage: a decode step's plan whose next-ranked blocks start moving from disk (:meth:`stage_near`).
            guess: a speculative plan's misses, without those on disk (:meth:`_stage_spilled` left them to staging).

        Returns:
            ``(count, unit, host_count)``: pieces moved (a 0-d device tensor on the kernel path, an int otherwise),
            the bytes of one piece, and how many of the pieces were read from host memory (``None``: all; the rest
            came from blocks admitted to the device).
        """
        if self.execution.use_kernels:
            return self._recall_kernel(blocks, slots, miss, stream, stage, guess)
        moved = self._recall_torch(blocks, slots, miss)
        if stage is not None:
            self.stage_near(stage)  # the reads queue behind the recall's own
            self.blocks.host.sync_staged()  # what the next steps' plans may take from staging
        return moved

    def _recall_torch(self, blocks: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor):
        """Torch path of :meth:`recall` (no side stream)."""
        store = self.blocks
        if self.selector.per_head:
            b, h, j = miss.nonzero(as_tuple=True)
            block = blocks.expand_as(miss)[b, h, j]
            ids = store.block_table[b.cpu(), block.cpu()]
            transfer.recall_blocks(store.host, store.pool, ids, b, slots[b, h, j], head_idx=h)
            return len(ids), store.host.block_bytes // store.kv_heads, store.host.count_on_host(ids)
        # A shared selection keeps all heads of a slot on the same block: the misses of head 0 are all misses.
        b, j = miss[:, 0].nonzero(as_tuple=True)
        block = blocks[:, 0][b, j]
        ids = store.block_table[b.cpu(), block.cpu()]
        transfer.recall_blocks(store.host, store.pool, ids, b, slots[:, 0][b, j])
        return len(ids), store.host.block_bytes, store.host.count_on_host(ids)

    def _recall_kernel(self, blocks: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor, stream=None,
                       stage: Selection | None = None, guess: bool = False):
        """Kernel path of :meth:`recall`: one launch over every candidate entry; no host synchronisation, except
        with a disk tier: there the host reads the entries' ids before the launch, recalls those on disk itself and
        leaves the rest to the launch (in a captured graph: host work between two graphs, :func:`between_graphs`).

        The launch arguments are computed on the compute stream; only the copy runs on ``stream``.
        """
        store = self.blocks
        host, table_dev = store.host, store.block_table_dev
        batch, heads, n = miss.shape
        if self.selector.per_head:
            table = table_dev[:, None, :].expand(batch, heads, -1)
            ids = torch.where(miss, table.gather(-1, blocks.expand(batch, heads, n)), -1).view(-1)
            batch_idx, head_idx = self._entry_indices(n, per_head=True)
            slot_idx = slots.view(-1)
            count, unit = miss.sum(), host.block_bytes // heads
        else:
            missed = miss[:, :1]  # a shared selection: every head of a slot holds the same block
            ids = torch.where(missed, table_dev[:, None, :].gather(-1, blocks), -1).view(-1)
            batch_idx, head_idx = self._entry_indices(n, per_head=False)
            slot_idx = slots[:, :1].reshape(-1)
            count, unit = missed.sum(), host.block_bytes
        offsets = None if head_idx is not None else self._block_offsets(n)
        if host.disk is not None and not guess:
            between_graphs(self._disk_work(ids, batch_idx, slot_idx, head_idx, stage))
        addrs = host.chunk_addrs(store.device)  # refreshed on the compute stream, before any side stream
        uses = (ids, batch_idx, slot_idx, addrs) + (() if head_idx is None else (head_idx,)) + (offsets or ())
        event = transfer.launch_on(
            stream,
            lambda: transfer.recall_blocks_kernel(host, store.pool, ids, batch_idx, slot_idx, head_idx, offsets),
            uses=uses,
            # In a capture the caller waits before the replay (a graph cannot wait on an event recorded outside it).
            wait_for=(store.last_write,) if stream is not None and not torch.cuda.is_current_stream_capturing() else (),
        )
        if stream is not None:
            self._prefetch_event = event
        return count, unit, host.count_on_host(ids)

    def _disk_work(self, ids: torch.Tensor, batch_idx: torch.Tensor, slot_idx: torch.Tensor,
                   head_idx: torch.Tensor | None, stage: Selection | None):
        """The host's part of a recall on the kernel path with a disk tier, as a function of no arguments (run
        between the graphs of a captured step, or at once op by op): recall the entries on disk
        (:meth:`_recall_spilled`), start staging the blocks ``stage`` left out or ranked below it
        (:meth:`stage_near`) and bring the pool's table of staged blocks up to date (``HostBlockPool.sync_staged``,
        once per decode step). Without chunks on disk it does nothing (no synchronisation)."""

        def work() -> None:
            if not self.blocks.host.disk_chunks:
                return
            left = None if stage is None or stage.left_out is None else self._table_ids(stage.left_out)
            ids_cpu = (ids if left is None else torch.cat([ids, left])).cpu()  # one transfer for both
            self._recall_spilled(ids, batch_idx, slot_idx, head_idx, ids_cpu[: len(ids)])
            if stage is not None:
                self.stage_near(stage, None if left is None else ids_cpu[len(ids) :])
                self.blocks.host.sync_staged()  # what the next steps' plans may take from staging

        return work

    def _recall_spilled(self, ids: torch.Tensor, batch_idx: torch.Tensor, slot_idx: torch.Tensor,
                        head_idx: torch.Tensor | None, ids_cpu: torch.Tensor | None = None) -> None:
        """Kernel path with chunks on disk: recall the entries whose blocks are on disk through the disk tier
        (read into staging on its worker threads, copied to their slots on the compute stream) and set those
        entries of ``ids`` to ``-1`` in place for the copy kernel. The host reads the ids: one synchronisation per
        call.

        Args:
            ids: host block id per entry or ``-1``, ``[n]``, ``torch.int64``, compute device.
            batch_idx, slot_idx: destination sequence and slot per entry, ``[n]``, ``torch.int64``, compute device.
            head_idx: the KV head per entry, or ``None`` (whole blocks).
            ids_cpu: ``ids`` already on the host, if read.
        """
        host = self.blocks.host
        ids_cpu = ids.cpu() if ids_cpu is None else ids_cpu
        wanted = ids_cpu >= 0
        host.touch(ids_cpu[wanted])
        spilled = wanted & host.on_disk(ids_cpu.clamp(min=0))
        if not bool(spilled.any()):
            return
        rows = spilled.nonzero().flatten()
        dev = rows.to(ids.device)
        head = None if head_idx is None else head_idx[dev]
        transfer.recall_blocks(host, self.blocks.pool, ids_cpu[rows], batch_idx[dev], slot_idx[dev], head_idx=head)
        ids.index_fill_(0, dev, -1)

    def _stage_spilled(self, blocks: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor) -> None:
        """A speculative plan's misses whose blocks are on disk: start reading them into the disk tier's staging
        (worker threads, no wait), give their slots back (empty, so the exact plan recalls them, from staging) and
        take them out of ``miss`` in place. Host work (:func:`between_graphs`): one synchronisation.

        Args:
            blocks: block indices, ``[batch, 1 or kv_heads, n]``, ``torch.int64``, compute device.
            slots: slot per entry, ``[batch, kv_heads, n]``, ``torch.int64``, compute device.
            miss: entries to recall, ``[batch, kv_heads, n]``, ``torch.bool``, compute device.
        """
        store = self.blocks
        host = store.host
        if not host.disk_chunks or not store.block_table.shape[1]:
            return
        ids = self._host_ids(torch.where(miss, blocks.expand(miss.shape), -1))
        spilled = (ids >= 0) & host.on_disk(ids.clamp(min=0).flatten()).view(ids.shape)
        if not bool(spilled.any()):
            return
        host.stage(torch.unique(ids[spilled]))
        on_disk = spilled.to(miss.device)
        held = store.pool.block.gather(-1, slots)
        store.pool.block.scatter_(-1, slots, torch.where(on_disk, torch.full_like(held, -1), held))
        miss.logical_and_(~on_disk)

    def stage_near(self, selection: Selection, left_out_ids: torch.Tensor | None = None) -> None:
        """With chunks on disk: start reading from disk, into the disk tier's staging and without waiting, the
        blocks ``disk_cap_blocks`` left out of this step's selection (``selection.left_out``) and the
        ``disk_stage_near`` blocks per sequence (and KV head) ranked just below it, so that a coming step that
        selects them finds them staged. Call it with the step's recall, after its reads from disk (the reads queue
        behind the recall's own). Synchronises with the host (in a captured step: host work between two graphs).

        Args:
            selection: this step's plan: its ``ranked`` blocks past the selection where the selector ranked them,
                else the best-scored blocks outside the selection.
            left_out_ids: the host ids of ``selection.left_out`` (CPU, any shape, ``-1``: none), if already read.
        """
        m = self.config.disk_stage_near
        store = self.blocks
        if not store.host.disk_chunks or selection.scores is None or not store.block_table.shape[1]:
            return
        if selection.left_out is not None:
            left = self._host_ids(selection.left_out) if left_out_ids is None else left_out_ids
            store.host.stage(torch.unique(left))
        if not m:
            return
        k = selection.blocks.shape[-1]
        scores = selection.scores
        if selection.ranked is not None and selection.ranked.shape[-1] > k:
            near = selection.ranked[..., k : k + m]
        else:
            take = min(scores.shape[-1], k + m)
            if take <= k:
                return
            near = scores.topk(take, dim=-1).indices[..., k:]
        valid = scores.gather(-1, near).isfinite()  # forced blocks are selected; -inf ones are never attended
        store.host.stage(torch.unique(self._host_ids(torch.where(valid, near, -1))))

    def _table_ids(self, blocks: torch.Tensor) -> torch.Tensor:
        """The host block ids of block indices ``blocks`` (``[batch, heads_or_1, n]``, ``torch.int64``, ``-1``:
        none) through the device block table, flattened, ``-1`` where ``blocks`` is; compute device, no transfer."""
        table = self.blocks.block_table_dev
        index = blocks.clamp(0, table.shape[1] - 1).reshape(blocks.shape[0], -1)
        return torch.where(index == blocks.reshape(blocks.shape[0], -1), table.gather(1, index), -1).flatten()

    def _host_ids(self, blocks: torch.Tensor) -> torch.Tensor:
        """The host block ids of block indices ``blocks`` (``[batch, heads_or_1, n]``, ``torch.int64``, ``-1``:
        none), through the block table: same shape, CPU, ``-1`` where ``blocks`` is. One transfer to the host."""
        blocks = blocks.cpu()
        table = self.blocks.block_table
        index = blocks.clamp(0, table.shape[1] - 1).reshape(blocks.shape[0], -1)
        return torch.where(blocks >= 0, table.gather(1, index).view(blocks.shape), -1)

    def _block_offsets(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~hf_offload.store.transfer.block_piece_offsets` of the ``n`` whole-block entries per sequence of
        :meth:`_entry_indices`, built once per ``n`` (kept as long as the slot pool, like the indices)."""
        key = (n, "offsets")
        if key not in self._memo:
            batch_idx, _ = self._entry_indices(n, per_head=False)
            self._memo[key] = transfer.block_piece_offsets(self.blocks.host, self.blocks.pool, batch_idx)
        return self._memo[key]

    def _zero_slots(self, n: int) -> torch.Tensor:
        """Slot 0 for each of ``n`` entries per sequence and KV head, ``[batch, kv_heads, n]``, ``torch.int64``,
        compute device: what a step that takes no slots hands the paged attention (built once per ``n``)."""
        key = (n, "zero_slots")
        if key not in self._memo:
            store = self.blocks
            self._memo[key] = torch.zeros((store.batch, store.kv_heads, n), dtype=torch.long, device=store.device)
        return self._memo[key]

    def _entry_indices(self, n: int, per_head: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sequence (and, per head, KV head) of each of ``n`` entries per row, flattened like ``[batch, kv_heads or
        1, n]``: ``int64`` tensors on the compute device, built once per ``n``."""
        key = (n, per_head)
        if key not in self._memo:
            store = self.blocks
            heads = store.kv_heads if per_head else 1
            shape = (store.batch, heads, n)
            b = torch.arange(store.batch, device=store.device)[:, None, None].expand(shape).reshape(-1)
            h = torch.arange(heads, device=store.device)[None, :, None].expand(shape).reshape(-1) if per_head else None
            self._memo[key] = (b, h)
        return self._memo[key]

    # ---------------------------------------------------------------------------------------------------- lookahead
    def lookahead_from_input(self, args: tuple, kwargs: dict) -> bool:
        """Before this layer's decode step (``lookahead_query="next"``): plan :attr:`next`'s layer with its own query
        predicted from this layer's input (:func:`~hf_offload.cache.lookahead.speculative_query`) and start recalling its
        misses (:meth:`prefetch`). Returns whether it did; where it cannot (not a one-token decode step, lookahead
        off, no adjacent next decoder layer of the supported form), the step plans with its own query after its
        plan as before."""
        nxt, module = self.next, self.next_decoder
        if not self.execution.lookahead or self.config.lookahead_query != "next" or module is None or nxt is None:
            return False
        store, other = self.blocks, nxt.blocks
        if not (store.is_initialized and other.is_initialized and other.n_blocks and other.device == store.device):
            return False
        hidden = hidden_states(args, kwargs)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[:2] != (store.batch, 1):
            return False
        mask = kwargs.get("attention_mask")
        if mask is not None and not isinstance(mask, OffloadMask):
            return False
        timer = self.timer
        start = timer.mark() if timer is not None else None
        predicted = self.predicted_query(args, kwargs)
        if predicted is None:
            return False
        query, scaling = predicted
        nxt.prefetch(query, mask, scaling)
        if timer is not None:
            timer.add("prefetch", start, timer.mark())
        return True

    def predicted_query(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, float] | None:
        """The next layer's decode query predicted from this layer's call (``lookahead_query="next"``:
        :func:`~hf_offload.cache.lookahead.speculative_query`), grouped ``[batch, kv_heads, group, head_dim]``, and its
        softmax scale; ``None`` where it cannot be predicted (another query mode, no adjacent next decoder layer of
        the supported form, another geometry)."""
        nxt, module = self.next, self.next_decoder
        if self.config.lookahead_query != "next" or module is None or nxt is None:
            return None
        hidden = hidden_states(args, kwargs)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            return None
        query = speculative_query(module, hidden, kwargs.get("position_embeddings"))
        scaling = getattr(getattr(module, "self_attn", None), "scaling", None)
        other = nxt.blocks
        if query is None or scaling is None or query.shape[1] % other.kv_heads or query.shape[-1] != other.head_dim:
            return None
        batch, q_heads, _, head_dim = query.shape
        return query.view(batch, other.kv_heads, q_heads // other.kv_heads, head_dim), scaling

    def lookahead_next(self, query: torch.Tensor, mask, scaling: float) -> None:
        """After this layer's decode plan: speculatively plan :attr:`next`'s layer with this layer's query and start
        recalling its misses (see :meth:`prefetch`). A no-op unless lookahead is on and the next layer has the same
        geometry on the same device.

        Args:
            query: this layer's decode query, ``[batch, kv_heads, group, head_dim]``, compute device.
            mask: the forward's :class:`~hf_offload.attention.OffloadMask`, or ``None``.
            scaling: softmax scale.
        """
        nxt = self.next
        if not self.execution.lookahead or nxt is None or not nxt.blocks.is_initialized:
            return
        other = nxt.blocks
        if other.device != self.blocks.device or (other.batch, other.kv_heads, other.head_dim) != (
            query.shape[0], query.shape[1], query.shape[-1]
        ):
            return
        nxt.prefetch(query, mask, scaling)

    def prefetch(self, query: torch.Tensor, mask, scaling: float) -> None:
        """Speculative plan of this layer's coming decode step from an earlier layer's query; recalls its misses.

        Runs before this layer's ``update`` of the step. The plan is the planner's over the blocks sealed so far,
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
        store = self.blocks
        n = store.n_blocks
        if n == 0:
            return
        selection = self.planner.plan(query, mask, scaling, n, store.keys.shape[-2] + 1, store.n_tokens)
        if selection.blocks.shape[-1] > store.pool.slots:
            return  # the exact plan runs in rounds that cycle the whole pool: nothing would stay resident
        streams = self.execution.streams
        self._recall_guess(selection, streams.prefetch if streams else None)

    def _recall_guess(self, selection: Selection, stream) -> None:
        """Recall a speculative plan's misses: its blocks bounded by ``lookahead_blocks``, slots that do not refresh
        LRU clocks, the copy on ``stream`` (``None``: the current stream), counted as prefetched and marked."""
        store = self.blocks
        keep = self._bounded(selection)
        if self.execution.paged:  # blocks of admitted chunks are read in place: nothing to prefetch for them
            keep = self.pool_keep(selection.blocks, keep)
        slots, miss = store.pool.assign(selection.blocks, keep, touch=False)
        if store.host.disk is not None:  # blocks on disk are staged ahead of the exact plan, not recalled here
            between_graphs(lambda: self._stage_spilled(selection.blocks, slots, miss))
        count, unit, host_count = self.recall(selection.blocks, slots, miss, stream, guess=True)
        count_recall(self.stats, count, unit, decode=True, prefetch=True, host_count=host_count)
        self._mark_prefetched(slots, miss)

    # ----------------------------------------------------------------------------- lookahead inside a layer's graph
    def ahead_in_graph(self, n_before: int, n: int, k: int) -> Recaller | None:
        """The next offloaded layer's recaller where this layer's whole-layer graph can prefetch for it: lookahead
        on, the next layer on the same device with the same batch and KV geometry, the same sealed blocks
        (``n_before``), and the same blocks scored (``n``) and selected (``k``) at this step, so that this step's
        shared decode inputs describe its step too; else ``None``."""
        nxt = self.next
        if not self.execution.lookahead or nxt is None:
            return None
        store, other = self.blocks, nxt.blocks
        if not other.is_initialized or other.device != store.device or other.n_blocks != n_before:
            return None
        if (other.batch, other.kv_heads, other.head_dim, other.block_tokens) != (
            store.batch, store.kv_heads, store.head_dim, store.block_tokens
        ):
            return None
        recent = other.keys.shape[-2] + 1
        k_next = nxt.planner.decode_blocks(n_before, recent)
        if (k_next, nxt.planner.decode_capacity(n_before, k_next)) != (k, n):
            return None  # another geometry
        if min(k, n) > other.pool.slots:
            return None  # the exact plan runs in rounds that cycle the whole pool: nothing would stay resident
        return nxt

    def prefetch_in_graph(self, query: torch.Tensor, scaling: float, inputs, n: int, k: int) -> None:
        """:meth:`prefetch` in a form a CUDA graph of the previous layer captures: the plan scores the step's
        capacity ``n`` with the step's shared ``inputs`` (valid and forced blocks) and selects ``k``, as this
        layer's own step will. With side streams the plan, the slot assignment and the copy all run on the prefetch
        stream, forked from the capturing stream (so the speculative scoring too runs beside the previous layer's
        work), and :meth:`wait_prefetch` joins it before the capture ends; with a disk tier they run on the current
        stream. Never changes what is attended.

        Args:
            query: ``[batch, kv_heads, group, head_dim]``, compute device (predicted or an earlier layer's query).
            scaling: softmax scale.
            inputs: the step's :class:`~hf_offload.attention.inputs.DecodeInputs`.
            n, k: blocks the step scores and selects.
        """
        streams = self.execution.streams
        if streams is None or self.blocks.host.disk is not None:
            # CPU, torch path: synchronously. A disk tier: the host stages the plan's blocks on disk part-way
            # (between two graphs), which a fork to the prefetch stream would leave open: on the current stream.
            self._prefetch_planned(query, scaling, inputs, n, k)
            return
        side = streams.prefetch
        side.wait_stream(torch.cuda.current_stream(self.blocks.device))
        try:
            query.record_stream(side)  # made on the compute stream, read on the side stream
            with torch.cuda.stream(side):
                self._prefetch_planned(query, scaling, inputs, n, k)
        finally:  # the fork is joined (wait_prefetch) even after a failure: a capture must not end unjoined
            event = torch.cuda.Event()
            event.record(side)
            self._prefetch_event = event

    def _prefetch_planned(self, query: torch.Tensor, scaling: float, inputs, n: int, k: int) -> None:
        """The plan and recall of :meth:`prefetch_in_graph`, on the current stream."""
        self._recall_guess(self.planner.plan(query, None, scaling, n, 0, 0, inputs=inputs, k=k), None)

    def held_buffers(self) -> tuple:
        """What a graph of this layer reads besides the block store: the prefetch marks, where they exist."""
        return () if self._prefetch_marks is None else (self._prefetch_marks,)

    def prefetch_marks(self) -> torch.Tensor:
        """The fixed buffer of the slots a prefetch filled, allocated for the slot pool as it is now (outside any
        capture: a graph that writes or reads it must find it there)."""
        shape, device = self.blocks.pool.block.shape, self.blocks.device
        marks = self._prefetch_marks
        if marks is None or marks.shape != shape or marks.device != device:
            marks = self._prefetch_marks = torch.zeros(shape, dtype=torch.int32, device=device)
        return marks

    def _mark_prefetched(self, slots: torch.Tensor, miss: torch.Tensor) -> None:
        """Mark the slots this step's prefetch fills (``resident_rounds`` counts the marked slots the exact plan
        used, then clears them). In a capture only a buffer allocated before it is written."""
        marks = self._prefetch_marks
        if marks is None or marks.shape != self.blocks.pool.block.shape:
            if self.blocks.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return
            marks = self.prefetch_marks()
        marks.zero_()
        marks.scatter_add_(-1, slots, miss.int())

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
