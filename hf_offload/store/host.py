"""The block pool of one layer: every sealed block, in (pinned) host memory by default.

With IO-adaptive admission (PulseInfer's idea, ``admission="auto"``) a chunk is placed in device memory instead while
the cache's device admission budget allows, so small caches never pay for recall; the copy kernels read device and
pinned host chunks alike (unified addressing), and the portable path copies either.

One block holds K and V of all KV heads of a layer contiguously, shape ``[2, kv_heads, block_tokens, head_dim]``,
so a block selected for all heads (SoloHead) is one contiguous span. The pool grows in fixed-size chunks: torch's
pinned host allocator rounds every allocation up to a power of two, so one large pinned tensor can ask for almost
twice its size, while fixed chunks of a power-of-two size are taken exactly.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

_GIB = 1 << 30
_MIB = 1 << 20


def meminfo_bytes(field: str) -> int | None:
    """A ``/proc/meminfo`` field (e.g. ``"MemAvailable"``) in bytes, or ``None`` where it does not exist."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_host_bytes() -> int | None:
    """``MemAvailable`` of this machine in bytes, or ``None`` where ``/proc/meminfo`` does not exist."""
    return meminfo_bytes("MemAvailable")


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in MiB below one GiB (``"4.0 MiB"``), else in GiB (``"1.50 GiB"``)."""
    return f"{nbytes / _GIB:.2f} GiB" if nbytes >= _GIB else f"{nbytes / _MIB:.1f} MiB"


class HostMemoryBudget:
    """Host bytes reserved by all pools of one cache, checked against ``host_memory_gib`` before each chunk."""

    def __init__(self, host_memory_gib: float | None, disk=None):
        self.host_memory_gib = host_memory_gib
        self.limit_bytes = None if host_memory_gib is None else int(host_memory_gib * _GIB)
        self.reserved_bytes = 0
        self.disk = disk  # the cache's DiskTier (hf_offload.store.disk): past the cap, chunks spill there first

    def reserve(self, nbytes: int) -> None:
        """Account for ``nbytes`` more (one host chunk), or raise ``MemoryError`` that says what to change."""
        limit = self.limit_bytes
        if limit is not None and self.reserved_bytes + nbytes > limit and self.disk is not None and nbytes <= limit:
            self.disk.make_room(nbytes, self)  # spill least recently used chunks to disk
        if limit is not None and self.reserved_bytes + nbytes > limit:
            cap = f"host_memory_gib={self.host_memory_gib!r} ({format_bytes(limit)})"
            if self.disk is not None and nbytes <= limit:
                raise MemoryError(
                    f"The offloaded KV cache needs more than {cap} of host memory and no chunk could move to the disk "
                    f"tier ({format_bytes(self.reserved_bytes)} are held by chunks that cannot move: each pool's partly "
                    "filled chunk, and chunks with free blocks). Raise host_memory_gib to at least one chunk per "
                    "offloaded layer and one more, or lower host_chunk_mib."
                )
            if nbytes > limit:
                raise MemoryError(
                    f"One host chunk of the KV cache is {format_bytes(nbytes)} (host_chunk_mib, rounded down to whole "
                    f"blocks), more than the whole {cap}. Raise host_memory_gib to at least "
                    f"{nbytes / _GIB:.4g}, or lower host_chunk_mib below {limit / _MIB:.4g}."
                )
            raise MemoryError(
                f"The offloaded KV cache needs more than {cap} of host memory "
                f"({format_bytes(self.reserved_bytes + nbytes)} with the next {format_bytes(nbytes)} chunk). Raise "
                "host_memory_gib, or lower the batch size or the context length."
            )
        available = available_host_bytes()
        if available is not None and nbytes > available:
            raise MemoryError(
                f"The host has {format_bytes(available)} available but the KV cache needs a {format_bytes(nbytes)} "
                "chunk more. Lower host_chunk_mib, the batch size or the context length."
            )
        self.reserved_bytes += nbytes


def _size(nbytes: int) -> str:
    """``nbytes`` in MiB, or in KiB below one MiB."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.1f} KiB"


def process_headroom_bytes(device: torch.device) -> int:
    """Device bytes this process may still allocate on a CUDA ``device``: the device's free memory plus the bytes
    the caching allocator holds unallocated, and under a memory fraction below 1
    (``torch.cuda.set_per_process_memory_fraction``) no more than the fraction leaves beyond the reserved bytes: the
    allocator applies the fraction to what it reserves, and the unallocated parts of its segments (a fragmented
    cache held 0.9 GiB of them when an 8B model ran out at a 24 GiB fraction) serve only requests that fit them."""
    free, total = torch.cuda.mem_get_info(device)
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    room = free + reserved - allocated
    fraction = _memory_fraction(device)
    if fraction < 1.0:
        room = min(room, int(total * fraction) - reserved)
    return max(0, room)


def _memory_fraction(device: torch.device) -> float:
    """The process's memory fraction of a CUDA device (1.0 where torch cannot say)."""
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return 1.0 if get is None else get(index)


