"""The block store of one offloaded layer: the open block, sealing, the block tables, the summaries, the reserve.

State it owns (per layer, allocated at the first update):

* the host pool (:class:`~hf_offload.store.HostBlockPool`): one block = K and V of all KV heads of
  ``block_tokens`` tokens, ``[2, kv_heads, block_tokens, head_dim]``;
* the device slot pool (:class:`~hf_offload.store.DeviceSlotPool`), whose last slot holds the open block (fewer
  than ``block_tokens`` most recent tokens; fixed addresses, which captured graphs read in place);
* the block table (host block id per sequence and block: ``[batch, n_blocks]``, ``torch.int64``, on the CPU, and on
  the kernel path a device copy ``[batch, capacity]``, ``-1`` past the sealed blocks);
* the selector's summaries of every sealed block, ``summaries[name]``: ``[batch, n_blocks, ...]`` views of device
  buffers that grow by :data:`SUMMARY_CHUNK_BLOCKS` blocks at a time, so that a seal writes in place;
* the events of the host writes (on the kernel path they run on the offload stream), which every read of a sealed
  block waits for.

Which blocks a step attends is not decided here (:mod:`.planner`), nor how missing ones come back (:mod:`.recaller`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch

from ..config import OffloadConfig
from ..kernels.seal import seal_block, seal_block_supported
from ..selectors import Selector
from ..selectors.quantkey import QuantKeySelector
from ..store import DeviceSlotPool, HostBlockPool, HostMemoryBudget, transfer, writes
from .execution import LayerExecution, decode_capacity
from .stats import LayerStats, count_recall

# Block summaries are allocated this many blocks at a time per layer: a seal writes in place, and the buffers grow
# (one copy) only every SUMMARY_CHUNK_BLOCKS blocks, instead of a new allocation of every summary at every seal,
# whose freed predecessors fragment device memory when it is nearly full.
SUMMARY_CHUNK_BLOCKS = 256


def release_cached_memory(device: torch.device) -> bool:
    """Give the caching allocator's unallocated blocks on a CUDA ``device`` back (``torch.cuda.empty_cache``), outside
    a capture; whether it did. Under a memory fraction the admission's room excludes them (PyTorch applies the
    fraction to reserved memory), and a prefill chunk's activations leave gigabytes of them: a summary growth tries
    again after this before it re-encodes the summaries at a coarser level, which costs accuracy."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return False
    torch.cuda.empty_cache()
    return True


