"""The disk tier: host chunks of sealed blocks spilled to a file once host memory is capped, read back on demand.

With ``host_memory_gib`` and ``disk_dir`` set, a block pool that needs a new host chunk past the cap first moves
one chunk of the cache (any layer) to disk: the whole chunk in one aligned write, then its host memory is freed and
its blocks keep their ids. Which chunk: the **least recently used** full one (used: a block of it was written or
read), oldest first among equals, never a chunk still being filled nor one with free blocks. The sink and the window are hits in the device slot pool and never read from the host, so the chunks that
recalls keep touching are the ones whose blocks the selection keeps choosing; decode on real models reselects most
of one step's blocks at the next (0.77-0.85 on the device alone), so recency of use predicts the next use, and a
one-pass prefill, which writes every chunk once, spills in the order it wrote (the earliest layers' prompt first).

Layout: one file per cache, ``<disk_dir>/hf-offload-XXXX/blocks.kv`` (directory mode 0700, file 0600), made at the
first spill. A spilled chunk is one extent, its size rounded up to :data:`ALIGN`, at an aligned offset; freed extents
are reused by chunks of the same size. The file is opened with ``O_DIRECT`` where the file system takes it (not on
tmpfs: then buffered I/O); a transfer whose memory or size is not aligned goes through the buffered descriptor.

Reads: a recall that needs blocks on disk reads them (runs of consecutive blocks, one ``preadv`` each, on
``disk_read_threads`` worker threads) into **staging**: ``disk_staging_chunks`` chunk-sized buffers (pinned on CUDA),
divided into block slots, least recently used slot evicted first; the blocks are copied from there. A recall that
needs more blocks than staging holds reads them in batches of what it holds. :meth:`DiskTier.stage` starts reads
without waiting (lookahead's forecast of the next layer, and ``disk_stage_near``'s of the coming steps: the blocks ranked
just below each step's selection), so the exact recall later finds them staged (``disk_staging_hits``; those of them
staged ahead: ``disk_staged_used_blocks``).

Disk space for a forward is reserved before it starts where the file system supports ``posix_fallocate``
(:meth:`DiskTier.reserve`): a full disk then refuses the forward as a whole and the cache stays usable. A write that
fails anyway (no reservation possible, or an I/O error) leaves the chunk in host memory and raises
:class:`DiskTierError`. Removing the files: :meth:`DiskTier.close`, the garbage collection of the tier (its pools
keep it alive), and process exit (``weakref.finalize``).
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch

ALIGN = 4096
"""Alignment of offsets, sizes and buffers of direct I/O (bytes): the page size, a multiple of every common logical
block size."""

_GIB = 1 << 30
PUBLISHED_SYNCS = 2
"""Syncs of its pool (one per layer and decode step) that a block staged ahead stays published to the planner
(``disk_cap_blocks``) unless a recall uses it first."""
AHEAD_TASKS = 2
"""Worker tasks that one read ahead (:meth:`DiskTier.stage`) deals its runs of blocks to."""


class DiskTierError(OSError):
    """An I/O failure of the disk tier (a full disk, a spill file removed while in use); the message says what to
    change. ``errno`` is the failed call's."""


def _round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def aligned_buffer(nbytes: int, pin_memory: bool) -> torch.Tensor:
    """A ``torch.uint8`` CPU tensor of ``nbytes`` whose address is :data:`ALIGN`-aligned: pinned (the CUDA host
    allocator returns page-aligned memory) or anonymous ``mmap`` memory."""
    if pin_memory:
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        if buffer.data_ptr() % ALIGN == 0:
            return buffer
    region = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes)  # keeps ``region`` alive