def process_limit_bytes(device: torch.device) -> int:
    """Device bytes this process may allocate on a CUDA ``device`` in all (its memory fraction of the total)."""
    total = torch.cuda.mem_get_info(device)[1]
    return int(total * _memory_fraction(device))


class DeviceAdmission:
    """Device memory of one cache: which chunks of its block pools live on the device instead of host memory
    (IO-adaptive admission), and the bound on everything the cache keeps there.

    A chunk is admitted while the cache stays within its bound and the process keeps :attr:`margin_bytes` free for
    the model's own temporaries. When the cache's other device buffers must grow (summaries, block tables) or a
    forward needs more room, admitted chunks move back to host memory, newest first (:meth:`make_room`), so that
    admission never takes memory the forward or the cache needs later.

    Args:
        device: the compute device.
        limit_bytes: the bound on the cache's device bytes: admitted chunks plus the device buffers of the stores
            registered with :meth:`register` (``device_memory_gib``); ``None``: no bound besides the process's
            headroom (on CUDA; elsewhere nothing is admitted without a bound).
        floor_bytes: the least device memory kept free for temporaries; ``None``: 4% of what the process may
            allocate, at least 256 MiB (CUDA), else 0.
        admits: whether chunks may be admitted at all (``admission="auto"``); ``False``: only the bound applies.
    """

    def __init__(self, device: torch.device, limit_bytes: int | None, floor_bytes: int | None = None,
                 admits: bool = True):  # fmt: skip
        self.device = device
        self.admits = admits
        self.limit_bytes = limit_bytes
        self.admitted_bytes = 0
        self.cuda = device.type == "cuda"
        if floor_bytes is None:
            floor_bytes = max(256 << 20, int(0.04 * process_limit_bytes(device))) if self.cuda else 0
        self.floor_bytes = floor_bytes
        self.transient_bytes = 0  # the largest forward's temporaries seen or estimated
        self.demoted_chunks = 0
        # Owners of block pools and device buffers (``device_buffer_bytes()``, ``demote_chunk()``: see BlockStore),
        # each with its registration number: demotion breaks ties by it, not by where the objects happen to live.
        self._stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._registered = 0
        self._last_forward: tuple[int, int] | None = None  # (allocated, peak) at the last forward's start
        # () -> (() -> bool) | None: a weak reference to what re-encodes the cache's summaries at a coarser level
        # (DeviceResources.coarsen_summaries), or None.
        self.coarsen: Callable | None = None

    @property
    def margin_bytes(self) -> int:
        """Device bytes kept free for temporaries: the larger of the floor and the largest forward's."""
        return max(self.floor_bytes, self.transient_bytes)

    def register(self, store) -> None:
        """Count ``store``'s device buffers against the bound and let :meth:`make_room` demote its chunks."""
        if store not in self._stores:
            self._stores[store] = self._registered
            self._registered += 1

    def cache_bytes(self) -> int:
        """The cache's device bytes on this device: admitted chunks and the registered stores' buffers."""
        return self.admitted_bytes + sum(store.device_buffer_bytes() for store in list(self._stores))

    def headroom_bytes(self) -> int | None:
        """Bytes that may still be allocated for the cache: under its bound and, on CUDA, the process's headroom
        less :attr:`margin_bytes`; ``None``: unbounded (CPU without a bound)."""
        room = None if self.limit_bytes is None else self.limit_bytes - self.cache_bytes()
        if self.cuda:
            process = process_headroom_bytes(self.device) - self.margin_bytes
            room = process if room is None else min(room, process)
        return room

    def admit(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` on the device for a chunk if the bound and the headroom allow."""
        room = self.headroom_bytes() if self.admits else None
        if room is None or nbytes > room:
            return False
        self.admitted_bytes += nbytes
        return True

    def room_for(self, nbytes: int) -> bool:
        """Move admitted chunks to host memory, newest first, until ``nbytes`` more fit (or none is left); whether
        they fit now (under the bound and, on CUDA, in the process's headroom less :attr:`margin_bytes`)."""
        room = self.headroom_bytes()
        while room is not None and room < nbytes and self.admitted_bytes > 0:
            if not any(store.demote_chunk() for store in self._newest_first()):
                break
            self.demoted_chunks += 1
            room = self.headroom_bytes()
        return room is None or room >= nbytes

    def coarsen_summaries(self) -> bool:
        """Re-encode the cache's block summaries at the selector's next coarser level (the cache's
        ``DeviceResources.coarsen_summaries``, set as :attr:`coarsen`); whether anything changed."""
        coarsen = self.coarsen() if self.coarsen is not None else None
        return bool(coarsen is not None and coarsen())

    def make_room(self, nbytes: int) -> None:
        """Move admitted chunks to host memory, newest first, until ``nbytes`` more fit (or none is left);
        ``MemoryError`` if they would exceed the bound all the same."""
        self.room_for(nbytes)
        if self.limit_bytes is not None and self.cache_bytes() + nbytes > self.limit_bytes:
            raise MemoryError(
                f"device_memory_gib={self.limit_bytes / _GIB:.4g} ({_size(self.limit_bytes)}) cannot hold the "
                f"cache's device buffers: {_size(self.cache_bytes() + nbytes)} are needed besides any admitted block (block "
                "summaries, slot pools, block tables). Raise device_memory_gib (or leave it None), lower the batch "
                "size or the context length, or use selector='quantkey' (its summaries are 0.4 of the default's); "
                "coarsen_summaries=True (the default) re-encodes the summaries at a coarser level first where the "
                "selector has one."
            )

    def _newest_first(self) -> list:
        """The registered stores, the one with the most admitted chunks first (demotion spreads over layers), among
        equals the last registered (a later layer) first: the same chunks move in every run."""
        order = dict(self._stores)  # a strong copy: no store leaves while they are sorted
        return sorted(order, key=lambda store: (-store.admitted_chunks(), -order[store]))

    def note_forward(self, estimate_bytes: int) -> None:
        """At the start of a forward (its first offloaded layer's update): learn the temporaries of the previous
        forward from the allocator's peak (CUDA), take ``estimate_bytes`` (this forward's temporaries as its shapes
        predict them) if larger, and move admitted chunks to host memory until they fit."""
        if self.cuda:
            allocated = torch.cuda.memory_allocated(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            if self._last_forward is not None and peak > self._last_forward[1]:
                self.transient_bytes = max(self.transient_bytes, peak - max(self._last_forward[0], allocated))
            self._last_forward = (allocated, peak)
        self.transient_bytes = max(self.transient_bytes, estimate_bytes)
        if self.admitted_bytes:
            self.make_room(0)


class HostBlockPool:
    """Fixed-shape blocks in host memory, addressed by integer block ids.

    Args:
        block_shape: shape of one block, ``(2, kv_heads, block_tokens, head_dim)``.
        dtype: element type of the KV cache.
        pin_memory: allocate page-locked memory (requires CUDA).
        chunk_bytes: bytes of one allocation; rounded down to whole blocks (at least one block).
        budget: the cache-wide host memory budget to reserve from.
        admission: if given, new chunks go to the device while it admits them (IO-adaptive admission).
        allocator: ``allocator(shape, dtype)`` returns a new host chunk (e.g. pinned memory on huge pages); ``None``:
            ``torch.empty(shape, dtype=dtype, pin_memory=pin_memory)``.

    With ``budget.disk`` (a :class:`~hf_offload.store.disk.DiskTier`), a chunk may be spilled to disk when the budget is
    full (:meth:`spilled`): its blocks keep their ids, reads of them go through the tier's staging, and its ids are
    never handed out again (a freed block of a spilled chunk stays unused until the whole chunk is free, which gives
    its disk extent back).
    """

    def __init__(
        self,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        pin_memory: bool,
        chunk_bytes: int,
        budget: HostMemoryBudget,
        admission: DeviceAdmission | None = None,
        allocator: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
    ):
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.block_bytes = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.chunk_blocks = max(1, chunk_bytes // self.block_bytes)
        self.budget = budget
        self.admission = admission
        self.allocator = allocator
        self.chunks: list[torch.Tensor] = []
        self.chunk_admitted: list[bool] = []  # per chunk: admitted to the device (else host memory)
        # The disk tier: per chunk its extent in the spill file ((offset, bytes); (-1, 0): spilled and since freed
        # whole; None: in memory), when it was last used (the tier's clock) and how many of its blocks are free.
        self.disk = getattr(budget, "disk", None)
        self.disk_serial = self.disk.register(self) if self.disk is not None else None
        self.chunk_disk: list[tuple[int, int] | None] = []
        self.chunk_used: list[tuple[int, int]] = []  # (last use, creation order)
        self._disk_free: dict[int, int] = {}
        self.disk_chunks = 0  # chunks whose blocks are on disk
        self._spilled_flags: torch.Tensor | None = None  # on_disk's CPU table per chunk; None: to be made again
        self._placeholder = torch.empty((0, *self.block_shape), dtype=dtype)  # stands for a spilled chunk
        self._free: list[int] = []
        self._next_id = 0
        # Per block id: how many (sequence, block) entries of block tables refer to it. A sealed block never
        # changes, so sequences that share a past (beam search, a repeated prompt) share its blocks.
        self._refs = torch.zeros(0, dtype=torch.int32)
        # Device tables of the chunks for the copy kernels, with room for more chunks (filled in place as the pool
        # grows, so that a captured graph reading them stays valid; re-allocated, doubled, when full).
        self._chunk_addrs: torch.Tensor | None = None  # [capacity], int64: the chunks' addresses, 0 past them
        self._chunk_on_host: torch.Tensor | None = None  # [capacity + 1], bool: in host memory; the last: False
        self._chunk_on_disk: torch.Tensor | None = None  # [capacity + 1], bool: spilled to disk; the last: False
        # Per block id of the same capacity (and a last False entry for the id -1): staged ahead and published to
        # the planner (the disk tier keeps it staged until unpublished); made by block_staged() only.
        self._block_staged: torch.Tensor | None = None
        self._staged_syncs = 0
        self._tables_filled = 0  # chunks entered in the tables
        self._chunk_on_host_cpu: torch.Tensor | None = None
        self.table_version = 0  # counts re-allocations of the device tables
        self.admitted_chunks = 0  # chunks in device memory (admission)
        # Block stores using this pool: more than one after OffloadCache.fork, whose caches share the prefix's blocks
        # (and put their own new blocks here too). The last store to let go frees the chunks (BlockStore.release).
        self.holders = 1

    @property
    def block_words(self) -> int:
        """32-bit words per block (the unit of the copy kernels)."""
        return self.block_bytes // 4

    def chunk_addrs(self, device: torch.device) -> torch.Tensor:
        """Addresses of the pinned chunks, shape ``[n_chunks]``, ``torch.int64``, on ``device`` (for the copy
        kernels, which read and write pinned memory through unified addressing): a view of a table with room for
        more chunks, filled in place (on the current stream) as the pool grows."""
        n = len(self.chunks)
        table = self._chunk_addrs
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda": the current device, as tensors name it
            device = torch.device("cuda", torch.cuda.current_device())
        if table is None or table.device != device or len(table) < n:
            capacity = max(64, n, 2 * (0 if table is None else len(table)))
            # Per chunk: its address and whether it is in host memory (not admitted); the last on_host entry, False,
            # stands for the id -1 (count_on_host). Device tables start zeroed and are filled below.
            self._chunk_addrs = torch.zeros(capacity, dtype=torch.int64, device=device)
            self._chunk_on_host = torch.zeros(capacity + 1, dtype=torch.bool, device=device)
            self._chunk_on_disk = torch.zeros(capacity + 1, dtype=torch.bool, device=device)
            if self._block_staged is not None:  # made again at the new capacity, from what is staged now
                self._block_staged = torch.zeros(capacity * self.chunk_blocks + 1, dtype=torch.bool, device=device)
                self.disk.track_staging(self)
            self._tables_filled = 0
            self.table_version += 1
        start = self._tables_filled
        if start < n:
            addrs = torch.tensor([c.data_ptr() for c in self.chunks[start:n]], dtype=torch.int64)
            on_host = torch.tensor([not a for a in self.chunk_admitted[start:n]])
            on_disk = torch.tensor([d is not None for d in self.chunk_disk[start:n]])
            if device.type == "cuda":
                # Asynchronous copies: no host synchronisation when the pool grows.
                addrs, on_host, on_disk = addrs.pin_memory(), on_host.pin_memory(), on_disk.pin_memory()
            self._chunk_addrs[start:n].copy_(addrs, non_blocking=True)
            self._chunk_on_host[start:n].copy_(on_host, non_blocking=True)
            self._chunk_on_disk[start:n].copy_(on_disk, non_blocking=True)
            self._tables_filled = n
        return self._chunk_addrs[:n]

    def chunk_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The device tables of the chunks: :meth:`chunk_addrs` and, per chunk of the table's capacity plus one
        last ``False`` entry (for the id ``-1``), whether it is in host memory (``torch.bool``, ``[capacity + 1]``).
        A captured decode graph reads both: they keep their address until :attr:`table_version` changes (a pool
        that outgrows them), and the graph holds the ones it read."""
        addrs = self.chunk_addrs(device)
        return addrs, self._chunk_on_host

    def chunk_on_disk(self, device: torch.device) -> torch.Tensor:
        """Per chunk of :meth:`chunk_tables`' capacity plus one last ``False`` entry (for the id ``-1``), whether its
        blocks are on disk (``torch.bool``, ``[capacity + 1]``, on ``device``): kept with the other chunk tables
        (same address while :attr:`table_version` holds), set when a chunk spills."""
        self.chunk_addrs(device)
        return self._chunk_on_disk

    def block_staged(self, device: torch.device) -> torch.Tensor:
        """Per block id of the chunk tables' capacity plus one last ``False`` entry (for the id ``-1``), whether the
        block is published by the disk tier's staging: read (or being read) from disk ahead of need and kept there
        until unpublished, so that a plan may take it as readable without the disk. ``torch.bool``,
        ``[capacity * chunk_blocks + 1]``, on ``device``: kept with the chunk tables (same address while
        :attr:`table_version` holds), brought up to date by :meth:`sync_staged`. Made at the first call; from then
        on the tier publishes this pool's blocks staged ahead."""
        self.chunk_addrs(device)
        if self._block_staged is None:
            capacity = len(self._chunk_addrs)
            self._block_staged = torch.zeros(capacity * self.chunk_blocks + 1, dtype=torch.bool,
                                             device=self._chunk_addrs.device)  # fmt: skip
            self.disk.track_staging(self)
        return self._block_staged

    def sync_staged(self) -> None:
        """Publish the blocks staged ahead since the last call and unpublish those used, dropped or held long
        enough (``disk.PUBLISHED_SYNCS`` calls), in :meth:`block_staged`'s table (on the current stream, before any
        later plan; nothing without the table). Call it once per layer and decode step, after the recall."""
        table = self._block_staged
        if table is None or self.disk is None:
            return
        self._staged_syncs += 1
        changes = self.disk.staging_changes(self, self._staged_syncs)
        if not changes:
            return
        # One transfer: block id and mark packed as 2 * id + mark.
        packed = torch.tensor([2 * block + mark for block, mark in changes.items() if block < len(table) - 1],
                              dtype=torch.int64).to(table.device)  # fmt: skip
        table[packed >> 1] = (packed & 1).bool()

    def count_on_host(self, ids: torch.Tensor):
        """How many of ``ids`` are blocks in host memory, or ``None`` when no chunk is admitted (then all are).

        Args:
            ids: block ids, ``-1`` for none, any shape, ``torch.int64``, CPU or the device of :meth:`chunk_addrs`.

        Returns:
            ``None``, an int (``ids`` on the CPU) or a 0-d ``torch.int64`` tensor on ``ids``' device (no host
            synchronisation).
        """
        if not self.admitted_chunks:
            return None
        if ids.device.type == "cpu":
            on_host = self._chunk_on_host_cpu
            if on_host is None or len(on_host) != len(self.chunks) + 1:
                on_host = self._chunk_on_host_cpu = torch.tensor([not a for a in self.chunk_admitted] + [False])
        else:
            self.chunk_addrs(ids.device)
            on_host = self._chunk_on_host
        chunk = torch.where(ids >= 0, ids // self.chunk_blocks, len(on_host) - 1)  # -1 reads the last entry
        found = on_host[chunk].sum()
        return int(found) if ids.device.type == "cpu" else found

    @property
    def all_admitted(self) -> bool:
        """Whether every chunk lies in device memory (admission) and there is at least one: then no block of this
        pool is in host memory, and a decode step whose attention reads blocks in place recalls nothing."""
        return bool(self.chunks) and self.admitted_chunks == len(self.chunks)

    @property
    def used_blocks(self) -> int:
        """Blocks holding data."""
        return self._next_id - len(self._free)

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks holding data."""
        return self.used_blocks * self.block_bytes

    @property
    def reserved_bytes(self) -> int:
        """Host bytes allocated, used or not (admitted device chunks excluded)."""
        in_memory = sum(1 for a, d in zip(self.chunk_admitted, self.chunk_disk) if not a and d is None)
        return in_memory * self.chunk_blocks * self.block_bytes

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one chunk."""
        return self.chunk_blocks * self.block_bytes

    def _grow(self) -> None:
        nbytes = self.chunk_blocks * self.block_bytes
        shape = (self.chunk_blocks, *self.block_shape)
        order = (self.disk.tick() if self.disk is not None else 0, len(self.chunks))
        if self.admission is not None and self.admission.admit(nbytes):
            self.chunks.append(torch.empty(shape, dtype=self.dtype, device=self.admission.device))
            self.chunk_admitted.append(True)
            self.chunk_disk.append(None)
            self.chunk_used.append(order)
            self.admitted_chunks += 1
            return
        self.budget.reserve(nbytes)
        try:
            chunk = self._host_chunk(shape)
        except MemoryError:
            self.budget.reserved_bytes -= nbytes
            raise
        self.chunks.append(chunk)
        self.chunk_admitted.append(False)
        self.chunk_disk.append(None)
        self.chunk_used.append(order)

    # ------------------------------------------------------------------------------------------------ disk tier
    def spillable_chunks(self):
        """``(chunk, (last use, creation))`` of the chunks the disk tier may spill: in host memory, every block
        allocated (written: a seal with a disk tier writes what it allocates at once) and none free."""
        if self.disk is None:
            return
        with_free = {i // self.chunk_blocks for i in self._free}
        full = self._next_id // self.chunk_blocks
        for c in range(full):
            if self.chunk_disk[c] is None and not self.chunk_admitted[c] and c not in with_free:
                yield c, self.chunk_used[c]

    def spilled(self, chunk: int, offset: int, size: int) -> None:
        """Chunk ``chunk`` was written to the disk tier's extent ``(offset, size)``: free its host memory."""
        self.chunks[chunk] = self._placeholder
        self.chunk_disk[chunk] = (offset, size)
        self._spilled_flags = None
        self.disk_chunks += 1
        self.budget.reserved_bytes -= self.chunk_nbytes
        self._disk_free[chunk] = 0
        if self._chunk_addrs is not None and chunk < self._tables_filled:  # no kernel reads it: id -1 (recaller)
            self._chunk_addrs[chunk] = 0
            self._chunk_on_disk[chunk] = True

    def on_disk(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` (``[n]``, ``torch.int64``, CPU, ``>= 0``) are blocks of spilled chunks, ``[n]`` bool."""
        if not self.disk_chunks:
            return torch.zeros(len(ids), dtype=torch.bool)
        flags = self._spilled_flags
        if flags is None or len(flags) != len(self.chunk_disk):  # made again after a spill, a growth or a clear
            flags = self._spilled_flags = torch.tensor([d is not None for d in self.chunk_disk])
        return flags[ids // self.chunk_blocks]

    def touch(self, ids: torch.Tensor) -> None:
        """Note a use of the chunks of ``ids`` (``[n]``, ``torch.int64``, CPU) for the disk tier's choice."""
        if self.disk is None or not len(ids):
            return
        now = self.disk.tick()
        for c in torch.unique(ids // self.chunk_blocks).tolist():
            if 0 <= c < len(self.chunk_used):
                self.chunk_used[c] = (now, self.chunk_used[c][1])

    def stage(self, ids: torch.Tensor) -> None:
        """Start reading the blocks of ``ids`` (``[n]``, ``torch.int64``, CPU, ``-1`` ignored) that are on disk into
        the tier's staging without waiting (a forecast)."""
        if not self.disk_chunks:
            return
        ids = ids[ids >= 0]
        wanted = ids[self.on_disk(ids)]
        if len(wanted):
            self.disk.stage(self, wanted.tolist())

    def disk_used_bytes(self) -> int:
        """Bytes of the blocks holding data in spilled chunks."""
        if not self.disk_chunks:
            return 0
        live = [c for c, d in enumerate(self.chunk_disk) if d is not None and d[1] > 0]
        return sum(self.chunk_blocks - self._disk_free.get(c, 0) for c in live) * self.block_bytes

    def _free_spilled(self) -> None:
        """Give every extent of this pool back to the tier and forget its staged blocks."""
        if self.disk is None:
            return
        self.disk.forget(self)
        for c, extent in enumerate(self.chunk_disk):
            if extent is not None and extent[1] > 0:
                self.disk.release_extent(*extent)
        self.disk_chunks = 0
        self._disk_free = {}

    def demote_newest(self) -> int:
        """Move the newest admitted chunk to host memory (same block ids, same data); returns its bytes, 0 where no
        chunk is admitted. The caller makes sure no stream still reads or writes it (a device synchronisation)."""
        if not self.admitted_chunks:
            return 0
        index = max(i for i, admitted in enumerate(self.chunk_admitted) if admitted)
        nbytes = self.chunk_blocks * self.block_bytes
        self.budget.reserve(nbytes)
        try:
            chunk = self._host_chunk(self.chunks[index].shape)
        except MemoryError:
            self.budget.reserved_bytes -= nbytes
            raise
        chunk.copy_(self.chunks[index])
        self.chunks[index] = chunk
        self.chunk_admitted[index] = False
        self.admitted_chunks -= 1
        self.admission.admitted_bytes -= nbytes
        self._chunk_on_host_cpu = None
        if self._chunk_addrs is not None and index < self._tables_filled:  # the device tables, in place
            self._chunk_addrs[index] = chunk.data_ptr()
            self._chunk_on_host[index] = True
        return nbytes

    def _host_chunk(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A new host chunk (the allocator's, else pinned as the pool is); ``MemoryError`` that says what to do."""
        try:
            if self.allocator is not None:
                return self.allocator(shape, self.dtype)
            return torch.empty(shape, dtype=self.dtype, pin_memory=self.pin_memory)
        except RuntimeError as err:
            nbytes = torch.Size(shape).numel() * self.block_bytes // torch.Size(self.block_shape).numel()
            raise MemoryError(
                f"Could not allocate a {'pinned ' if self.pin_memory else ''}host chunk of {nbytes / 2**20:.1f} MiB "
                f"for the KV cache ({err}). Lower the batch size or context, or pass pin_memory=False (slower recall)."
            ) from err

    def used_bytes_on(self, admitted: bool) -> int:
        """Bytes of the blocks holding data in admitted (device) chunks, or in host chunks."""
        used = [max(0, min(self.chunk_blocks, self._next_id - c * self.chunk_blocks)) for c in range(len(self.chunks))]
        for block_id in self._free:
            used[block_id // self.chunk_blocks] -= 1
        kept = zip(used, self.chunk_admitted, self.chunk_disk)
        return sum(n for n, on_device, disk in kept if on_device == admitted and disk is None) * self.block_bytes

    def allocate(self, n: int) -> torch.Tensor:
        """Reserve ``n`` blocks, each referred to once; returns their ids, shape ``[n]``, dtype ``torch.int64``, on
        the CPU. Nothing changes if the pool cannot grow (the error of the host budget or the allocation)."""
        fresh = n - min(n, len(self._free))
        while self._next_id + fresh > len(self.chunks) * self.chunk_blocks:
            self._grow()
        take = n - fresh
        ids = self._free[len(self._free) - take :]
        del self._free[len(self._free) - take :]
        ids.extend(range(self._next_id, self._next_id + fresh))
        self._next_id += fresh
        ids = torch.tensor(ids, dtype=torch.int64)
        grown = len(self.chunks) * self.chunk_blocks - len(self._refs)
        if grown > 0:
            self._refs = torch.cat([self._refs, self._refs.new_zeros(grown)])
        self._refs[ids] = 1
        return ids

    def store(self, pieces) -> torch.Tensor:
        """Allocate and write blocks piece by piece, so that a disk tier can spill the chunks of earlier pieces while
        later ones arrive; returns their ids in order, ``[n]``, ``torch.int64``, CPU. All or nothing: if a piece
        fails (a full disk), the blocks of the earlier pieces are freed before the error propagates.

        Args:
            pieces: an iterable of ``[m, *block_shape]`` tensors, the pool dtype, any device.
        """
        ids = []
        try:
            for piece in pieces:
                new = self.allocate(len(piece))
                ids.append(new)
                self.write(new, piece)
        except BaseException:
            if ids:  # all or nothing: the blocks of this call go back (their chunks stay, in memory or on disk)
                self.free(torch.cat(ids))
            raise
        return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)

    def fill(self, n: int, read: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """Allocate ``n`` blocks and have ``read`` write them in place, run by run, so that their data goes straight
        into the chunks (no copy) and a disk tier can spill the chunks of earlier runs while later ones arrive;
        returns their ids in order, ``[n]``, ``torch.int64``, CPU. All or nothing, as :meth:`store`.

        Args:
            n: blocks to allocate.
            read: ``read(view)`` fills ``view``, ``[m, *block_shape]``, the pool dtype, CPU, contiguous, with the next
                ``m`` blocks (runs of consecutive ids within one chunk, at most a chunk each); a chunk in device
                memory is filled through a host buffer of the run.
        """
        ids = []
        try:
            while n:
                new = self.allocate(min(n, self.chunk_blocks))
                ids.append(new)
                n -= len(new)
                self.touch(new)
                for chunk, first, count in self._spans(new.tolist(), self.chunk_blocks):
                    target = self.chunks[chunk][first : first + count]
                    if target.device.type == "cpu":
                        read(target)
                    else:
                        staged = torch.empty(target.shape, dtype=self.dtype, pin_memory=self.pin_memory)
                        read(staged)
                        target.copy_(staged)
        except BaseException:
            if ids:
                self.free(torch.cat(ids))
            raise
        return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)

    def share(self, ids: torch.Tensor) -> None:
        """Count one more reference to each of ``ids`` (``[n]``, ``torch.int64``, CPU; repeats count once each)."""
        self._refs.index_put_((ids,), torch.ones(len(ids), dtype=self._refs.dtype), accumulate=True)

    def free(self, ids: torch.Tensor) -> None:
        """Drop one reference to each of ``ids`` (``[n]``, ``torch.int64``, CPU; repeats count once each); blocks
        nothing refers to any more return to the pool."""
        if not len(ids):
            return
        self._refs.index_put_((ids,), torch.full((len(ids),), -1, dtype=self._refs.dtype), accumulate=True)
        touched = torch.unique(ids)
        freed = touched[self._refs[touched] == 0]
        if self.disk_chunks:
            spilled = self.on_disk(freed)
            for c in (freed[spilled] // self.chunk_blocks).tolist():
                self._disk_free[c] = self._disk_free.get(c, 0) + 1
                if self._disk_free[c] == self.chunk_blocks:  # the whole chunk is free: its extent goes back
                    self.disk.release_extent(*self.chunk_disk[c])
                    self.chunk_disk[c] = (-1, 0)
                    self.disk_chunks -= 1
            freed = freed[~spilled]
        self._free.extend(freed.tolist())

    def refs(self, ids: torch.Tensor) -> torch.Tensor:
        """References to each of ``ids`` (``[n]``, ``torch.int64``, CPU), ``[n]``, ``torch.int32``."""
        return self._refs[ids]

    def runs(self, ids: torch.Tensor, max_blocks: int):
        """The blocks ``ids`` in their order as runs of consecutive ids within one chunk, for streaming them out.

        Args:
            ids: block ids, ``[n]``, ``torch.int64``, CPU.
            max_blocks: the most blocks one run holds (positive).

        Yields:
            ``[m, *block_shape]`` CPU tensors, ``1 <= m <= max_blocks``, whose concatenation is the blocks ``ids``:
            views of host chunks (nothing copied), copies of blocks in admitted device chunks.
        """
        for chunk, first, n in self._spans(ids.tolist(), max_blocks):
            if self.chunk_disk[chunk] is not None:
                start = chunk * self.chunk_blocks + first
                yield self.disk.read_blocks(self, list(range(start, start + n)))
            else:
                yield self.chunks[chunk][first : first + n].cpu()

    def _spans(self, order: list[int], max_blocks: int):
        """``(chunk, first, n)`` per run of ``order`` (block ids): consecutive ids within one chunk, at most
        ``max_blocks`` each, in order."""
        i = 0
        while i < len(order):
            chunk, first = divmod(order[i], self.chunk_blocks)
            n = 1
            while (i + n < len(order) and n < max_blocks and first + n < self.chunk_blocks
                   and order[i + n] == order[i] + n):  # fmt: skip
                n += 1
            yield chunk, first, n
            i += n

    def clear(self) -> None:
        """Forget every block (the chunks in memory stay allocated for reuse; spilled chunks are dropped)."""
        if self.disk_chunks or any(d is not None for d in self.chunk_disk):
            self._free_spilled()
            keep = [c for c, d in enumerate(self.chunk_disk) if d is None]
            self.chunks = [self.chunks[c] for c in keep]
            self.chunk_admitted = [self.chunk_admitted[c] for c in keep]
            self.chunk_used = [self.chunk_used[c] for c in keep]
            self.chunk_disk = [None] * len(keep)
            self._spilled_flags = None
            self._chunk_addrs = self._chunk_on_host = self._chunk_on_host_cpu = None  # chunk indices changed
            self._chunk_on_disk = None
            self._drop_block_staged()
            self._tables_filled = 0
            self._refs = torch.zeros(len(keep) * self.chunk_blocks, dtype=torch.int32)
        self._free.clear()
        self._next_id = 0
        self._refs = torch.zeros(len(self._refs), dtype=torch.int32)  # not in place: it may be an inference tensor

    def release(self, keep_tables: bool = False) -> None:
        """Forget every block and free the chunks, returning their bytes to the host budget and device admission.
        ``keep_tables``: keep the device chunk tables (and :attr:`table_version`), to be filled in place with the
        chunks grown next, so that graphs captured over them stay valid (the chunks are read only through them)."""
        self.clear()
        host_bytes = self.reserved_bytes
        device_bytes = self.chunk_admitted.count(True) * self.chunk_blocks * self.block_bytes
        self.budget.reserved_bytes -= host_bytes
        if self.admission is not None:
            self.admission.admitted_bytes -= device_bytes
        self.chunks.clear()
        self.chunk_admitted.clear()
        self.chunk_disk.clear()
        self._spilled_flags = None
        self.chunk_used.clear()
        self._refs = torch.zeros(0, dtype=torch.int32)
        self.admitted_chunks = 0
        self._chunk_on_host_cpu = None
        self._tables_filled = 0
        if not keep_tables:
            self._chunk_addrs = self._chunk_on_host = self._chunk_on_disk = None
            self._drop_block_staged()

    def _drop_block_staged(self) -> None:
        """Forget :meth:`block_staged`'s table and stop noting the staging changes it needs."""
        if self._block_staged is not None:
            self._block_staged = None
            self.disk.untrack_staging(self)

    def _by_chunk(self, ids: torch.Tensor):
        """``(chunk, rows, offsets)`` per chunk in memory of ``ids``; spilled chunks are the caller's."""
        chunk_of = ids // self.chunk_blocks
        offset = ids % self.chunk_blocks
        for c in torch.unique(chunk_of).tolist():
            if self.chunk_disk[c] is not None:
                continue
            rows = (chunk_of == c).nonzero().flatten()
            yield self.chunks[c], rows, offset[rows]

    def write(self, ids: torch.Tensor, blocks: torch.Tensor) -> None:
        """Store blocks.

        Args:
            ids: destination block ids, shape ``[n]``, dtype ``torch.int64``, CPU.
            blocks: shape ``[n, *block_shape]``, the pool dtype, any device (copied to the host first).
        """
        blocks = blocks.to("cpu")
        if self.disk_chunks and bool(self.on_disk(ids).any()):
            raise RuntimeError("A block of a chunk spilled to disk was written to; spilled chunks are read-only.")
        self.touch(ids)
        for chunk, rows, offset in self._by_chunk(ids):
            chunk[offset.to(chunk.device)] = blocks[rows].to(chunk.device)

    def read(self, ids: torch.Tensor, heads: torch.Tensor | None = None) -> torch.Tensor:
        """Load whole blocks, or one KV head's K and V of each block.

        Args:
            ids: block ids, shape ``[n]``, dtype ``torch.int64``, CPU.
            heads: ``None`` for whole blocks, or the KV head to read per id, shape ``[n]``, ``torch.int64``, CPU.

        Returns:
            Shape ``[n, *block_shape]`` (whole blocks) or ``[n, 2, block_tokens, head_dim]`` (one head each), on
            the CPU, pinned if the pool is.
        """
        shape = self.block_shape if heads is None else (self.block_shape[0], *self.block_shape[2:])
        out = torch.empty((len(ids), *shape), dtype=self.dtype, pin_memory=self.pin_memory)
        self.touch(ids)
        if self.disk_chunks:
            spilled = self.on_disk(ids)
            if bool(spilled.any()):  # read into the tier's staging first, copied from there
                rows = spilled.nonzero().flatten()
                blocks = self.disk.read_blocks(self, ids[rows].tolist())
                out[rows] = blocks if heads is None else blocks[torch.arange(len(rows)), :, heads[rows]]
        for chunk, rows, offset in self._by_chunk(ids):
            offset = offset.to(chunk.device)
            part = chunk[offset] if heads is None else chunk[offset, :, heads[rows].to(chunk.device)]
            out[rows] = part.cpu()
        return out