class BlockStore:
    """The KV of one offloaded layer, block by block, in every tier.

    Args:
        config: the cache's validated settings (block, pool and host sizes, the window).
        selector: the selection policy whose summaries are kept.
        layer_idx: index of the layer in the model (for messages).
        budget: the cache-wide host memory budget.
        admission: returns the device admission budget for a device, or ``None`` (every block offloaded).
        stats: the layer's counters.
        execution: the layer's execution decisions (transfer path, paged attention, streams, the capacity a decode
            step scores: buffers hold it).

    Attributes:
        keys, values: the open block, ``[batch, kv_heads, < block_tokens, head_dim]``, views of fixed buffers.
        n_tokens: tokens cached per sequence (padding included); ``n_blocks``: sealed blocks per sequence.
        last_write: event after the host writes of every block sealed so far (``None``: none pending).
        selectable_written: event after the host writes of the blocks the current forward may read.
    """

    def __init__(
        self,
        config: OffloadConfig,
        selector: Selector,
        layer_idx: int,
        budget: HostMemoryBudget,
        admission: Callable,
        stats: LayerStats,
        execution: LayerExecution,
    ):
        self.config = config
        self.selector = selector
        self.layer_idx = layer_idx
        self.block_tokens = config.block_tokens
        self.budget = budget
        self.admission = admission
        self.stats = stats
        self.execution = execution
        self.is_initialized = False
        self.keys = self.values = None
        self.block_table_dev: torch.Tensor | None = None
        self.summary_store: dict[str, torch.Tensor] = {}
        self.summaries: dict[str, torch.Tensor] = {}
        self.reserved_blocks = 0  # summary capacity asked for by reserve(); outlives release()
        self.recycled = False  # emptied for another cache (recycle()) and not updated since
        self.storage_epoch = 0  # counts replacements of the summary and block-table buffers (graphs read them)
        self._buffer_bytes: tuple | None = None  # device_buffer_bytes() and the buffers it was taken of
        self._clear()

    def _clear(self) -> None:
        self.n_tokens = 0
        self.n_blocks = 0
        self.window_insert: tuple[int, torch.Tensor] | None = None  # blocks that enter the slot pool after the step
        self.seal_args: torch.Tensor | None = None  # [1 + batch], int64, device: what seal_work reads
        self.last_write = None
        self.selectable_written = None
        self.seal_offloaded = None  # after the side-stream write of the last seal replayed from a graph

    # ------------------------------------------------------------------------------------------------- life cycle
    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, host: HostBlockPool | None = None) -> bool:
        """Allocate the slot pool and an empty host pool for the shapes of the first update.

        Args:
            key_states, value_states: the first update's keys and values, ``[batch, kv_heads, q_len, head_dim]``.
            host: a pool to share instead of a new one (another cache's pool of the same layer, same block shape and
                dtype: :meth:`share_rows`); this store then holds it with the others (:attr:`HostBlockPool.holders`).

        Returns:
            Whether the host pool is pinned.
        """
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
        if host is not None:
            if host.block_shape != (2, heads, self.block_tokens, head_dim) or host.dtype != self.dtype:
                raise ValueError(
                    f"Layer {self.layer_idx}: a shared host pool holds blocks {host.block_shape} of {host.dtype}, not "
                    f"{(2, heads, self.block_tokens, head_dim)} of {self.dtype}."
                )
            host.holders += 1
            pin = host.pin_memory
            self.host = host
        else:
            self.host = HostBlockPool(
                (2, heads, self.block_tokens, head_dim),
                self.dtype,
                pin_memory=bool(pin),
                chunk_bytes=int(self.config.host_chunk_mib * (1 << 20)),
                budget=self.budget,
                admission=self.admission(self.device),
            )
        self._buffer_bytes = None  # new buffers (an id may be an earlier buffer's)
        admission = self.host.admission
        if admission is not None:
            admission.register(self)
            admission.make_room(DeviceSlotPool.bytes_for(
                batch, self.config.pool_blocks, heads, self.block_tokens, head_dim, self.dtype, open_slot=True))  # fmt: skip
        self.pool = DeviceSlotPool(
            batch, self.config.pool_blocks, heads, self.block_tokens, head_dim, self.dtype, self.device, open_slot=True
        )
        # CPU: host block id per (sequence, block): the first n_blocks columns of a buffer that grows by whole chunks.
        self._block_table_store = torch.full((batch, 0), -1, dtype=torch.int64)
        self.block_table = self._block_table_store
        self.summaries, self.summary_store = {}, {}
        # The open block lives in the slot pool's open slot (one block; positions past the filled ones are never
        # attended), so that decode attention reads it with the selected slots in one call.
        self.open_k, self.open_v = self.pool.open_keys, self.pool.open_values
        self.keys, self.values = self.open_k[:, :, :0], self.open_v[:, :, :0]
        self.is_initialized = True
        return bool(pin)

    def start_device_table(self) -> None:
        """Keep a device copy of the block table (the kernel path): ``[batch, capacity]``, ``-1`` past the sealed
        blocks; it grows like the summaries, so that a seal writes in place and a captured graph reads it over
        several seals."""
        self.block_table_dev = torch.full((self.batch, 0), -1, dtype=torch.int64, device=self.device)

    def release(self) -> None:
        """Drop every token and free the pools (the reservation stays). A host pool shared with other caches
        (:meth:`share_rows`) only loses this store's references: its blocks stay for the others."""
        if self.is_initialized:
            if self.execution.streams is not None:
                # Side streams may still read or write the pools (kernels over pinned memory are invisible to the
                # caching host allocator): finish them before the memory is freed.
                torch.cuda.synchronize(self.device)
            if self.host.holders > 1:
                self._let_go_of_shared_pool()
            else:
                self.host.release()
            del self.pool, self.block_table, self._block_table_store
            self.summaries, self.summary_store = {}, {}
            self.block_table_dev = None
            self.keys = self.values = self.open_k = self.open_v = None
            self.is_initialized = False
            self._buffer_bytes = None
        self.recycled = False
        self._clear()

    def recycle(self) -> None:
        """Drop every token but keep every buffer at its address, for the next cache of the model
        (:mod:`~hf_offload.cache.parking`): the slot pool, summaries, block tables and the host pool's chunk tables stay
        allocated, emptied as a new store's are (zeros, ``-1`` past the sealed blocks), so that a prefill of the same
        shapes writes into them in place and the graphs captured over them stay valid (:meth:`storage_key` does not
        change); the chunks themselves are freed (:meth:`drop_chunks`) and grown again as a new store grows them, with
        the same admission to the device. :attr:`recycled` stays set until the next update, which releases the buffers first where its batch,
        heads or dtype differ."""
        if not self.is_initialized:
            return
        if self.execution.streams is not None:
            torch.cuda.synchronize(self.device)  # side-stream writes and prefetches into these buffers finish first
        self.drop_chunks()
        host = self.host
        if host._chunk_addrs is not None:  # entries of chunks that are gone: zeros, as in new tables
            host._chunk_addrs.zero_()
            host._chunk_on_host[:-1].zero_()
        for store in self.summary_store.values():
            store.zero_()
        self.summaries = {name: store[:, :0] for name, store in self.summary_store.items()}
        if self.block_table_dev is not None:
            self.block_table_dev.fill_(-1)
        self._block_table_store.fill_(-1)
        self.block_table = self._block_table_store[:, :0]
        self._restart_in_place()
        self.keys, self.values = self.open_k[:, :, :0], self.open_v[:, :, :0]
        self.recycled = True

    def _restart_in_place(self) -> None:
        """Forget the per-step state and empty the slot pool, keeping every buffer a captured graph reads (the
        seal's arguments, the pool's storage): :meth:`recycle`, :meth:`refill`."""
        self.pool.clear()
        writes.zero_(self.pool.data)
        writes.zero_(self.pool.clock)
        seal_args = self.seal_args
        self._clear()
        self.seal_args = seal_args  # a captured seal reads it

    def drop_chunks(self) -> None:
        """Free the host pool's chunks (host memory and admitted device chunks) but keep its device tables, which the
        chunks grown next fill in place (:meth:`HostBlockPool.release`): a parked layer holds no KV
        (:mod:`~hf_offload.cache.parking`). Side-stream work on the chunks must be finished."""
        self.host.release(keep_tables=True)

    def fits(self, key_states: torch.Tensor) -> bool:
        """Whether keys shaped like ``key_states`` go into the allocated buffers (batch, heads, head size, dtype,
        device)."""
        return (tuple(key_states.shape[:2]) == (self.batch, self.kv_heads) and key_states.shape[-1] == self.head_dim
                and key_states.dtype == self.dtype and key_states.device == self.device)  # fmt: skip

    # ----------------------------------------------------------------------------------------------------- editing
    def crop(self, n_tokens: int) -> None:
        """Keep the first ``n_tokens`` tokens of every sequence and drop the rest, in every tier: a sealed block the
        cut falls inside is read back into the open block, later blocks leave the block tables, their summaries are
        zeroed (as past the sealed blocks anywhere) and their host blocks go back to the pool; slots holding dropped
        blocks are emptied. Call between forwards only.

        Args:
            n_tokens: tokens to keep per sequence, ``0 <= n_tokens <= n_tokens`` held.
        """
        if not 0 <= n_tokens <= self.n_tokens:
            raise ValueError(f"crop keeps 0 to {self.n_tokens} tokens, got {n_tokens}")
        if n_tokens == self.n_tokens:
            return
        T = self.block_tokens
        keep_blocks, left = divmod(n_tokens, T)
        if keep_blocks < self.n_blocks:
            self.wait_host_writes()
            dropped = self.block_table[:, keep_blocks:]
            if left:  # the cut falls inside a sealed block: it becomes the open block again
                blocks = self.host.read(dropped[:, 0].contiguous()).to(self.device)  # [batch, 2, heads, T, D]
                self.open_k[:, :, :left] = blocks[:, 0, :, :left]
                self.open_v[:, :, :left] = blocks[:, 1, :, :left]
            self.host.free(dropped.flatten())
            self._block_table_store[:, keep_blocks : self.n_blocks] = -1
            if self.block_table_dev is not None:
                self.block_table_dev[:, keep_blocks : self.n_blocks] = -1
            for name, store in self.summary_store.items():
                store[:, keep_blocks : self.n_blocks] = 0
            self.n_blocks = keep_blocks
            self.block_table = self._block_table_store[:, :keep_blocks]
            self.summaries = {name: store[:, :keep_blocks] for name, store in self.summary_store.items()}
            self.pool.forget_from(keep_blocks)
        self.window_insert = None
        self.keys, self.values = self.open_k[:, :, :left], self.open_v[:, :, :left]
        self.n_tokens = n_tokens

    def take_rows(self, rows: torch.Tensor) -> None:
        """Hold the sequences ``rows`` of this store, in that order (repeats allowed; the batch becomes
        ``len(rows)``): block tables, summaries, slot pool and open block are indexed by ``rows``; host blocks are
        shared between the sequences that now refer to them (a sealed block never changes), and those no sequence
        refers to any more go back to the pool. Call between forwards only.

        Args:
            rows: sequence indices, ``[new_batch]``, ``torch.int64``, any device; ``new_batch >= 1``.
        """
        if not len(rows):
            raise ValueError("An OffloadCache holds at least one sequence; got no rows to keep.")
        if int(rows.min()) < 0 or int(rows.max()) >= self.batch:
            raise IndexError(f"Sequence indices must lie in [0, {self.batch}) for a batch of {self.batch}, got "
                             f"{rows.tolist()}.")  # fmt: skip
        cpu = rows.cpu()
        self.wait_host_writes()
        old = self.block_table.flatten()
        self._block_table_store = self._block_table_store[cpu]
        self.block_table = self._block_table_store[:, : self.n_blocks]
        self.host.share(self.block_table.flatten())
        self.host.free(old)
        dev = rows.to(self.device)
        if self.block_table_dev is not None:
            self.block_table_dev = self.block_table_dev[dev]
        self.summary_store = {name: store[dev] for name, store in self.summary_store.items()}
        self.summaries = {name: store[:, : self.n_blocks] for name, store in self.summary_store.items()}
        self.storage_epoch += 1
        self.pool = self.pool.take_rows(dev)
        self.open_k, self.open_v = self.pool.open_keys, self.pool.open_values
        left = self.keys.shape[-2]
        self.keys, self.values = self.open_k[:, :, :left], self.open_v[:, :, :left]
        self.batch = len(rows)
        self.window_insert = self.seal_args = None

    def load(self, other: "BlockStore") -> None:
        """Hold a copy of ``other``'s tokens (a store of the same layer and settings, allocated here like it): its
        host blocks copied into this store's pool (a block shared by several sequences stays shared), block tables,
        summaries and open block (the slot pool starts empty: blocks are recalled as needed)."""
        other.wait_host_writes()
        used, index = torch.unique(other.block_table, return_inverse=True)
        # Run by run (a chunk at most at a time): with a disk tier, the copy's chunks spill as it grows.
        ids = self.host.store(other.host.runs(used, self.host.chunk_blocks))
        self.reserved_blocks = max(self.reserved_blocks, other.reserved_blocks)
        self.adopt(self.refer(ids, index), other.summaries, other.keys, other.values, other.n_tokens)

    def share_rows(
        self, other: "BlockStore", rows: torch.Tensor, rows_dev: torch.Tensor | None = None, synced: bool = False
    ) -> None:
        """Continue the sequences ``rows`` of ``other`` (the same layer of another cache with the same settings,
        whose host pool this store was allocated with: :meth:`allocate`'s ``host``): the sealed host blocks are
        shared, not copied (a sealed block never changes; each reference is counted, and new blocks of either store
        go to fresh ids), the summaries and the open block are copied (device, at most ``block_tokens - 1`` tokens
        per sequence), so that no later edit of either store reaches the other.

        Args:
            rows: which of ``other``'s sequences each of this store's sequences continues, ``[batch]``,
                ``torch.int64``, CPU (repeats allowed).
            rows_dev: ``rows`` on ``other``'s device; ``None``: made here.
            synced: the caller has synchronised the device since ``other``'s last host write (``OffloadCache.fork``
                does it once for every layer); ``False``: done here.
        """
        if self.host is not other.host:
            raise ValueError(f"Layer {self.layer_idx}: share_rows needs the store allocated with the other's host pool.")
        if not synced:
            other.wait_host_writes()
        table = other.block_table[rows]
        self.host.share(table.flatten())
        dev = rows.to(other.device) if rows_dev is None else rows_dev
        self.reserved_blocks = max(self.reserved_blocks, other.reserved_blocks)
        summaries = {name: view[dev] for name, view in other.summaries.items()}
        # The device table from the prefix's device one (no copy from the host).
        table_dev = None if other.block_table_dev is None else other.block_table_dev[:, : table.shape[1]][dev]
        self.adopt(table, summaries, other.keys[dev], other.values[dev], other.n_tokens, table_dev=table_dev)

    def refill_fits(self, other: "BlockStore") -> bool:
        """Whether :meth:`refill` from ``other`` can keep this store's buffers: the summaries laid out alike (the
        same selector level) and every per-block buffer as large as ``other``'s blocks and reservation."""
        if not self.is_initialized or self.summary_layout() != other.summary_layout():
            return False
        need = max(other.n_blocks, other.reserved_blocks)
        buffers = [self._block_table_store, *self.summary_store.values()]
        if self.block_table_dev is not None:
            buffers.append(self.block_table_dev)
        return all(buffer.shape[1] >= need for buffer in buffers)

    def refill(self, other: "BlockStore", rows: torch.Tensor, rows_dev: torch.Tensor | None = None) -> None:
        """Drop this store's tokens and continue the sequences ``rows`` of ``other`` again (this store is an earlier
        fork of ``other``: :meth:`share_rows`), in this store's own buffers: ``other``'s sealed blocks are shared
        again, this store's references go back to the shared pool (blocks only it held are freed), and the block
        tables, summaries and open block are copied into the buffers this store already has, so that the graphs
        captured over them replay. Nothing is allocated on the device and the host is not synchronised (the device
        copies read ``other``'s device buffers). The caller has synchronised the device since the last work on
        either store (side-stream writes and prefetches into these buffers, host writes of ``other``):
        :meth:`OffloadCache.fork` does it once for every layer.

        Args:
            other: the store this one was forked from (the same host pool).
            rows: which of ``other``'s sequences each of this store's sequences continues, ``[batch]``,
                ``torch.int64``, CPU.
            rows_dev: ``rows`` on ``other``'s device (one copy for every layer of a cache); ``None``: made here.

        Raises:
            ValueError: for a store that is not an initialized fork of ``other`` with ``len(rows)`` sequences, or
                whose buffers cannot take ``other``'s blocks (:meth:`refill_fits`); nothing changed then.
        """
        if self.host is not other.host or len(rows) != self.batch or not self.refill_fits(other):
            raise ValueError(f"Layer {self.layer_idx}: refill takes an initialized fork of the store, of its batch, "
                             "whose buffers hold the store's blocks and summaries.")  # fmt: skip
        table = other.block_table[rows]
        n, left = table.shape[1], other.n_tokens - table.shape[1] * self.block_tokens
        # Rows read as they are (no gather): every row of a one-sequence prefix, or the prefix's own rows in order.
        whole = other.batch == 1 or (other.batch == len(rows) and bool((rows == torch.arange(len(rows))).all()))
        dev = None if whole else (rows.to(other.device) if rows_dev is None else rows_dev)

        def rows_of(tensor: torch.Tensor) -> torch.Tensor:  # copy_ broadcasts a one-sequence prefix to every row
            return tensor if dev is None else tensor[dev]

        # References: the prefix's counted first, then this store's let go of, then the table that holds them. A
        # fork refilled from the prefix it still starts with lets go of only the blocks it sealed itself.
        mine = self.block_table
        if mine.shape[1] >= n and torch.equal(mine[:, :n], table):
            self.host.free(mine[:, n:].flatten())
        else:
            self.host.share(table.flatten())
            self.host.free(mine.flatten())
        self._block_table_store[:, :n] = table
        self._block_table_store[:, n:] = -1
        self.block_table = self._block_table_store[:, :n]
        self.reserved_blocks = max(self.reserved_blocks, other.reserved_blocks)
        self._restart_in_place()
        # The device writes of every layer go out together where the caller gathers them (OffloadCache.fork).
        if self.block_table_dev is not None:
            source = other.block_table_dev
            writes.copy_(self.block_table_dev[:, :n],
                         rows_of(source[:, :n]) if source is not None else table.to(self.device))  # fmt: skip
            writes.fill_(self.block_table_dev[:, n:], -1)
        for name, store in self.summary_store.items():
            writes.copy_(store[:, :n], rows_of(other.summaries[name]))
            writes.zero_(store[:, n:])
        writes.copy_(self.open_k[:, :, :left], rows_of(other.keys))
        writes.copy_(self.open_v[:, :, :left], rows_of(other.values))
        self.n_blocks, self.n_tokens = n, other.n_tokens
        self.summaries = {name: store[:, :n] for name, store in self.summary_store.items()}
        self.keys, self.values = self.open_k[:, :, :left], self.open_v[:, :, :left]

    def summary_layout(self) -> dict[str, tuple]:
        """Each summary's per-block shape and dtype, by name (the selector level's layout)."""
        return {name: (tuple(store.shape[2:]), store.dtype) for name, store in self.summary_store.items()}

    def refer(self, ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The block table ``ids[index]`` of blocks just allocated (one reference each), with its references
        counted: one per entry, so a block several entries share stays shared and one no entry names is freed.

        Args:
            ids: host block ids from :meth:`HostBlockPool.allocate`, ``[n]``, ``torch.int64``, CPU.
            index: positions into ``ids``, ``[batch, n_blocks]``, ``torch.int64``, CPU.

        Returns:
            ``[batch, n_blocks]``, ``torch.int64``, CPU: host block ids.
        """
        table = ids[index]
        self.host.share(table.flatten())
        self.host.free(ids)  # allocate counted one reference each; the table holds the real count
        return table

    def adopt(
        self,
        table: torch.Tensor,
        summaries: dict[str, torch.Tensor],
        open_keys: torch.Tensor,
        open_values: torch.Tensor,
        n_tokens: int,
        keep_summaries: bool = False,
        table_dev: torch.Tensor | None = None,
    ) -> None:
        """Hold these tokens (an empty store, allocated for their batch and shapes): the sealed blocks ``table``
        refers to (references already counted in this store's host pool), their summaries and the open block.

        Args:
            table: host block ids per sequence and sealed block, ``[batch, n_blocks]``, ``torch.int64``, CPU.
            summaries: the selector's summaries of those blocks by name, ``[batch, n_blocks, ...]``, any device
                (copied into this store's buffers).
            open_keys, open_values: the open block, ``[batch, kv_heads, n_tokens - n_blocks * block_tokens,
                head_dim]``, the cache dtype, any device.
            n_tokens: tokens per sequence (padding included).
            keep_summaries: ``summaries`` are buffers made for this store to keep as they are (no copy):
                ``[batch, summary_capacity(n_blocks), ...]``, contiguous, on its device, zeros past ``n_blocks``.
            table_dev: ``table`` on this store's device where the caller has it there; ``None``: copied here.
        """
        n, left = table.shape[1], n_tokens - table.shape[1] * self.block_tokens
        if not 0 <= left < self.block_tokens or open_keys.shape[-2] != left:
            raise ValueError(
                f"Layer {self.layer_idx}: {n_tokens} tokens are {n} sealed blocks of {self.block_tokens} and an open "
                f"block of {left}, not {open_keys.shape[-2]}."
            )
        capacity = self.summary_capacity(n)
        for name, summary in summaries.items() if keep_summaries else ():
            if summary.device != self.device or not summary.is_contiguous() or summary.shape[1] != capacity:
                raise ValueError(f"Layer {self.layer_idx}: summary {name!r} of shape {tuple(summary.shape)} on "
                                 f"{summary.device} is not a buffer of {capacity} blocks on {self.device}.")
        self.n_blocks = n  # _grown copies the adopted blocks into the new buffers (once) and fills past them
        # One check of the device bound for all of this store's buffers (it asks every store of the pool: a fork
        # adopts into every layer), then none per buffer.
        buffers = [*summaries.values(), *([table] if self.block_table_dev is not None else [])]
        self._room_for_bytes(sum(self._buffer_bytes_for(like, capacity) for like in buffers))
        self._block_table_store = self._grown(table, table, n, fill=-1, host=True)
        if self.block_table_dev is not None:
            table_dev = table.to(self.device) if table_dev is None else table_dev
            self.block_table_dev = self._grown(table_dev, table_dev, n, fill=-1, room_made=True)
        self.summary_store = {}
        for name, summary in summaries.items():
            if keep_summaries:
                self.storage_epoch += 1
            else:
                summary = summary.to(self.device)
                summary = self._grown(summary, summary, n, room_made=True)
            self.summary_store[name] = summary
        self.open_k[:, :, :left] = open_keys.to(self.device)
        self.open_v[:, :, :left] = open_values.to(self.device)
        self.n_tokens = n_tokens
        self.block_table = self._block_table_store[:, :n]
        self.summaries = {name: store[:, :n] for name, store in self.summary_store.items()}
        self.keys, self.values = self.open_k[:, :, :left], self.open_v[:, :, :left]

    def _let_go_of_shared_pool(self) -> None:
        """Drop this store's references to the blocks of a host pool other stores hold too."""
        self.host.free(self.block_table.flatten())
        self.host.holders -= 1

    def __del__(self):
        # A host pool shared with other caches (OffloadCache.fork) outlives this store: blocks only this store
        # referred to go back to it, else a prefix forked again and again would keep every fork's blocks.
        if getattr(self, "is_initialized", False) and self.host.holders > 1:
            self.wait_host_writes()  # a block freed here may be reused at once: its pending write must be done
            self._let_go_of_shared_pool()

    def shared_host_bytes(self) -> int:
        """Host bytes of the blocks this store refers to that other stores sharing its pool refer to as well."""
        if not self.is_initialized or self.host.holders == 1 or not self.n_blocks:
            return 0
        used, own = torch.unique(self.block_table, return_counts=True)
        shared = used[self.host.refs(used) > own]
        return int(self.host.count_on_host(shared) if self.host.admitted_chunks else len(shared)) * self.host.block_bytes

    def wait_host_writes(self) -> None:
        """Wait until every host write issued so far is done (the kernel path writes on a side stream)."""
        if self.execution.use_kernels and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------------------------------------------ append
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens to the open block and seal the blocks they fill.

        Args:
            key_states, value_states: ``[batch, kv_heads, q_len, head_dim]``, the cache dtype, compute device.

        Returns:
            ``(keys, values)`` of the recent tokens: the previously open block followed by the new tokens.
        """
        T = self.block_tokens
        open_n, end = self.keys.shape[-2], self.keys.shape[-2] + key_states.shape[-2]
        if end <= T:  # decode, short chunks: the new tokens join the open block in its buffers
            self.open_k[:, :, open_n:end] = key_states
            self.open_v[:, :, open_n:end] = value_states
            recent_k, recent_v = self.open_k[:, :, :end], self.open_v[:, :, :end]
        else:
            recent_k = torch.cat([self.keys, key_states], dim=-2)
            recent_v = torch.cat([self.values, value_states], dim=-2)
        n_new = recent_k.shape[-2] // T
        left = recent_k.shape[-2] - n_new * T
        if n_new:
            self.seal(recent_k, recent_v, n_new)
            if left:  # only after a concatenation: recent_k is not the buffer
                self.open_k[:, :, :left] = recent_k[:, :, n_new * T :]
                self.open_v[:, :, :left] = recent_v[:, :, n_new * T :]
        self.keys, self.values = self.open_k[:, :, :left], self.open_v[:, :, :left]
        self.n_tokens += key_states.shape[-2]
        return recent_k, recent_v

    def advance_open(self, filled: int) -> None:
        """After a replayed decode step wrote its token into the open block: ``filled`` tokens are open now."""
        self.n_tokens += 1
        self.keys, self.values = self.open_k[:, :, :filled], self.open_v[:, :, :filled]

    # -------------------------------------------------------------------------------------------------------- seal
    def seal(self, recent_k: torch.Tensor, recent_v: torch.Tensor, n_new: int, ids: torch.Tensor | None = None) -> None:
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
        flat = blocks.reshape(-1, 2, heads, T, D)
        written = False
        if ids is None and self.host.disk is not None:
            # With a disk tier the blocks are written now, a chunk at a time, so that the chunks filled first can
            # spill while later ones are allocated (a prompt may exceed host_memory_gib on its own).
            if flat.device.type == "cuda":
                torch.cuda.current_stream(flat.device).synchronize()
            ids = self.host.store(flat.split(self.host.chunk_blocks))
            written = True
        if ids is None:
            ids = self.host.allocate(batch * n_new)
        if written:
            self.stats.add(("offloaded_bytes",), len(ids) * self.host.block_bytes)
            if self.execution.use_kernels:
                ids_dev = ids.to(self.device)
                self.block_table_dev = self._appended(self.block_table_dev, ids_dev.view(batch, n_new), fill=-1)
        elif self.execution.use_kernels:
            # Stream order: the write runs on the offload stream behind the computation of these keys and values
            # (launch_on waits for the compute stream); every later recall of these blocks waits for its event.
            ids_dev = self._ids_on_device(ids)  # never blocks the host
            self.last_write = self._offload_on_stream(ids_dev, flat)
            self.block_table_dev = self._appended(self.block_table_dev, ids_dev.view(batch, n_new), fill=-1)
            self.stats.add(("offloaded_bytes",), len(ids) * self.host.block_bytes)
        else:
            self.stats.add(("offloaded_bytes",), transfer.offload_blocks(self.host, ids, flat))
        self.make_summary_room(self.n_blocks + n_new)
        with writes.gathered():  # the summaries' writes into their buffers: launched together
            for name, summary in self.summaries_of(keys, values).items():
                self.summary_store[name] = self._appended(self.summary_store.get(name), summary)
        self._sealed(ids, blocks, n_new)

    def _ids_on_device(self, ids: torch.Tensor) -> torch.Tensor:
        """Host block ids (``[n]``, ``torch.int64``, CPU) on the compute device without blocking the host: an
        ascending run of consecutive ids (what the pool hands out as it grows) made there by one launch, others
        copied through pinned memory."""
        first = int(ids[0]) if len(ids) else 0
        if len(ids) and torch.equal(ids, torch.arange(first, first + len(ids))):
            return torch.arange(first, first + len(ids), device=self.device)
        return (ids.pin_memory() if self.device.type == "cuda" else ids).to(self.device, non_blocking=True)

    def summaries_of(self, keys: torch.Tensor, values: torch.Tensor, selector=None) -> dict[str, torch.Tensor]:
        """The selector's summaries of new blocks (of their values too where it estimates the unselected blocks).

        Args:
            keys, values: the new blocks' keys and values, ``[batch, n_new, kv_heads, block_tokens, head_dim]``, the
                cache dtype, compute device.
            selector: another level's selector to summarize with (a file's, on load); ``None``: this store's.
        """
        selector = self.selector if selector is None else selector
        summaries = selector.summarize(keys)
        if selector.estimates_tail:
            summaries.update(selector.summarize_values(values))
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
        streams = self.execution.streams
        return transfer.launch_on(
            streams.offload if streams is not None else None,
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
        self._block_table_store = self._appended(self._block_table_store, ids.view(batch, n_new), fill=-1, host=True)
        self.block_table = self._block_table_store[:, : self.n_blocks + n_new]
        for name, store in self.summary_store.items():
            self.summaries[name] = store[:, : self.n_blocks + n_new]
        # The newest blocks are the next steps' window: they enter the slot pool once this step's attention is done
        # (a prefill step first streams older blocks through the pool, which would evict them again).
        keep_n = min(n_new, max(self.config.window_blocks, 1), self.pool.slots)
        if blocks is None:
            self.window_insert = None
        else:
            self.window_insert = (self.n_blocks + n_new - keep_n, blocks[:, n_new - keep_n :])
        self.n_blocks += n_new

    def seal_work(self) -> torch.Tensor | None:
        """The device work of sealing the open block (full: ``block_tokens`` tokens in every sequence) at the block
        position and with the host ids that the device buffer :meth:`seal_buffer` holds (``[1 + batch]``,
        ``torch.int64``: the position, then one id per sequence): the block's copy into its host block where every
        chunk of the host pool is admitted to the device (a device copy; else the caller writes it), its summaries
        and its column of the device block table, written at that position into their buffers (which must hold it).
        No host synchronisation and nothing allocated that outlives it, so that it can be captured.

        With the plain ``quantkey`` selector all of it is one launch (:func:`~hf_offload.kernels.seal.seal_block`).

        Returns:
            The block, ``[batch, 1, 2, kv_heads, block_tokens, head_dim]``, the cache dtype, compute device; ``None``
            where nothing reads it (every chunk admitted and the paged attention: no copy into the slot pool).
        """
        batch, heads, T, D = self.batch, self.kv_heads, self.block_tokens, self.head_dim
        pos, ids = self.seal_args[:1], self.seal_args[1:]
        keys = self.open_k.reshape(batch, heads, 1, T, D).transpose(1, 2)  # [B, 1, H, T, D]
        values = self.open_v.reshape(batch, heads, 1, T, D).transpose(1, 2)
        use_kernels = self.execution.use_kernels
        admitted = use_kernels and self.host.all_admitted
        one_launch = self.seal_is_one_launch()
        needed = not (one_launch and admitted and self.execution.paged)  # else nothing reads the stacked block
        blocks = torch.stack([keys, values], dim=2) if needed else None  # [B, 1, 2, H, T, D]
        if one_launch:
            bits, value_bits = self.selector.bits, self.selector.tail_bits
            addrs = self.host.chunk_addrs(self.device) if admitted else None
            seal_block(self.open_k, self.open_v, self.seal_args, self.summary_store, bits, value_bits, addrs,
                       self.host.chunk_blocks, self.block_table_dev)  # fmt: skip
            return blocks
        if use_kernels:
            if admitted:
                transfer.offload_blocks_kernel(self.host, ids, blocks.view(-1, 2, heads, T, D))
            self.block_table_dev.index_copy_(1, pos, ids.view(batch, 1))
        for name, summary in self.summaries_of(keys, values).items():
            self.summary_store[name].index_copy_(1, pos, summary)
        return blocks

    def seal_buffer(self) -> torch.Tensor:
        """The device buffer :meth:`seal_work` reads, ``[1 + batch]``, ``torch.int64`` (made at first use)."""
        if self.seal_args is None:
            self.seal_args = torch.zeros(1 + self.batch, dtype=torch.int64, device=self.device)
        return self.seal_args

    def seal_is_one_launch(self) -> bool:
        """Whether :meth:`seal_work` is one launch of :func:`~hf_offload.kernels.seal.seal_block`: the kernel path,
        a :class:`~hf_offload.selectors.quantkey.QuantKeySelector` whose summaries are its class's, and a block
        and buffers the kernel takes."""
        selector = self.selector
        own = ("summarize", "summarize_values")
        plain = isinstance(selector, QuantKeySelector) and all(
            getattr(type(selector), name) is getattr(QuantKeySelector, name) for name in own
        )
        if not (self.execution.use_kernels and plain and self.block_table_dev is not None):
            return False
        return seal_block_supported(self.open_k, self.summary_store, selector.bits, selector.tail_bits)

    def holds_next_block(self) -> bool:
        """Whether the buffers hold one more sealed block without growing (a captured seal writes in place)."""
        n = self.n_blocks
        table = self.block_table_dev if self.execution.use_kernels else None
        if table is not None and table.shape[1] <= n:
            return False
        return all(store.shape[1] > n for store in self.summary_store.values())

    def grow_for_next_seal(self) -> bool:
        """Before a decode step whose graph reads the summaries and the device block table: grow them now where they
        cannot hold one more sealed block (:meth:`holds_next_block`), instead of at the seal that needs it. A prompt
        that fills them exactly (a multiple of ``SUMMARY_CHUNK_BLOCKS`` blocks) then grows them before its first
        decode step's capture, so that the graphs captured over it serve the whole decode up to the next chunk,
        and the next cache that takes these layers (parking) finds its first step's graph. Returns whether a buffer
        was replaced."""
        cpu = self._block_table_store if self.is_initialized else None
        if not self.is_initialized or (self.holds_next_block() and cpu.shape[1] > self.n_blocks):
            return False
        need = self.n_blocks + 1
        if cpu.shape[1] < need:  # the CPU table's growth changes the storage key too
            self._block_table_store = self._grown(cpu, cpu, need, fill=-1, host=True)
            self.block_table = self._block_table_store[:, : self.n_blocks]
        if self.summary_store:
            self.make_summary_room(need)
        for name, store in self.summary_store.items():
            if store.shape[1] < need:
                self.summary_store[name] = self._grown(store, store, need)
                self.summaries[name] = self.summary_store[name][:, : self.n_blocks]
        table = self.block_table_dev
        if table is not None and table.shape[1] < need:
            self.block_table_dev = self._grown(table, table, need, fill=-1)
        return True

    def seal_from(self, ids: torch.Tensor, work: Callable[[], torch.Tensor | None]) -> None:
        """Seal the open block with host ids ``ids`` (``[batch]``, ``torch.int64``, CPU) by ``work``
        (:meth:`seal_work` or its graph's replay; returns the block, or ``None`` where nothing reads it) reading the
        position and ids from the device buffer; then the block's host write if ``work`` did not make it, and the
        host side (:meth:`_sealed`)."""
        # The offload stream's write of the last seal read the buffers that this one overwrites.
        transfer.wait_event(self.seal_offloaded, self.device)
        args = torch.cat([torch.tensor([self.n_blocks]), ids])
        cuda = self.device.type == "cuda"
        self.seal_buffer().copy_(args.pin_memory() if cuda else args, non_blocking=cuda)  # no host synchronisation
        blocks = work()
        heads, T, D = self.kv_heads, self.block_tokens, self.head_dim
        use_kernels = self.execution.use_kernels
        if not (use_kernels and self.host.all_admitted):  # seal_work wrote only blocks on the device
            flat = blocks.reshape(-1, 2, heads, T, D)
            if use_kernels:
                self.last_write = self.seal_offloaded = self._offload_on_stream(self.seal_args[1:], flat)
            else:
                transfer.offload_blocks(self.host, ids, flat)
        self.stats.add(("offloaded_bytes",), len(ids) * self.host.block_bytes)
        self._sealed(ids, blocks, 1)

    def allocate_seal_ids(self) -> torch.Tensor:
        """Host block ids for sealing the open block, ``[batch]``, ``torch.int64``, CPU; on the kernel path a pool
        grown by them enters the chunk tables now, before :meth:`storage_key` reads their version (tables that had to
        be re-allocated are not the ones an earlier capture reads)."""
        ids = self.host.allocate(self.batch)
        if self.execution.use_kernels:
            self.host.chunk_addrs(self.device)
        return ids

    # --------------------------------------------------------------------------------------------- per-block buffers
    def _appended(self, store: torch.Tensor | None, new: torch.Tensor, fill: int = 0, host: bool = False) -> torch.Tensor:
        """``store`` (a per-block buffer: a summary, a block table; ``None``: none yet), grown by :meth:`_grown` if
        it cannot hold them, with ``new`` (``[batch, n_new, ...]``) written after its :attr:`n_blocks` blocks."""
        n, need = self.n_blocks, self.n_blocks + new.shape[1]
        if store is None or store.shape[1] < need:
            store = self._grown(store, new, need, fill, host)
        writes.copy_(store[:, n:need], new)  # at once, or with the writes of a gathered block (seal)
        return store

    def _grown(
        self, store: torch.Tensor | None, like: torch.Tensor, blocks: int, fill: int = 0, host: bool = False,
        room_made: bool = False,
    ) -> torch.Tensor:
        """A per-block buffer (a summary, the device block table) for at least ``blocks`` blocks, the reservation
        and the decode capacity of ``blocks`` (in whole SUMMARY_CHUNK_BLOCKS), holding ``store``'s first
        :attr:`n_blocks` blocks and ``fill`` past them (blocks past the sealed ones are scored, masked, by a step of
        a larger capacity: zeros keep their arithmetic finite); ``like``: any tensor of this name, ``[batch, n,
        ...]``; ``host``: a buffer in host memory (the CPU block table), which the device bound does not count;
        ``room_made``: the caller made room under the bound for it already."""
        capacity = self.summary_capacity(blocks)
        if not host and not room_made:
            self._room_for(like, capacity)
        grown = like.new_empty((like.shape[0], capacity, *like.shape[2:]))
        kept = self.n_blocks if store is not None else 0
        if kept:
            grown[:, :kept] = store[:, :kept]
        grown[:, kept:] = fill  # each byte written once: a buffer is as large as the KV's summaries
        self.storage_epoch += 1
        return grown

    def summary_capacity(self, blocks: int) -> int:
        """Blocks a per-block buffer (:meth:`_grown`) for ``blocks`` blocks is made for: at least ``blocks``, the
        reservation and the decode capacity of ``blocks``, in whole SUMMARY_CHUNK_BLOCKS."""
        blocks = max(blocks, self.reserved_blocks, decode_capacity(blocks, 0, self.execution.capacity_blocks,
                                                                   self.execution.capacity_share))
        return -(-blocks // SUMMARY_CHUNK_BLOCKS) * SUMMARY_CHUNK_BLOCKS

    def make_summary_room(self, blocks: int, before_coarsening: Callable[[], None] | None = None) -> None:
        """Before the summary buffers grow to hold ``blocks`` blocks: if they would not fit the device room (after
        every admitted chunk went back to the host), have the cache re-encode every layer's summaries at a coarser
        level (``coarsen_summaries``), as often as that helps; the growth itself then takes the new level's
        bytes (and raises ``MemoryError`` under ``device_memory_gib`` if even they do not fit).
        ``before_coarsening`` runs once before the first re-encoding (a load waits there for the summaries it is
        still reading)."""
        # The room is that of the admission this store is registered with (a fork's is its prefix's: they share the
        # host pools and their bound); the coarsening is this cache's own (its layers, its selector).
        admission = self.host.admission if self.is_initialized else None
        if admission is None or not self.config.coarsen_summaries:
            return
        own = self.admission(self.device)
        released = False
        while True:
            need = self._summary_growth_bytes(blocks)
            if not need or admission.room_for(need) or own is None:
                return
            if not released:
                released = True
                if release_cached_memory(self.device):
                    continue
            if before_coarsening is not None:
                before_coarsening()
                before_coarsening = None
            if not own.coarsen_summaries():
                return
            # The finer level's buffers are now the allocator's cached blocks, which the room under a memory
            # fraction excludes: give them back before judging whether the next level is needed.
            released = False

    def _summary_growth_bytes(self, blocks: int) -> int:
        """Device bytes the summary buffers add to hold ``blocks`` blocks (0: they hold them)."""
        capacity = self.summary_capacity(blocks)
        if self.summary_store:
            stores = self.summary_store.values()
            if all(store.shape[1] >= blocks for store in stores):
                return 0
            return sum(store[:, :1].numel() * store.element_size() * capacity for store in stores)
        if not blocks:
            return 0
        empty = torch.zeros((1, 1, self.kv_heads, self.block_tokens, self.head_dim), dtype=self.dtype,
                            device=self.device)  # fmt: skip
        one = self.summaries_of(empty, empty)
        return sum(t.numel() * t.element_size() for t in one.values()) * self.batch * capacity

    def coarsen(self, coarser: Selector) -> None:
        """Re-encode this layer's summaries as ``coarser`` (the selector's :meth:`~Selector.coarser` level) makes
        them, and use it from now on. Graphs that read the old buffers must be dropped first (they keep them)."""
        if self.summary_store:
            stores = self.selector.coarsen_summaries(self.summary_store, coarser, self.head_dim, self.n_blocks)
            self.summary_store = stores
            self.summaries = {name: store[:, : self.n_blocks] for name, store in stores.items()}
            self.storage_epoch += 1
        self.selector = coarser

    def _room_for(self, like: torch.Tensor, capacity: int) -> None:
        """Make room under the device bound for a device buffer of ``capacity`` blocks shaped like ``like``
        (admitted chunks going back to the host if need be)."""
        self._room_for_bytes(self._buffer_bytes_for(like, capacity))

    @staticmethod
    def _buffer_bytes_for(like: torch.Tensor, capacity: int) -> int:
        """Bytes of a per-block buffer of ``capacity`` blocks shaped like ``like`` (``[batch, n, ...]``)."""
        return like[:1, :1].numel() * like.element_size() * like.shape[0] * capacity

    def _room_for_bytes(self, nbytes: int) -> None:
        """Make room under the device bound for ``nbytes`` of new device buffers."""
        admission = self.host.admission if self.is_initialized else None
        if admission is not None and nbytes:
            admission.make_room(nbytes)

    def summary_views(self, n: int) -> dict[str, torch.Tensor]:
        """Every summary over its first ``n`` blocks, ``[batch, n, ...]`` views of the buffers (``n`` may exceed
        :attr:`n_blocks` up to the decode capacity: those blocks hold zeros and are never valid)."""
        if any(store.shape[1] < n for store in self.summary_store.values()):
            self.make_summary_room(n)
        stores = self.summary_store
        if any(store.shape[1] < n for store in stores.values()):
            for name, store in stores.items():  # a capacity larger than the buffers were made for
                stores[name] = self._grown(store, store, n)
                self.summaries[name] = stores[name][:, : self.n_blocks]
        return {name: store[:, :n] for name, store in stores.items()}

    def reserve(self, tokens: int) -> bool:
        """Allocate the block summaries for ``tokens`` tokens per sequence now (and from the first seal on, if none
        is sealed yet), so that they never grow while the cache fills. Never shrinks; outlives :meth:`release`.

        Returns:
            Whether a buffer was replaced (captured graphs read the old ones).
        """
        if not isinstance(tokens, numbers.Integral) or isinstance(tokens, bool) or tokens < 0:
            raise ValueError(f"reserve(tokens) takes a number of tokens >= 0, got {tokens!r}")
        tokens = int(tokens)
        self.reserved_blocks = max(self.reserved_blocks, tokens // self.block_tokens)
        replaced = False
        if self.summary_store:
            self.make_summary_room(self.reserved_blocks)
        for name, store in self.summary_store.items():
            if store.shape[1] < self.reserved_blocks:
                self.summary_store[name] = self._grown(store, store, self.reserved_blocks)
                self.summaries[name] = self.summary_store[name][:, : self.n_blocks]
                replaced = True
        table = self.block_table_dev
        if table is not None and table.shape[1] < self.reserved_blocks:
            self.block_table_dev = self._grown(table, table, self.reserved_blocks, fill=-1)
            replaced = True
        return replaced

    def storage_key(self) -> tuple:
        """What a captured graph depends on besides its shapes: the versions of the summary and block-table buffers
        and of the host pool's chunk tables, whether any chunk is admitted to the device, and whether all are."""
        return self.storage_epoch, self.host.table_version, self.host.admitted_chunks > 0, self.host.all_admitted

    def held_buffers(self) -> tuple:
        """The buffers a captured graph reads that a later growth may replace (the graph keeps them alive)."""
        tables = (self.block_table_dev, *self.host.chunk_tables(self.device)) if self.execution.use_kernels else ()
        return (*self.summary_store.values(), *tables)

    # ------------------------------------------------------------------------------------------------- after a step
    def finish_step(self) -> None:
        """After this step's attention: put the blocks sealed by this step into the slot pool (a block just written
        is a hit next step), unless the paged attention reads every block of this layer in place. The caller has
        waited for any prefetch into the pool."""
        if self.window_insert is None:
            return
        first, blocks = self.window_insert
        self.window_insert = None
        if self.execution.paged and self.host.all_admitted:
            return  # the paged attention reads every block of this layer where it lies: the pool would hold a copy
        n = blocks.shape[1]
        idx = torch.arange(first, first + n, device=self.device).expand(self.batch, 1, n)
        slots, _ = self.pool.assign(idx, torch.ones_like(idx, dtype=torch.bool))
        self.pool.write(slots, blocks)

    # ---------------------------------------------------------------------------------------------------- reading
    def sealed_kv(
        self,
        n_blocks: int,
        tail_keys: torch.Tensor | None = None,
        tail_values: torch.Tensor | None = None,
        rows: slice = slice(None),
        first: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of sealed blocks ``first`` to ``n_blocks - 1`` of the sequences ``rows``, recalled onto
        the device in one pass (a prefill chunk attends to them; counted as recalled, not as decode traffic),
        followed by ``tail_keys`` / ``tail_values`` where given (the chunk's own tokens: on the kernel path they are
        written behind the recalled blocks in the same buffer, so that the layer's KV is on the device once, not
        twice).

        Args:
            n_blocks: the block after the last one to read, at most :attr:`n_blocks`.
            tail_keys, tail_values: ``[rows, kv_heads, r, head_dim]`` to append, or ``None``.
            rows: the sequences to read (a slice of the batch).
            first: the first block to read (a segment of the earlier blocks: :meth:`sealed_segment`).

        Returns:
            ``(keys, values)``, each ``[rows, kv_heads, (n_blocks - first) * block_tokens (+ r), head_dim]``,
            compute device.
        """
        r0, r1, _ = rows.indices(self.batch)
        batch, n, heads, T, D = r1 - r0, n_blocks - first, self.kv_heads, self.block_tokens, self.head_dim
        tail = 0 if tail_keys is None else tail_keys.shape[-2]
        if self.execution.use_kernels and not self.host.disk_chunks:
            scratch = DeviceSlotPool.scratch(batch, n + -(-tail // T), heads, T, D, self.dtype, self.device)
            transfer.wait_event(self.selectable_written, self.device)
            self.selectable_written = None
            dest, slots, offsets = transfer.sequence_order_indices(self.host, scratch, batch, n)
            ids = self.block_table_dev[r0:r1, first:n_blocks].flatten()
            transfer.recall_blocks_kernel(self.host, scratch, ids, dest, slots, offsets=offsets)
            # Slot j holds block first + j: the pool is the sequence in order, the tail behind it.
            end = n * T + tail
            keys, values = scratch.keys[:, :, :end], scratch.values[:, :, :end]
            if tail:
                keys[:, :, n * T :].copy_(tail_keys)
                values[:, :, n * T :].copy_(tail_values)
        else:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # host writes may still be in flight
            blocks = self.host.read(self.block_table[r0:r1, first:n_blocks].flatten()).to(self.device)
            blocks = blocks.view(batch, n, 2, heads, T, D).permute(2, 0, 3, 1, 4, 5)
            keys, values = blocks.reshape(2, batch, heads, n * T, D).unbind(0)
            if tail:
                keys, values = torch.cat([keys, tail_keys], dim=-2), torch.cat([values, tail_values], dim=-2)
        count_recall(self.stats, batch * n, self.host.block_bytes, decode=False)
        return keys, values

    def sealed_segment(self, rows: slice, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of sealed blocks ``first`` to ``last - 1`` of the sequences ``rows`` (:meth:`sealed_kv`
        of one segment: a later prefill chunk that attends to its earlier blocks a segment at a time).

        Returns:
            ``(keys, values)``, each ``[rows, kv_heads, (last - first) * block_tokens, head_dim]``, compute device.
        """
        return self.sealed_kv(last, rows=rows, first=first)

    def dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole KV of this layer re-assembled from the host pool and the open block (for checks and export).

        Returns:
            ``(keys, values)``, each ``[batch, kv_heads, n_tokens, head_dim]``, on the compute device.
        """
        if self.n_blocks == 0:
            return self.keys.clone(), self.values.clone()  # the open slot is overwritten by later steps
        if self.execution.use_kernels and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the kernels write the host pool asynchronously
        blocks = self.host.read(self.block_table.flatten()).to(self.device)
        blocks = blocks.view(self.batch, self.n_blocks, 2, self.kv_heads, self.block_tokens, self.head_dim)
        kv = blocks.permute(2, 0, 3, 1, 4, 5).reshape(2, self.batch, self.kv_heads, -1, self.head_dim)
        return torch.cat([kv[0], self.keys], dim=-2), torch.cat([kv[1], self.values], dim=-2)

    def device_kv_bytes(self) -> int:
        """Device bytes of KV held: the slot pool (with the open block's slot) and admitted blocks."""
        if not self.is_initialized:
            return 0
        return self.pool.nbytes + self.host.used_bytes_on(True)  # the pool holds the open block too

    def device_summary_bytes(self) -> int:
        """Device bytes of the block summaries (their buffers, allocated by SUMMARY_CHUNK_BLOCKS blocks)."""
        return sum(s.numel() * s.element_size() for s in self.summary_store.values())

    def device_buffer_bytes(self) -> int:
        """Device bytes of this store's buffers besides admitted blocks: the slot pool (with the open block), the
        summaries and the device block table.

        The device bound asks every store of a host pool at each check (forks share the prefix's pool: with many
        held, tens of thousands of asks per fork), so the sum is kept until a buffer is replaced: every replacement
        of a summary or block-table buffer advances :attr:`storage_epoch` (graphs read them), and a new slot pool
        comes from :meth:`allocate` (which drops the kept sum) or :meth:`take_rows` (which advances the epoch)."""
        if not self.is_initialized:
            return 0
        table = self.block_table_dev
        key = (self.storage_epoch, id(self.pool), id(table), len(self.summary_store))
        memo = self._buffer_bytes
        if memo is not None and memo[0] == key:
            return memo[1]
        nbytes = self.pool.nbytes + self.device_summary_bytes() + (0 if table is None else table.numel() * 8)
        self._buffer_bytes = (key, nbytes)
        return nbytes

    def admitted_chunks(self) -> int:
        """Chunks of the host pool that live on the device."""
        return self.host.admitted_chunks if self.is_initialized else 0

    def demote_chunk(self) -> bool:
        """Move the newest admitted chunk of the pool to host memory (after every stream is done with it): same
        blocks, same data, now recalled like any host block. Returns whether a chunk moved."""
        if not self.admitted_chunks():
            return False
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # side streams may still write or read it
        return self.host.demote_newest() > 0

    def host_kv_bytes(self) -> int:
        """Host bytes of the sealed blocks (blocks admitted to the device excluded)."""
        return self.host.used_bytes_on(False) if self.is_initialized else 0

    def disk_kv_bytes(self) -> int:
        """Bytes of the sealed blocks in chunks spilled to the disk tier."""
        return self.host.disk_used_bytes() if self.is_initialized else 0

    def host_reserved_bytes(self) -> int:
        """Host bytes the pool has reserved (whole chunks)."""
        return self.host.reserved_bytes if self.is_initialized else 0