def _view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes."""
    return memoryview(tensor.view(torch.uint8).reshape(-1).numpy()).cast("B")


class _Files:
    """What the finalizer of a tier removes: the directory, the descriptors; no reference back to the tier."""

    def __init__(self):
        self.root: str | None = None
        self.path: str | None = None
        self.fds: list[int] = []

    def remove(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        self.root = self.path = None


def _cleanup(files: _Files, executor: ThreadPoolExecutor) -> None:
    files.remove()
    executor.shutdown(wait=False)


class _Published:
    """The blocks of one pool staged ahead that its planner may take as readable without the disk
    (``disk_cap_blocks``): the pool's device table marks them (``HostBlockPool.block_staged``), and staging keeps them
    (no eviction) until the pool unmarks them, so that a plan that trusts a mark never reads from disk.

    Attributes:
        since: published block -> the pool's sync count when it was published.
        fresh: blocks staged ahead since the last sync.
        older: blocks staged ahead before the last sync, to publish at the next.
        gone: published blocks used by a recall (or dropped) since the last sync, to unpublish.
    """

    def __init__(self):
        self.since: dict[int, int] = {}
        self.fresh: set[int] = set()
        self.older: set[int] = set()
        self.gone: set[int] = set()


class _Staging:
    """Block slots of one block shape in ``chunks`` chunk-sized buffers; least recently used slot evicted first.

    Attributes:
        data: ``[n_slots, *block_shape]``, the pool dtype, CPU (pinned on CUDA), each slot :data:`ALIGN`-aligned
            where the block size is a multiple of it.
        entries: ``(pool serial, block id) -> slot``, least recently used first.
        ahead: the entries read by :meth:`DiskTier.stage` (a forecast) that no recall has used yet.
        tracked: per pool serial whose planner reads what is staged (:meth:`DiskTier.track_staging`), its
            :class:`_Published` blocks.
    """

    def __init__(self, n_slots: int, block_shape: tuple, dtype: torch.dtype, block_bytes: int, pin_memory: bool):
        self.raw = aligned_buffer(n_slots * block_bytes, pin_memory)
        self.data = self.raw.view(dtype).view(n_slots, *block_shape)
        self.views = [_view(self.raw[i * block_bytes : (i + 1) * block_bytes]) for i in range(n_slots)]
        self.n_slots = n_slots
        self.entries: OrderedDict[tuple[int, int], int] = OrderedDict()
        self.ahead: set[tuple[int, int]] = set()
        self.pending: dict[int, Future] = {}  # slot -> read in flight
        self.free = list(range(n_slots - 1, -1, -1))
        self.tracked: dict[int, _Published] = {}

    def note(self, key: tuple[int, int], ahead: bool) -> None:
        """Entry ``key`` was staged ahead (``True``), or was used by a recall or left staging (``False``): noted
        for its pool if tracked."""
        published = self.tracked.get(key[0])
        if published is None:
            return
        if ahead:
            published.fresh.add(key[1])
        else:
            published.fresh.discard(key[1])
            published.older.discard(key[1])
            if key[1] in published.since:
                published.gone.add(key[1])

    def pinned(self, key: tuple[int, int]) -> bool:
        """Whether entry ``key`` is published to its pool's planner, or to be published at its next sync (it stays
        until the pool unpublishes it)."""
        published = self.tracked.get(key[0])
        return published is not None and (key[1] in published.since or key[1] in published.older)

    def take(self, protected: set, evict_published: bool = False) -> int | None:
        """A free slot, else the least recently used one not in ``protected``, not being read and not published
        (after waiting for the reads in flight if every other slot is); with ``evict_published`` (a read on demand,
        which must find a slot), a published one when nothing else is left (its pool unpublishes it at its next
        sync). ``None``: every slot is protected."""
        if self.free:
            return self.free.pop()
        for attempt in range(3 if evict_published else 2):
            for key, slot in self.entries.items():
                if key not in protected and slot not in self.pending and (attempt == 2 or not self.pinned(key)):
                    del self.entries[key]
                    self.ahead.discard(key)
                    self.note(key, False)
                    return slot
            self.settle(protected)
        return None

    def settle(self, protected: set = frozenset()) -> None:
        """Wait for the reads in flight of entries outside ``protected``; a failed one leaves staging."""
        slots = {slot: key for key, slot in self.entries.items() if key not in protected}
        for slot in [s for s in self.pending if s in slots]:
            if self.pending.pop(slot).exception() is not None:
                del self.entries[slots[slot]]
                self.ahead.discard(slots[slot])
                self.note(slots[slot], False)
                self.free.append(slot)

    def forget(self, serial: int) -> None:
        """Drop the entries of one pool (its ids are about to mean other blocks)."""
        for key in [key for key in self.entries if key[0] == serial]:
            slot = self.entries.pop(key)
            self.ahead.discard(key)
            self.note(key, False)
            future = self.pending.pop(slot, None)
            if future is not None:
                future.exception()  # wait: the read must not land in a slot given to another block
            self.free.append(slot)


class DiskTier:
    """The disk tier of one cache: the spill file, its extents, the choice of chunks to spill, staging and reads.

    Args:
        directory: an existing directory to create the cache's private directory in (``disk_dir``).
        limit_bytes: most bytes the spilled chunks may take (``disk_memory_gib``); ``None``: what the file system
            holds.
        staging_chunks: chunk-sized staging buffers per block shape (``disk_staging_chunks``).
        read_threads: worker threads that read (``disk_read_threads``).
        pin_memory: pin the staging buffers (CUDA).
        chunk_bytes: bytes of one host chunk (``host_chunk_mib``), the size of one staging buffer.
    """

    def __init__(self, directory: str, limit_bytes: int | None, staging_chunks: int, read_threads: int,
                 pin_memory: bool, chunk_bytes: int):  # fmt: skip
        self.directory = os.fspath(directory)
        self.limit_bytes = limit_bytes
        self.staging_chunks = staging_chunks
        self.pin_memory = pin_memory
        self.chunk_bytes = chunk_bytes
        self.direct = False  # the file is opened with O_DIRECT
        self._files = _Files()
        self._executor = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="hf-offload-disk")
        self._finalizer = weakref.finalize(self, _cleanup, self._files, self._executor)
        self._pools: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
        self._serial = 0
        self._end = 0  # high-water mark of the extents (bytes)
        self._reserved_end = 0  # bytes of the file allocated by posix_fallocate
        self._free_extents: dict[int, list[int]] = {}  # size -> offsets
        self._staging: dict[tuple, _Staging] = {}
        self._bounce: torch.Tensor | None = None
        self.clock = 0
        self.used_bytes = 0  # bytes of the extents holding chunks
        self.counters = dict.fromkeys(
            ("spilled_chunks", "spilled_bytes", "direct_bytes", "reads", "read_bytes", "read_blocks",
             "staging_hits", "staged_ahead_blocks", "staged_used_blocks"), 0)  # fmt: skip

    # -------------------------------------------------------------------------------------------------- pools
    def register(self, pool) -> int:
        """Let ``pool`` spill to this tier and be chosen to spill; returns its serial (staging keys)."""
        self._serial += 1
        self._pools[self._serial] = pool
        return self._serial

    def tick(self) -> int:
        """The next value of the use clock."""
        self.clock += 1
        return self.clock

    @property
    def path(self) -> str | None:
        """The spill file, ``None`` until the first spill (and after :meth:`close`)."""
        return self._files.path

    @property
    def root(self) -> str | None:
        """The cache's private directory, ``None`` until the first spill (and after :meth:`close`)."""
        return self._files.root

    def _open(self) -> None:
        """Create the private directory (0700) and the spill file (0600); ``O_DIRECT`` where the file system takes
        it."""
        if self._files.root is not None:
            return
        if not os.path.isdir(self.directory):
            raise DiskTierError(
                errno.ENOENT,
                f"disk_dir={self.directory!r} is not an existing directory; create it or name another one.",
            )
        root = tempfile.mkdtemp(prefix="hf-offload-", dir=self.directory)  # mode 0700
        path = os.path.join(root, "blocks.kv")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        self._files.root, self._files.path = root, path
        buffered = os.open(path, flags, 0o600)
        self._files.fds = [buffered]
        direct = None
        if hasattr(os, "O_DIRECT"):
            try:
                direct = os.open(path, os.O_RDWR | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
            except OSError:  # EINVAL: the file system does not take O_DIRECT (tmpfs)
                direct = None
        if direct is not None:
            self._files.fds.append(direct)
        self._buffered_fd, self._direct_fd = buffered, direct
        self.direct = direct is not None
        self._end = self._reserved_end = 0
        self._free_extents = {}

    def close(self) -> None:
        """Remove the directory and its file once no pool keeps a chunk there (a pool shared with a fork keeps it
        until the fork lets go); a later spill makes a new one."""
        if self.used_bytes == 0:
            self._drop_staging()
            self._files.remove()

    def _drop_staging(self) -> None:
        for staging in self._staging.values():
            for future in staging.pending.values():
                future.exception()
        self._staging = {}

    # --------------------------------------------------------------------------------------------------- spill
    def make_room(self, nbytes: int, budget) -> bool:
        """Spill least recently used chunks until ``budget`` (the cache's :class:`HostMemoryBudget`) can take
        ``nbytes`` more; returns whether it can. Raises :class:`DiskTierError` if a write fails (that chunk stays in
        host memory) and ``MemoryError`` past ``disk_memory_gib``."""
        while budget.reserved_bytes + nbytes > budget.limit_bytes:
            victim = self._victim()
            if victim is None:
                return False
            pool, chunk = victim
            self.spill(pool, chunk)
        return True

    def _victim(self):
        """The pool and chunk to spill: least recently used, then oldest; ``None`` where no chunk qualifies."""
        best, best_key = None, None
        for pool in list(self._pools.values()):
            for chunk, key in pool.spillable_chunks():
                if best_key is None or key < best_key:
                    best, best_key = (pool, chunk), key
        return best

    def spill(self, pool, chunk: int) -> None:
        """Write chunk ``chunk`` of ``pool`` to the file (one aligned write) and free its host memory."""
        tensor = pool.chunks[chunk]
        nbytes = tensor.numel() * tensor.element_size()
        size = _round_up(nbytes)
        if self.limit_bytes is not None and self.used_bytes + size > self.limit_bytes:
            raise MemoryError(
                f"The disk tier is full: disk_memory_gib={self.limit_bytes / _GIB:.4g} holds "
                f"{self.used_bytes / _GIB:.3f} GiB of spilled chunks and the next is {size / 2**20:.1f} MiB. Raise "
                "disk_memory_gib (or leave it None: what the file system holds) or host_memory_gib, or lower the batch "
                "size or the context length."
            )
        if tensor.device.type == "cuda" or torch.cuda.is_available() and pool.pin_memory:
            torch.cuda.synchronize()  # writes of sealed blocks into this chunk may still be in flight
        self._open()
        offset = self._take_extent(size)
        try:
            self._reserve_extent(offset, size)
            self._write(tensor, offset, nbytes)
        except OSError as err:
            self._give_back(offset, size)
            raise self._io_error(err, "writing a chunk of KV blocks to") from err
        self.used_bytes += size
        self.counters["spilled_chunks"] += 1
        self.counters["spilled_bytes"] += nbytes
        pool.spilled(chunk, offset, size)

    def _take_extent(self, size: int) -> int:
        free = self._free_extents.get(size)
        if free:
            return free.pop()
        offset = self._end
        self._end += size
        return offset

    def _give_back(self, offset: int, size: int) -> None:
        if offset + size == self._end:
            self._end = offset
        else:
            self._free_extents.setdefault(size, []).append(offset)

    def release_extent(self, offset: int, size: int) -> None:
        """A spilled chunk no block refers to any more: its extent is free for another chunk."""
        self._give_back(offset, size)
        self.used_bytes -= size

    def reserve(self, nbytes: int) -> None:
        """Make sure ``nbytes`` more can be spilled without the file system running out (``posix_fallocate`` past
        the extents in use; a no-op where the file system does not support it) and within ``disk_memory_gib``:
        else raise before anything changes (:class:`DiskTierError` or ``MemoryError``)."""
        if nbytes <= 0:
            return
        free = sum(size * len(offsets) for size, offsets in self._free_extents.items())
        if self.limit_bytes is not None and self.used_bytes + nbytes > self.limit_bytes:
            raise MemoryError(
                f"This forward would spill {nbytes / 2**20:.1f} MiB more to disk than disk_memory_gib="
                f"{self.limit_bytes / _GIB:.4g} allows ({self.used_bytes / _GIB:.3f} GiB used); nothing was changed. "
                "Raise disk_memory_gib or host_memory_gib, or lower the batch size or the context length."
            )
        self._open()
        end = self._end + max(0, nbytes - free)
        if end > self._reserved_end:
            try:
                self._reserve_extent(self._reserved_end, end - self._reserved_end)
            except OSError as err:
                raise self._io_error(err, "reserving space for this forward's spilled blocks in", refused=True) from err

    def _reserve_extent(self, offset: int, size: int) -> None:
        if offset + size <= self._reserved_end:
            return
        try:
            os.posix_fallocate(self._buffered_fd, offset, size)
        except OSError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
                return  # not supported here: a full disk shows at the write
            raise
        self._reserved_end = max(self._reserved_end, offset + size)

    def _write(self, tensor: torch.Tensor, offset: int, nbytes: int) -> None:
        size = _round_up(nbytes)
        if self.direct:
            source = tensor
            if tensor.data_ptr() % ALIGN or nbytes % ALIGN:  # direct I/O takes aligned memory and sizes only
                if self._bounce is None or self._bounce.numel() < size:
                    self._bounce = aligned_buffer(size, False)
                self._bounce[:nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
                source = self._bounce[:size]
            try:
                self._pwrite_all(self._direct_fd, _view(source), offset)
                self.counters["direct_bytes"] += nbytes
                return
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self.direct = False  # the file system took the flag but not the I/O: buffered from now on
        self._pwrite_all(self._buffered_fd, _view(tensor.contiguous()), offset)

    @staticmethod
    def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            written = os.pwrite(fd, view[done:], offset + done)
            if written <= 0:
                raise OSError(errno.EIO, "short write")
            done += written

    def _io_error(self, err: OSError, doing: str, refused: bool = False) -> DiskTierError:
        where = self._files.root or self.directory
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            state = ("This forward was refused before it changed the cache; the cache stays usable once there is room."
                     if refused else "The chunk stayed in host memory.")  # fmt: skip
            message = (
                f"No space left on the file system of disk_dir={self.directory!r} while {doing} {where}. {state} Free "
                "space there, point disk_dir at a larger file system, set disk_memory_gib below its free space, or "
                "raise host_memory_gib."
            )
        else:
            message = (f"{os.strerror(err.errno) if err.errno else err} while {doing} {where} (disk_dir="
                       f"{self.directory!r}). Check that file system, or use another disk_dir.")  # fmt: skip
        return DiskTierError(err.errno or errno.EIO, message)

    # ---------------------------------------------------------------------------------------------------- reads
    def _staging_for(self, pool) -> _Staging:
        key = (tuple(pool.block_shape), pool.dtype)
        staging = self._staging.get(key)
        if staging is None:
            n_slots = max(1, self.staging_chunks * max(1, self.chunk_bytes // pool.block_bytes))
            staging = _Staging(n_slots, tuple(pool.block_shape), pool.dtype, pool.block_bytes, self.pin_memory)
            self._staging[key] = staging
        return staging

    def staging_bytes(self) -> int:
        """Bytes of the staging buffers allocated."""
        return sum(s.raw.numel() for s in self._staging.values())

    def forget(self, pool) -> None:
        """Drop staged blocks of ``pool`` (its ids are about to be reused or freed)."""
        for staging in self._staging.values():
            staging.forget(pool.disk_serial)

    def track_staging(self, pool) -> None:
        """Publish from now on ``pool``'s blocks staged ahead to its planner (:meth:`staging_changes`); nothing is
        published yet (a table made again starts empty)."""
        staging = self._staging_for(pool)
        old = staging.tracked.get(pool.disk_serial)
        staging.tracked[pool.disk_serial] = _Published()
        if old is not None:  # the old marks are gone with their table: the blocks are ordinary entries again
            for block in old.since:
                staging.ahead.discard((pool.disk_serial, block))

    def untrack_staging(self, pool) -> None:
        """Stop publishing ``pool``'s staged blocks (:meth:`track_staging`)."""
        for staging in self._staging.values():
            staging.tracked.pop(pool.disk_serial, None)

    def staging_changes(self, pool, now: int, hold: int = PUBLISHED_SYNCS) -> dict[int, bool]:
        """Block -> mark for ``pool``'s table at its sync number ``now``: ``True`` for the blocks staged ahead before
        the last sync, once their reads are done (published: staging keeps them; at most half of staging's slots are
        published at a time), ``False`` for published ones a recall used or that were published ``hold`` syncs ago
        (unpublished: ordinary staging entries, evictable, no longer ahead); empty when not tracked. The blocks
        staged ahead since the last sync wait for the next (``older``)."""
        staging = self._staging_for(pool)
        serial = pool.disk_serial
        published = staging.tracked.get(serial)
        if published is None:
            return {}
        changes = {}
        for block in published.gone:
            published.since.pop(block, None)
            changes[block] = False
        # At most half of staging is published (all pools together): the rest serves the reads on demand. A block
        # is published a sync after it was staged (its read had a step to finish, so a plan seldom waits for the
        # drive), after its read: the same blocks whatever the drive's timing.
        room = staging.n_slots // 2 - sum(len(p.since) for p in staging.tracked.values())
        for block in sorted(published.older):
            slot = staging.entries.get((serial, block))
            if slot is None or room <= 0:
                continue
            future = staging.pending.get(slot)
            if future is not None and future.exception() is not None:  # waits for the read; a failed one: skipped
                continue
            published.since[block] = now
            changes[block] = True
            room -= 1
        for block, at in list(published.since.items()):
            if now - at >= hold:
                del published.since[block]
                staging.ahead.discard((serial, block))
                changes[block] = False
        published.older, published.fresh, published.gone = published.fresh, set(), set()
        return changes

    def _check_file(self) -> None:
        if self._files.path is None or os.fstat(self._buffered_fd).st_nlink == 0:
            raise DiskTierError(
                errno.ENOENT,
                f"The spill file of the disk tier ({self._files.path or self.directory}) was removed while the cache "
                "was using it (a cleaner of that directory?). Its blocks are lost to this cache: call cache.reset() or "
                "build a new OffloadCache, and use a disk_dir nothing else deletes from.",
            )

    def _submit(self, pool, staging: _Staging, ids: list[int], slots: list[int], tasks: int | None = None) -> None:
        """Start reading blocks ``ids`` (sorted, all on disk) into staging ``slots``: one ``preadv`` per run of
        consecutive blocks of one chunk, each its own task on the worker threads, or, with ``tasks``, the runs dealt
        round-robin to at most that many tasks (reads ahead: fewer submissions for the host, parallel enough)."""
        i = 0
        block_bytes = pool.block_bytes
        direct = self.direct and block_bytes % ALIGN == 0
        fd = self._direct_fd if direct else self._buffered_fd
        runs = []
        while i < len(ids):
            chunk, first = divmod(ids[i], pool.chunk_blocks)
            n = 1
            while i + n < len(ids) and ids[i + n] == ids[i] + n and first + n < pool.chunk_blocks:
                n += 1
            offset = pool.chunk_disk[chunk][0] + first * block_bytes
            runs.append((slots[i : i + n], offset))
            self.counters["reads"] += 1
            self.counters["read_bytes"] += n * block_bytes
            self.counters["read_blocks"] += n
            i += n
        groups = [[run] for run in runs] if tasks is None else [runs[t::tasks] for t in range(min(tasks, len(runs)))]
        for group in groups:
            work = [([staging.views[s] for s in run_slots], offset) for run_slots, offset in group]
            future = self._executor.submit(_preadv_runs, fd, work)
            for run_slots, _ in group:
                for s in run_slots:
                    staging.pending[s] = future

    def stage(self, pool, ids: list[int]) -> None:
        """Start reading the blocks ``ids`` of ``pool`` that are on disk and not staged into staging, without
        waiting (a forecast of the coming recall), as many as staging holds."""
        self._check_file()
        staging = self._staging_for(pool)
        serial = pool.disk_serial
        wanted = sorted({i for i in ids if (serial, i) not in staging.entries})
        wanted = wanted[: staging.n_slots]
        protected = {(serial, i) for i in ids}
        taken_ids, slots = [], []
        for block in wanted:
            slot = staging.take(protected)
            if slot is None:
                break
            staging.entries[(serial, block)] = slot
            staging.ahead.add((serial, block))
            staging.note((serial, block), True)
            taken_ids.append(block)
            slots.append(slot)
        self._submit(pool, staging, taken_ids, slots, tasks=AHEAD_TASKS)
        self.counters["staged_ahead_blocks"] += len(taken_ids)

    def read_blocks(self, pool, ids: list[int]) -> torch.Tensor:
        """The blocks ``ids`` of ``pool`` (all on disk), ``[n, *block_shape]``, the pool dtype, CPU: from staging
        where staged (a hit), else read into staging first, in batches of what staging holds."""
        self._check_file()
        staging = self._staging_for(pool)
        serial = pool.disk_serial
        out = torch.empty((len(ids), *pool.block_shape), dtype=pool.dtype)
        order = sorted(set(ids))
        row_of: dict[int, list[int]] = {}
        for row, block in enumerate(ids):
            row_of.setdefault(block, []).append(row)
        for start in range(0, len(order), staging.n_slots):
            batch = order[start : start + staging.n_slots]
            protected = {(serial, b) for b in batch}
            missing, slots = [], []
            for block in batch:
                slot = staging.entries.get((serial, block))
                if slot is not None:  # staged (or being read ahead): no read of its own
                    staging.entries.move_to_end((serial, block))
                    self.counters["staging_hits"] += 1
                    if (serial, block) in staging.ahead:
                        staging.ahead.discard((serial, block))
                        staging.note((serial, block), False)  # used: in the slot pool from now on
                        self.counters["staged_used_blocks"] += 1
                    continue
                slot = staging.take(protected, evict_published=True)
                staging.entries[(serial, block)] = slot
                missing.append(block)
                slots.append(slot)
            self._submit(pool, staging, missing, slots)
            rows, slot_list = [], []
            for block in batch:
                slot = staging.entries[(serial, block)]
                future = staging.pending.pop(slot, None)
                if future is not None:
                    try:
                        future.result()
                    except OSError as err:
                        del staging.entries[(serial, block)]
                        staging.ahead.discard((serial, block))
                        staging.note((serial, block), False)
                        staging.free.append(slot)
                        raise self._io_error(err, "reading KV blocks from") from err
                for row in row_of[block]:
                    rows.append(row)
                    slot_list.append(slot)
            out[torch.tensor(rows, dtype=torch.long)] = staging.data[torch.tensor(slot_list, dtype=torch.long)]
        return out

    def stats(self) -> dict:
        """The tier's bytes and counters (``stats()`` reads them)."""
        return {
            "disk_kv_bytes": self.used_bytes,
            "disk_spilled_chunks": self.counters["spilled_chunks"],
            "disk_spilled_bytes": self.counters["spilled_bytes"],
            "disk_reads": self.counters["reads"],
            "disk_read_bytes": self.counters["read_bytes"],
            "disk_read_blocks": self.counters["read_blocks"],
            "disk_staging_hits": self.counters["staging_hits"],
            "disk_staged_ahead_blocks": self.counters["staged_ahead_blocks"],
            "disk_staged_used_blocks": self.counters["staged_used_blocks"],
            "disk_staging_bytes": self.staging_bytes(),
            "disk_direct_io": self.direct,
        }

    def reset_counters(self) -> None:
        """Zero the counters (not the bytes held)."""
        for name in self.counters:
            self.counters[name] = 0


def _preadv_runs(fd: int, runs: list[tuple[list[memoryview], int]]) -> None:
    """:func:`_preadv_all` of each ``(views, offset)`` in turn (one worker task)."""
    for views, offset in runs:
        _preadv_all(fd, views, offset)


def _preadv_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Fill ``views`` from ``fd`` at ``offset`` (a worker thread; the GIL is released during the read)."""
    total = sum(len(v) for v in views)
    done = 0
    while done < total:
        if done == 0:
            got = os.preadv(fd, views, offset)
        else:  # a short read: continue with the rest
            rest, skip = [], done
            for v in views:
                if skip >= len(v):
                    skip -= len(v)
                    continue
                rest.append(v[skip:])
                skip = 0
            got = os.preadv(fd, rest, offset + done)
        if got <= 0:
            raise OSError(errno.EIO, "the spill file is shorter than its extents")
        done += got
