"""One safetensors file per cache: :meth:`OffloadCache.save <hf_offload.cache.OffloadCache.save>` and
:meth:`OffloadCache.load <hf_offload.cache.OffloadCache.load>`.

The file is a plain safetensors file (``safetensors.safe_open`` and ``load_file`` read it; nothing is pickled). Its
tensors, per layer ``i`` of the model:

* offloaded layers: ``layers.{i}.blocks`` ``[n, 2, kv_heads, block_tokens, head_dim]``, the sealed blocks that the
  layer's sequences refer to, each once (a block shared by several sequences, e.g. after beam search or a fork, is
  stored once); ``layers.{i}.block_table`` ``[batch, n_blocks]``, ``int64``: for each sequence and block, its row of
  ``blocks``; ``layers.{i}.open_keys`` / ``open_values`` ``[batch, kv_heads, n_tokens - n_blocks * block_tokens,
  head_dim]``: the open block; ``layers.{i}.summaries.{name}`` ``[batch, n_blocks, ...]``: the selector's summaries.
* dense sliding-window layers (hybrid models): ``layers.{i}.keys`` / ``values``.

The metadata (``__metadata__``, strings) holds the format name and version, the cache's state (settings, lengths
and positions of every layer), a fingerprint of the model (architecture, layer types, head shapes, dtype and a
SHA-256 of a sample of its weights), one checksum per tensor (CRC-32, named in ``hf_offload.checksum``; SHA-256
in files of format version 1), and a SHA-256 of the header itself.

Saving streams: the header (every shape is known up front) is written first with placeholders for the checksums,
then the tensors, several at once, each by its own thread at its place in the file (:class:`_Writing`), the blocks
run by run straight from the host pool's chunks (views, not copies), in unbuffered writes handed to the drive as they
go; the header is then rewritten in place with the checksums (the same length). At no point does a second copy of
the KV exist in memory: pieces are the cache's own memory, except the blocks of device or disk-tier chunks and
tensors on the device, copied to the CPU one run or piece at a time, of which at most ``_HELD_BYTES`` (and one piece)
are held until written and hashed. One file rather than one per layer keeps a saved cache one thing to move, and lets
the official parser validate it whole (offsets, sizes, truncation). The file is written under a temporary name in the
target's directory, fsynced and renamed when complete, so a failed save leaves nothing behind and never a partial
file under the name.

Loading checks everything that can be checked before anything is built (the format and version, the header's
checksum, the fingerprint against the model, every tensor's shape), then builds the cache layer by layer, reading
each tensor straight into where it goes (the blocks run by run into the host pool's chunks, the summaries into the
layer's buffers on a CPU cache), and checks every tensor against its checksum once all are read; an error at any
point frees what was built, so a failed load leaves no cache.

Both directions hash on threads: each tensor's checksum is one sequential stream (a CRC-32 runs at several GB/s on
one core, a SHA-256 of a version 1 file at 1.3-2.1 GB/s, slower than a fast drive), so several tensors are hashed at
once, each on its thread. A save's thread writes the tensor it hashes
(:class:`_Writing`), a load's thread reads it (:class:`_Hashing`, where the destination stays in host memory), part by
part, so that each part is hashed from the cache of the core that just wrote or read it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import queue
import struct
import sys
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = "hf-offload-cache"
FORMAT_VERSION = 2
"""The version of the file format this hf-offload writes. It reads this one and every earlier one
(:data:`READ_VERSIONS`)."""
READ_VERSIONS = (1, 2)
"""The format versions this hf-offload loads: version 1 checks each tensor with SHA-256, version 2 with the checksum
its metadata names (``hf_offload.checksum``; this hf-offload writes :data:`CHECKSUM`)."""

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip


class _Crc32:
    """A running CRC-32 (``zlib.crc32``, which releases the GIL for large buffers) with hashlib's ``update`` and
    ``hexdigest``: 8 hex digits."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


_CHECKSUMS: dict[str, Callable] = {"crc32": _Crc32, "sha256": hashlib.sha256}
"""The checksums a file may name, by name: each a constructor of an object with ``update`` and ``hexdigest``."""
CHECKSUM = "crc32"
"""The checksum of each tensor in the files this hf-offload writes. A checksum guards against corruption (a bad
copy, a truncated transfer, a failing drive), not against tampering: CRC-32 misses a random corruption with
probability 2^-32 and every error burst of up to 32 bits, and runs at several GB/s on one core (7.1 GB/s on the CPU
machine of ``results/persist/`` against 2.1 for SHA-256 with the SHA instructions; 1.3 for SHA-256 on the H200 machine, where one SHA-256 stream
bounded a save at 0.61x the drive's write: ``results/persist/``)."""
_WEIGHT_SAMPLE_PARAMS = 8  # parameters of the model the fingerprint hashes a sample of
_WEIGHT_SAMPLE_ELEMENTS = 4096  # elements of each, spread over the whole tensor
_HASH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads hashing at once. A tensor's checksum is one sequential stream (SHA-256 of a version 1 file: about 1.5 GB/s
on one core with the SHA instructions, slower than many drives), so a save or load hashes several tensors side by
side, each on one thread (a save's thread also writes its tensor)."""
_HELD_BYTES = 256 << 20
"""The most bytes of copies (pieces that are not the cache's own memory: blocks of device or disk-tier chunks, the
small tensors a load reads) a save or load holds waiting for their write and hash (a save: and one piece more); views
of the cache's memory do not count."""
_COPY_BYTES = 16 << 20  # the most bytes of one piece a save copies from a tensor on the device
_WRITEBACK_BYTES = 8 << 20  # a save hands its data to the drive every this many bytes written
_PART_BYTES = 1 << 20
"""A load reads (a save writes) a tensor in parts of this size on a hashing thread, each part hashed right after it
is read (written), from that core's cache (SHA-256 of memory read back from DRAM ran about 30% slower here: 1.2
against 1.6 GB/s)."""


def _placeholder(checksum: str) -> str:
    """The stand-in a header holds for a ``checksum`` digest until the data is written: as many hex digits."""
    return "0" * len(_CHECKSUMS[checksum]().hexdigest())


class CacheFileError(ValueError):
    """A cache file that cannot be loaded (not a cache file, truncated, corrupted, an unknown format version) or
    that belongs to another model; the message says what to change. Nothing was built."""


# --------------------------------------------------------------------------------------------------- fingerprint
def model_fingerprint(model: torch.nn.Module, text_config, types: list[str]) -> dict:
    """What identifies the model a cache was filled by: its class, layer types and head shapes, dtype and a SHA-256
    of a sample of its weights (``_WEIGHT_SAMPLE_ELEMENTS`` elements spread over each of ``_WEIGHT_SAMPLE_PARAMS``
    parameters spread over the model; the same on any device).

    Args:
        model: the transformers model.
        text_config: its decoder text config.
        types: its layer types (:func:`~hf_offload.cache.container.layer_types`).
    """
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return {
        "architecture": type(model).__name__,
        "model_type": text_config.model_type,
        "layer_types": list(types),
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text_config, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "hidden_size": text_config.hidden_size,
        "vocab_size": text_config.vocab_size,
        "dtype": str(model.dtype).removeprefix("torch."),
        "weights_sha256": _weights_hash(model),
    }


def _weights_hash(model: torch.nn.Module) -> str:
    params = [(name, p) for name, p in model.named_parameters() if p.device.type != "meta"]
    if not params:
        return ""
    picks = sorted(
        {round(i * (len(params) - 1) / max(_WEIGHT_SAMPLE_PARAMS - 1, 1)) for i in range(_WEIGHT_SAMPLE_PARAMS)}
    )
    digest = hashlib.sha256()
    with torch.no_grad():
        for i in picks:
            name, p = params[i]
            flat = p.detach().reshape(-1)
            index = torch.linspace(0, flat.numel() - 1, min(_WEIGHT_SAMPLE_ELEMENTS, flat.numel()), device=flat.device)
            # float32 rounds indices past 2**24: the last one can land one past the end.
            sample = flat[index.long().clamp_(max=flat.numel() - 1)].cpu().contiguous()
            digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
            digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_fingerprint(saved: dict, model: torch.nn.Module, text_config, types: list[str], path: Path) -> None:
    """Raise :class:`CacheFileError` naming what differs if ``model`` is not the model the file was saved from."""
    now = model_fingerprint(model, text_config, types)
    differ = [key for key in sorted(set(saved) | set(now)) if saved.get(key) != now.get(key)]
    if not differ:
        return
    shapes = [key for key in differ if key != "weights_sha256"]
    if shapes:
        what = "; ".join(f"{key}: file {saved.get(key)!r}, model {now.get(key)!r}" for key in shapes)
        detail = f"a {saved.get('architecture')} ({saved.get('model_type')}) model of other shapes or dtype ({what})"
    else:
        detail = (f"a {saved.get('architecture')} of the same shapes and dtype but other weights (another checkpoint "
                  "or fine-tune)")  # fmt: skip
    raise CacheFileError(
        f"{path} holds the KV cache of {detail}. Its keys and values mean nothing to this model: load it with the "
        "model it was saved from (same checkpoint and dtype), or prefill the prompt again with this one."
    )


# ------------------------------------------------------------------------------------------------------- settings
def config_dict(config) -> dict:
    """The settings of ``config`` (an :class:`~hf_offload.config.OffloadConfig`) as JSON values, the selector by the
    name (with settings) that :func:`~hf_offload.selectors.get_selector` builds it from again.

    Raises:
        ValueError: for a selector instance that no registered name rebuilds.
    """
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    values["selector"] = selector_spec(values["selector"])
    # A directory of this machine: a load names its own (OffloadCache.load(path, model, disk_dir=...)).
    values["disk_dir"] = values["disk_memory_gib"] = None
    return values


def selector_spec(selector) -> str:
    """A registered name with settings (``"quantkey[bits=4]"``) that builds ``selector`` again."""
    from ..selectors import SELECTORS, get_selector

    if isinstance(selector, str):
        return selector
    cls = type(selector)
    settings = []
    if dataclasses.is_dataclass(selector):
        for f in dataclasses.fields(selector):
            value = getattr(selector, f.name)
            if f.init and value != getattr(cls, f.name, dataclasses.MISSING):
                settings.append(f"{f.name}={str(value).lower() if isinstance(value, bool) else value}")
    spec = cls.name + (f"[{','.join(settings)}]" if settings else "")
    try:
        rebuilt = get_selector(spec) if SELECTORS.get(cls.name) is cls else None
    except (TypeError, ValueError):
        rebuilt = None
    if rebuilt is None or type(rebuilt) is not cls or (dataclasses.is_dataclass(selector) and rebuilt != selector):
        raise ValueError(
            f"The cache's selector {selector!r} cannot be written to a file: a file names its selector, and no "
            f"registered name with settings builds this one again (tried {spec!r}). Register its class "
            "(hf_offload.register_selector) and give it dataclass fields for its settings."
        )
    return spec


# ------------------------------------------------------------------------------------------------------ hashing
class _Hashing:
    """Checksums of tensors fed piece by piece, computed on threads (hashlib and zlib release the GIL for large
    buffers) while the caller reads or prepares the next pieces: each tensor's digest on one thread, its pieces in
    order, and as many tensors at once as there are threads, so hashing keeps up with a drive faster than one core
    hashes. A digest may have a ``sink`` that takes each part of each piece on the digest's thread right before the
    part is hashed (a load reads the part there), which then hashes it from that core's cache.

    The caller does not wait for a piece unless the pieces it fed as copies (``held``) and not yet hashed reach
    ``held_bytes``: views of memory the cache keeps cost nothing to hold until they are hashed.

    Args:
        checksum: the checksum's name (a key of ``_CHECKSUMS``).
        threads: threads hashing at once.
        held_bytes: the most bytes of copies waiting for their hash.
    """

    def __init__(self, checksum: str = CHECKSUM, threads: int = _HASH_THREADS, held_bytes: int = _HELD_BYTES):
        self._new = _CHECKSUMS[checksum]
        self._threads = ThreadPoolExecutor(threads, thread_name_prefix="hf-offload-checksum")
        self._held = 0
        self._held_bytes = held_bytes
        self._changed = threading.Condition()
        self._open: dict[queue.SimpleQueue, Future] = {}  # digests begun and not ended
        self._stopped = False
        self._failed: BaseException | None = None  # the first error of a sink

    def begin(self, sink: Callable[[memoryview], None] | None = None) -> queue.SimpleQueue:
        """A new digest; feed it with :meth:`update`, end it with :meth:`end`. ``sink``: called with each part of
        each piece (in order, ``_PART_BYTES`` at most) on the digest's thread, right before the part is hashed."""
        stream = queue.SimpleQueue()
        self._open[stream] = self._threads.submit(self._digest, stream, sink)
        return stream

    def update(self, stream: queue.SimpleQueue, data, held: bool) -> None:
        """Add ``data`` (a contiguous buffer that nothing changes until it is hashed) to ``stream``'s digest;
        ``held``: it is a copy, held only for its hash (waits while too many copies wait). Raises the error of a
        sink that failed, so that the caller stops feeding."""
        if self._failed is not None:
            raise self._failed
        if held:
            with self._changed:
                self._changed.wait_for(lambda: self._held < self._held_bytes or self._stopped)
                self._held += memoryview(data).nbytes
        stream.put((data, held))

    def end(self, stream: queue.SimpleQueue) -> Future:
        """End ``stream``'s digest; the future's result is its hex digest (or the error of its sink)."""
        stream.put(None)
        return self._open.pop(stream)

    def _digest(self, stream: queue.SimpleQueue, sink: Callable[[memoryview], None] | None) -> str:
        digest, error = self._new(), None
        while (item := stream.get()) is not None:
            data, held = item
            try:
                if error is not None or self._stopped:
                    pass
                elif sink is None:
                    digest.update(data)
                else:
                    view = memoryview(data).cast("B")
                    for start in range(0, len(view), _PART_BYTES):
                        part = view[start : start + _PART_BYTES]
                        sink(part)
                        digest.update(part)
            except Exception as err:  # noqa: BLE001 -- raised below, once the stream is drained and its copies freed
                error = err
                self._failed = self._failed or err
            finally:
                if held:
                    with self._changed:
                        self._held -= memoryview(data).nbytes
                        self._changed.notify_all()
        if error is not None:
            raise error
        return digest.hexdigest()

    def close(self) -> None:
        """Stop: what is left to hash is dropped (after a failure; else every digest was awaited), and the threads
        end."""
        self._stopped = True
        for stream in self._open:
            stream.put(None)
        self._open.clear()
        with self._changed:
            self._changed.notify_all()
        self._threads.shutdown(wait=True)


# ------------------------------------------------------------------------------------------------------ writing
@dataclass
class Entry:
    """One tensor of a file to write.

    Attributes:
        name: its name in the file.
        dtype: its dtype.
        shape: its shape.
        pieces: returns the tensor's data in order, as CPU tensors of ``dtype`` (any shapes) whose bytes
            concatenated are the tensor's, row-major.
        copies: whether the pieces may be copies made for the write, rather than views of the cache's memory
            (held until hashed, up to ``_HELD_BYTES``).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: Callable[[], Iterator[torch.Tensor]]
    copies: bool = True

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


@functools.cache
def _sync_file_range():
    """Linux's ``sync_file_range`` from the C library, or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing ``nbytes`` of file ``fd`` from ``offset`` to the drive now, without waiting
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; nothing where that does not exist). A large file written in pieces
    then reaches the drive while the next pieces are prepared, and the final ``fsync`` waits for the last ones only
    (instead of the whole file sitting in the page cache until then). Only a hint: the ``fsync`` makes it durable
    and reports any error."""
    function = _sync_file_range()
    if function is not None:
        function(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE


def _write_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` (a contiguous buffer) to file ``fd`` at ``offset`` (``os.pwrite``: the file position is
    neither used nor moved, so threads write their own ranges of one file at once)."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


_PAGE = 4096  # the ranges a save hands to the drive are whole pages of one entry


class _Stopped(Exception):
    """A writing thread stops because another failed or the save was interrupted (never raised to the caller)."""


class _Writing:
    """A file's entries written side by side: each by one of ``threads`` threads at its own byte range (``os.pwrite``
    at the offsets the header gives) and hashed by that thread as it goes, each part of ``_PART_BYTES`` right after
    it is written (from that core's cache), its pages handed to the drive every ``_WRITEBACK_BYTES``
    (:func:`start_writeback`). A save so hashes as many entries at once as there are threads, whether their pieces
    are views of the cache's memory or copies (a single writer that waits for a copy's hash would hash one entry at a
    time).

    Pieces are taken from the entries' ``pieces`` one at a time over all threads (device-to-host copies and disk-tier
    reads run one after another, as on one thread), and a piece of an entry of copies, or a piece that must be made
    contiguous, is taken only while the copies held (taken and not yet written and hashed) are fewer than
    ``held_bytes``: they never exceed it by more than one piece.

    Args:
        fd: the file, open for writing.
        threads: entries written at once.
        held_bytes: the most bytes of copies held before a thread waits to take another.
        checksum: the checksum's name (a key of ``_CHECKSUMS``).
    """

    def __init__(self, fd: int, threads: int, held_bytes: int, checksum: str = CHECKSUM):
        self._new = _CHECKSUMS[checksum]
        self._fd = fd
        self._threads = max(1, threads)
        self._held_bytes = held_bytes
        self._held = 0
        self._taking = False  # a thread is taking a piece
        self._changed = threading.Condition()
        self._stopped = False
        self._failed: BaseException | None = None  # the first error of a thread

    def write(self, entries: list[Entry], start: int) -> dict[str, str]:
        """Write ``entries``, laid out in order from byte ``start`` (as :func:`_header` lays them out); returns the
        hex digest of each by name. Any error (of a thread, or an interrupt here) stops every thread at its next part
        and is raised once all have stopped: the first error of a thread, else the interrupt."""
        futures, offset = {}, start
        # The threads write through a descriptor of their own: were a second interrupt to cut the wait for them
        # short, the caller's descriptor closes (and its number may be reused) while they finish their part.
        self._fd = os.dup(self._fd)
        pool = ThreadPoolExecutor(min(self._threads, max(1, len(entries))), thread_name_prefix="hf-offload-save")
        try:
            for entry in entries:  # taken in file order, at most `threads` at once
                futures[entry.name] = pool.submit(self._entry, entry, offset)
                offset += entry.nbytes
            wait(futures.values(), return_when=FIRST_EXCEPTION)
        finally:
            if self._failed is not None or not all(future.done() for future in futures.values()):
                self._stop()
            pool.shutdown(wait=True, cancel_futures=True)
            os.close(self._fd)
        if self._failed is not None:
            raise self._failed
        return {name: future.result() for name, future in futures.items()}

    def _entry(self, entry: Entry, offset: int) -> str:
        """Write and hash ``entry`` from byte ``offset``; its hex digest."""
        digest, first, end = self._new(), offset, offset + entry.nbytes
        handed = -(-offset // _PAGE) * _PAGE  # where the next range handed to the drive starts
        pieces = None
        try:
            if self._stopped:
                raise _Stopped
            pieces = iter(entry.pieces())
            while (piece := self._take(pieces, entry.copies)) is not None:
                held = 0
                try:
                    if piece.dtype != entry.dtype or piece.device.type != "cpu":
                        raise TypeError(f"{entry.name}: a piece of {piece.dtype} on {piece.device}, not "
                                        f"{entry.dtype} on the CPU")  # fmt: skip
                    if not piece.numel():
                        continue
                    nbytes = piece.numel() * piece.element_size()
                    if entry.copies or not piece.is_contiguous():
                        held = nbytes
                        self._hold(held, wait=not entry.copies)  # an entry of copies waited before its piece
                    if offset + nbytes > end:
                        raise self._changed_error(entry, offset + nbytes - first)
                    handed = self._write_piece(piece, offset, handed, digest)
                    offset += nbytes
                finally:
                    piece = None  # a copy is freed before it stops counting as held
                    if held:
                        self._release(held)
            if offset != end:
                raise self._changed_error(entry, offset - first)
            self._hand(handed, end)
            return digest.hexdigest()
        except _Stopped:
            raise
        except BaseException as err:
            self._fail(err)
            raise
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()  # a generator left part-way runs its cleanup now, on this thread

    def _write_piece(self, piece: torch.Tensor, offset: int, handed: int, digest) -> int:
        """Write ``piece`` at ``offset`` and add it to ``digest``, part by part, handing the pages written from
        ``handed`` on to the drive every ``_WRITEBACK_BYTES``; returns where the next range to hand starts."""
        data = memoryview(piece.contiguous().view(torch.uint8).numpy()).cast("B")
        for start in range(0, len(data), _PART_BYTES):
            if self._stopped:
                raise _Stopped
            part = data[start : start + _PART_BYTES]
            _write_all(self._fd, part, offset)
            digest.update(part)  # right after the write read it: from this core's cache
            offset += len(part)
            if offset - handed >= _WRITEBACK_BYTES:
                handed = self._hand(handed, offset)
        return handed

    @staticmethod
    def _changed_error(entry: Entry, nbytes: int) -> RuntimeError:
        return RuntimeError(f"{entry.name}: got {nbytes} bytes for a tensor of {entry.nbytes}; the cache changed "
                            "while it was saved (save between forwards only)")  # fmt: skip

    def _take(self, pieces: Iterator[torch.Tensor], copies: bool) -> torch.Tensor | None:
        """The next piece of ``pieces`` (``None`` past the last), taken while no other thread takes one and, for
        ``copies``, while the copies held are fewer than ``held_bytes``."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._stopped or (not self._taking and (not copies or self._held < self._held_bytes))
            )
            if self._stopped:
                raise _Stopped
            self._taking = True
        try:
            return next(pieces, None)
        finally:
            with self._changed:
                self._taking = False
                self._changed.notify_all()

    def _hold(self, nbytes: int, wait: bool) -> None:
        """Count ``nbytes`` of copies held; with ``wait``, once fewer than ``held_bytes`` are."""
        with self._changed:
            if wait:
                self._changed.wait_for(lambda: self._stopped or self._held < self._held_bytes)
            self._held += nbytes
        if self._stopped:
            raise _Stopped

    def _release(self, nbytes: int) -> None:
        with self._changed:
            self._held -= nbytes
            self._changed.notify_all()

    def _hand(self, start: int, end: int) -> int:
        """Hand the whole pages from ``start`` (a page boundary) to ``end`` to the drive; returns where they end.
        Pages shared with the neighbouring entries are left to the final fsync: they may still be written."""
        stop = end // _PAGE * _PAGE
        if stop > start:
            start_writeback(self._fd, start, stop - start)
        return max(start, stop)

    def _fail(self, err: BaseException) -> None:
        with self._changed:
            self._failed = self._failed or err
        self._stop()

    def _stop(self) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify_all()


def write_file(path: Path, entries: list[Entry], metadata: dict[str, str], overwrite: bool,
               checksum: str = CHECKSUM) -> None:  # fmt: skip
    """Write a safetensors file of ``entries`` (in that order) and ``metadata`` with checksums (``checksum``: the
    name of the algorithm, recorded in the metadata as ``hf_offload.checksum``), streaming.

    The header is written first (checksums as placeholders), then the entries, several at once, each at its place
    straight from its pieces' memory and hashed as it goes (:class:`_Writing`), handed to the drive as they go
    (:func:`start_writeback`), and the header again with the checksums; all under a temporary name in ``path``'s
    directory, fsynced and renamed to ``path`` at the end (``os.replace``). Any failure removes the temporary file,
    leaves ``path`` as it was and raises the first error.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is false.
        OSError: the directory does not exist or is not writable, or a write failed (disk full).
    """
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it, or choose another path.")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; save(path) writes one file: give a file name.")
    directory = path.parent
    if not directory.is_dir():
        raise FileNotFoundError(f"Cannot save to {path}: the directory {directory} does not exist; create it first.")
    try:
        handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=directory)
    except OSError as err:
        raise type(err)(err.errno, f"Cannot save to {path}: cannot write in {directory} ({err.strerror}); choose "
                                   "a writable directory") from err  # fmt: skip
    try:
        with os.fdopen(handle, "wb", buffering=0) as f:
            fd = f.fileno()
            metadata = dict(metadata, **{"hf_offload.checksum": checksum})
            checksums = {entry.name: _placeholder(checksum) for entry in entries}
            header = _header(entries, metadata, checksums)
            _write_all(fd, struct.pack("<Q", len(header)) + header, 0)
            checksums = _Writing(fd, _HASH_THREADS, _HELD_BYTES, checksum).write(entries, 8 + len(header))
            final = _header(entries, metadata, checksums)
            assert len(final) == len(header), "checksums are fixed-length hex digests"
            _write_all(fd, final, 8)
            os.fsync(fd)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _header(entries: list[Entry], metadata: dict[str, str], checksums: dict[str, str]) -> bytes:
    """The safetensors header: the tensor index, then the metadata with the checksums and the header's own SHA-256
    (over the canonical JSON of everything else), padded with spaces to a multiple of 8 bytes."""
    index, offset = {}, 0
    for entry in entries:
        index[entry.name] = {"dtype": _DTYPES[entry.dtype], "shape": list(entry.shape),
                             "data_offsets": [offset, offset + entry.nbytes]}  # fmt: skip
        offset += entry.nbytes
    meta = dict(metadata, **{"hf_offload.checksums": json.dumps(checksums, sort_keys=True)})
    index["__metadata__"] = meta
    meta["hf_offload.header_sha256"] = _header_hash(index)
    data = json.dumps(index, separators=(",", ":")).encode()
    return data + b" " * (-len(data) % 8)


def _header_hash(header: dict) -> str:
    """SHA-256 of the canonical JSON of a parsed header without its own hash."""
    meta = {k: v for k, v in header["__metadata__"].items() if k != "hf_offload.header_sha256"}
    canonical = json.dumps(dict(header, __metadata__=meta), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


# ------------------------------------------------------------------------------------------------------ reading
class CacheFile:
    """A cache file opened for loading, its header checked: format, version, header checksum, tensor index.

    Tensors are read in large reads straight into where they go (:meth:`fill`, :meth:`read`: no memory map, no copy)
    and hashed on threads meanwhile (:class:`_Hashing`); :meth:`verify` checks every checksum once all are read.

    Attributes:
        path: the file.
        state: the cache's state as :meth:`OffloadCache.save` wrote it (settings, fingerprint, layers).
        shapes: the shape of each tensor, by name.

    Raises:
        CacheFileError: not a cache file, an unknown format version, a truncated or corrupted file.
        FileNotFoundError: no file at ``path``.
    """

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        if not path.is_file():
            raise FileNotFoundError(f"No cache file at {path}.")
        header, data_start = self._raw_header()
        meta = header.get("__metadata__") or {}
        if meta.get("hf_offload.format") != FORMAT:
            raise CacheFileError(f"{path} is a safetensors file but not a saved OffloadCache (no "
                                 f"'hf_offload.format': {FORMAT!r} in its metadata); write one with cache.save(path).")  # fmt: skip
        version = meta.get("hf_offload.version")
        if version not in [str(v) for v in READ_VERSIONS]:
            from .. import __version__

            raise CacheFileError(
                f"{path} is an OffloadCache file of format version {version!r}; this hf-offload ({__version__}) reads "
                f"versions {', '.join(map(str, READ_VERSIONS))}. Load it with the hf-offload that wrote it (its state "
                f"says {self._writer(meta)!r}) and save it again from there, or prefill the prompt again."
            )
        if meta.get("hf_offload.header_sha256") != _header_hash(header):
            raise self._corrupted("its header does not match the header's checksum")
        # Version 1 checked every tensor with SHA-256 and did not name it.
        self.checksum = meta.get("hf_offload.checksum", "sha256" if version == "1" else None)
        if self.checksum not in _CHECKSUMS:
            raise self._corrupted(f"its tensors' checksum is {self.checksum!r}, which this hf-offload does not know "
                                  f"(it knows {', '.join(sorted(_CHECKSUMS))})")  # fmt: skip
        try:
            with safe_open(str(path), framework="pt"):  # the official parser: offsets, sizes, truncation
                pass
        except Exception as err:  # safetensors raises its own error type for every malformed file
            raise self._corrupted(f"safetensors cannot read it: {err}") from err
        self.state = json.loads(meta["hf_offload.state"])
        self.checksums = json.loads(meta["hf_offload.checksums"])
        self._index = {name: info for name, info in header.items() if name != "__metadata__"}
        self.shapes = {name: tuple(info["shape"]) for name, info in self._index.items()}
        self._data_start = data_start
        self._fd = os.open(path, os.O_RDONLY)  # read with pread, straight into each tensor's destination
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger readahead: tensors read side by side
        self._hashing = _Hashing(self.checksum)
        self._digests: list[tuple[str, Future]] = []

    @staticmethod
    def _writer(meta: dict) -> str:
        """The hf-offload version the state of a file's metadata names, or ``"?"``."""
        try:
            return json.loads(meta.get("hf_offload.state", "{}")).get("hf_offload_version", "?")
        except ValueError:
            return "?"

    def _raw_header(self) -> tuple[dict, int]:
        """The parsed header and where the tensors' data starts."""
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > size - 8:
                raise self._corrupted(f"its header is cut short ({size} bytes in all)")
            try:
                header = json.loads(f.read(length))
            except ValueError as err:
                raise self._corrupted(f"its header is not valid JSON ({err})") from err
        if not isinstance(header, dict):
            raise self._corrupted("its header is not a JSON object")
        return header, 8 + length

    def _corrupted(self, why: str) -> CacheFileError:
        return CacheFileError(
            f"{self.path} is truncated or corrupted: {why}. Nothing was loaded; save the cache again (or copy the "
            "file again if it was moved)."
        )

    def dtype(self, name: str) -> torch.dtype | None:
        """The dtype of tensor ``name``, ``None`` for one no cache holds."""
        code = self._index[name]["dtype"]
        return next((dtype for dtype, known in _DTYPES.items() if known == code), None)

    def expect(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
        """Raise :class:`CacheFileError` unless the file holds tensor ``name`` of ``shape`` (and ``dtype``)."""
        if self.shapes.get(name) != tuple(shape):
            raise self._corrupted(f"tensor {name!r} has shape {self.shapes.get(name)}, its state says {tuple(shape)}")
        if dtype is not None and self._index[name]["dtype"] != _DTYPES.get(dtype):
            raise self._corrupted(f"tensor {name!r} is not of {dtype}")

    def read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name`` (CPU; at least one dimension), read into a new tensor, or into ``out`` (by the hashing
        threads: its data is there once :meth:`verify` returns); :meth:`verify` checks it.

        Args:
            name: the tensor.
            out: memory the caller keeps to read it into and leaves alone until :meth:`verify` returns: a CPU tensor
                of its shape and dtype, contiguous or of contiguous rows along the first dimension
                (``buffer[:, :n]``).
        """
        dtype = self.dtype(name)
        if dtype is None:
            raise self._corrupted(f"tensor {name!r} is of {self._index[name]['dtype']}, which no cache holds")
        if out is not None and (tuple(out.shape) != self.shapes[name] or out.dtype != dtype):
            raise ValueError(f"{name}: cannot read a tensor of {self.shapes[name]}, {dtype} into {tuple(out.shape)}, "
                             f"{out.dtype}")  # fmt: skip
        tensor = torch.empty(self.shapes[name], dtype=dtype) if out is None else out

        def fill(read: Callable[[torch.Tensor], None]) -> None:
            for part in [tensor] if tensor.is_contiguous() else tensor:
                read(part)

        self._stream(name, fill, held=out is None, later=out is not None)
        return tensor

    def fill(self, name: str, pool) -> torch.Tensor:
        """Store the blocks of tensor ``name`` (``[n, *block_shape]``) in ``pool`` (a
        :class:`~hf_offload.store.host.HostBlockPool`), read run by run straight into its chunks
        (:meth:`~hf_offload.store.host.HostBlockPool.fill`; by the hashing threads where the chunks stay in host
        memory: their data is there once :meth:`verify` returns); returns their ids; :meth:`verify` checks them."""
        # Runs that may leave the pool's host memory before they are hashed count as copies, and are read now:
        # chunks a disk tier may spill, and the host buffers device chunks are filled through.
        held = pool.disk is not None or (pool.admission is not None and pool.admission.device.type != "cpu")
        return self._stream(name, lambda read: pool.fill(self.shapes[name][0], read), held, later=not held)

    def _stream(self, name: str, fill: Callable, held: bool, later: bool):
        """``fill(read)``, where ``read(view)`` takes the next bytes of tensor ``name`` into ``view`` (a contiguous
        CPU tensor) and hands them to the hashing: read now, or with ``later`` by the hashing thread, part by part,
        each right before it is hashed (from that core's cache). Raises :class:`CacheFileError` unless the views take
        exactly the tensor's bytes. Returns what ``fill`` returns."""
        start, end = (self._data_start + offset for offset in self._index[name]["data_offsets"])
        stream = self._hashing.begin(functools.partial(self._read_parts, name, [start]) if later else None)
        offset = start

        def read(view: torch.Tensor) -> None:
            nonlocal offset
            if not view.numel():
                return
            if not view.is_contiguous():
                raise ValueError(f"{name}: cannot read into a tensor that is not contiguous")
            data = view.view(torch.uint8).numpy()
            if offset + data.nbytes > end:
                raise self._corrupted(f"tensor {name!r} holds {end - start} bytes, fewer than its shape needs")
            if not later:
                self._pread(name, memoryview(data).cast("B"), offset)
            offset += data.nbytes
            self._hashing.update(stream, data, held)

        result = fill(read)
        if offset != end:
            raise self._corrupted(f"tensor {name!r} holds {end - start} bytes, more than its shape needs")
        self._digests.append((name, self._hashing.end(stream)))
        return result

    def _read_parts(self, name: str, offset: list[int], part: memoryview) -> None:
        """The sink of a tensor read later (:class:`_Hashing`): reads its next part, from ``offset[0]`` on."""
        self._pread(name, part, offset[0])
        offset[0] += len(part)

    def _pread(self, name: str, buffer: memoryview, offset: int) -> None:
        """Fill ``buffer`` with the file's bytes from ``offset`` (of tensor ``name``)."""
        while buffer:
            got = os.preadv(self._fd, [buffer], offset)
            if not got:
                raise self._corrupted(f"it ends inside tensor {name!r}")
            buffer, offset = buffer[got:], offset + got

    def verify(self) -> None:
        """Wait for the hashes of the tensors read and raise :class:`CacheFileError` for the first one whose data
        does not match its checksum (the caller discards what it built from them)."""
        for name, digest in self._digests:
            if digest.result() != self.checksums.get(name):
                raise self._corrupted(f"the data of tensor {name!r} does not match its checksum")

    def close(self) -> None:
        """Stop the hashing and close the file."""
        self._hashing.close()
        os.close(self._fd)

    def __enter__(self) -> "CacheFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------- the cache
LAYOUT_SETTINGS = ("block_tokens", "selector")
"""Settings a loaded cache cannot change: they fix the blocks and summaries in the file."""


def save_cache(cache, path: Path, overwrite: bool) -> None:
    """Write ``cache`` (an :class:`~hf_offload.cache.OffloadCache`) to ``path``; see ``OffloadCache.save``."""
    from .. import __version__
    from .container import layer_types
    from .layer import OffloadLayer

    cache._check_usable()
    model = cache._model_ref()
    if model is None:
        raise RuntimeError("The model this OffloadCache was built for has been freed; save() fingerprints the model.")
    config = config_dict(cache.config)
    entries: list[Entry] = []
    layers = []
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, OffloadLayer):
            layers.append(_offload_entries(layer.blocks, f"layers.{i}", entries))
        else:
            layers.append(_sliding_entries(layer, f"layers.{i}", entries))
    state = {
        "hf_offload_version": __version__,
        "config": config,
        "fingerprint": model_fingerprint(model, cache.model_config, layer_types(cache.model_config)),
        "layers": layers,
    }
    metadata = {"hf_offload.format": FORMAT, "hf_offload.version": str(FORMAT_VERSION),
                "hf_offload.state": json.dumps(state, sort_keys=True)}  # fmt: skip
    write_file(path, entries, metadata, overwrite)


def _tensor_entry(name: str, tensor: torch.Tensor) -> Entry:
    """The entry of a small tensor (an open block, a summary, a table): one piece, the whole of it, where it is on
    the CPU (a view); else copied to the CPU when written, in pieces of at most ``_COPY_BYTES``."""

    def pieces() -> Iterator[torch.Tensor]:
        if tensor.device.type == "cpu":
            yield tensor.detach()
            return
        flat = tensor.detach().reshape(-1)
        step = max(1, _COPY_BYTES // flat.element_size())
        for start in range(0, flat.numel(), step):
            yield flat[start : start + step].cpu()

    return Entry(name, tensor.dtype, tuple(tensor.shape), pieces, copies=tensor.device.type != "cpu")


def _offload_entries(store, prefix: str, entries: list[Entry]) -> dict:
    """Append the tensors of an offloaded layer's block store to ``entries``; return its state."""
    if not store.is_initialized:
        return {"kind": "offload", "batch": None}
    store.wait_host_writes()  # the kernel path writes sealed blocks on a side stream
    used, index = torch.unique(store.block_table, return_inverse=True)
    host = store.host
    copied = bool(host.admitted_chunks or host.disk_chunks)  # runs of device or disk chunks are read into copies
    entries.append(Entry(f"{prefix}.blocks", store.dtype, (len(used), *host.block_shape),
                         lambda: host.runs(used, host.chunk_blocks), copies=copied))  # fmt: skip
    entries.append(_tensor_entry(f"{prefix}.block_table", index))
    for name, tensor in (("open_keys", store.keys), ("open_values", store.values)):
        entries.append(_tensor_entry(f"{prefix}.{name}", tensor))
    for name in sorted(store.summaries):
        entries.append(_tensor_entry(f"{prefix}.summaries.{name}", store.summaries[name]))
    return {
        "kind": "offload",
        "batch": store.batch,
        "kv_heads": store.kv_heads,
        "head_dim": store.head_dim,
        "dtype": str(store.dtype).removeprefix("torch."),
        "n_tokens": store.n_tokens,
        "n_blocks": store.n_blocks,
        "summaries": sorted(store.summaries),
    }


def _sliding_entries(layer, prefix: str, entries: list[Entry]) -> dict:
    """Append the tensors of a dense sliding-window layer to ``entries``; return its state."""
    state = {"kind": "sliding", "sliding_window": layer.sliding_window, "initialized": bool(layer.is_initialized),
             "cumulative_length": int(layer.cumulative_length)}  # fmt: skip
    if layer.is_initialized:
        for name in ("keys", "values"):
            entries.append(_tensor_entry(f"{prefix}.{name}", getattr(layer, name)))
    return state


def load_cache(cls, path: Path, model: torch.nn.Module, overrides: dict):
    """A new ``cls`` (:class:`~hf_offload.cache.OffloadCache`) for ``model`` holding the cache saved at ``path``;
    see ``OffloadCache.load``."""
    from ..config import OffloadConfig
    from .container import _check_model, layer_types

    fixed = sorted(set(overrides) & set(LAYOUT_SETTINGS))
    if fixed:
        raise ValueError(f"A loaded cache keeps the {', '.join(fixed)} it was saved with (they fix the blocks and "
                         "summaries in the file); leave them out, or prefill a new OffloadCache with them.")  # fmt: skip
    text_config = _check_model(model)
    with CacheFile(path) as file:
        state = file.state
        types = layer_types(text_config)
        check_fingerprint(state["fingerprint"], model, text_config, types, path)
        config = OffloadConfig(**state["config"])
        config = config.replace(**overrides) if overrides else config
        layers = state["layers"]
        _check_layers(file, layers, types, config.block_tokens)
        devices = _layer_devices(model)
        cache = cls(model, config=config)
        saved_level = cache.selector  # the file's summaries are this level's; a small device may coarsen on load
        try:
            for i, layer_state in enumerate(layers):
                device = devices.get(i, model.device)
                if layer_state["kind"] == "offload":
                    _load_offload(cache.layers[i], layer_state, file, f"layers.{i}", device, saved_level)
                else:
                    cache.layers[i] = _load_sliding(layer_state, file, f"layers.{i}", device)
            file.verify()
        except BaseException:
            cache.reset()  # frees the pools of the layers built so far: a failed load leaves no cache
            raise
    return cache


def _layer_devices(model: torch.nn.Module) -> dict[int, torch.device]:
    """The device of each decoder layer's parameters, by layer index (a model spread over devices)."""
    from ..patches.layers import decoder_layers

    devices = {}
    for module, idx in decoder_layers(model):
        param = next(module.parameters(), None)
        if param is not None:
            devices[idx] = param.device
    return devices


def _check_layers(file: CacheFile, layers: list[dict], types: list[str], block_tokens: int) -> None:
    """Raise :class:`CacheFileError` unless the file's layers are the model's and hold tensors of their shapes."""
    kinds = ["offload" if kind == "full_attention" else "sliding" for kind in types]
    if [layer["kind"] for layer in layers] != kinds:
        raise file._corrupted(f"its layers ({[layer['kind'] for layer in layers]}) are not the model's ({kinds})")
    for i, layer in enumerate(layers):
        prefix = f"layers.{i}"
        if layer["kind"] == "sliding":
            if layer["initialized"]:
                shape = file.shapes.get(f"{prefix}.keys")
                file.expect(f"{prefix}.keys", shape or ())
                file.expect(f"{prefix}.values", shape or ())
            continue
        if layer["batch"] is None:
            continue
        batch, heads, dim, n_blocks = layer["batch"], layer["kv_heads"], layer["head_dim"], layer["n_blocks"]
        dtype = getattr(torch, layer["dtype"])
        blocks = file.shapes.get(f"{prefix}.blocks") or (0,)
        file.expect(f"{prefix}.blocks", (blocks[0], 2, heads, block_tokens, dim), dtype)
        file.expect(f"{prefix}.block_table", (batch, n_blocks), torch.int64)
        left = layer["n_tokens"] - n_blocks * block_tokens
        if not 0 <= left < block_tokens:
            raise file._corrupted(f"layer {i} holds {layer['n_tokens']} tokens in {n_blocks} blocks of {block_tokens}")
        for name in ("open_keys", "open_values"):
            file.expect(f"{prefix}.{name}", (batch, heads, left, dim), dtype)
        for name in layer["summaries"]:
            shape = file.shapes.get(f"{prefix}.summaries.{name}") or ()
            if tuple(shape[:2]) != (batch, n_blocks):
                raise file._corrupted(f"summary {name!r} of layer {i} has shape {shape}")


def _load_offload(layer, state: dict, file: CacheFile, prefix: str, device: torch.device, saved_level) -> None:
    """Fill an empty offloaded layer from the file: host blocks run by run, then the tables, summaries and the open
    block (:meth:`~hf_offload.cache.blocks.BlockStore.adopt`).

    ``saved_level`` is the selector the file's summaries were made by. Where they would not fit the device room
    (``device_memory_gib``, or the process's free memory under ``admission="auto"``), the cache coarsens as it does
    while it fills (``coarsen_summaries``: the layers loaded so far re-encoded, the rest switched), and this layer's
    summaries are re-encoded from the file's level to the cache's before they go to the device."""
    if state["batch"] is None:
        return
    dtype = getattr(torch, state["dtype"])
    empty = torch.empty(state["batch"], state["kv_heads"], 0, state["head_dim"], dtype=dtype, device=device)
    layer.initialize_like(empty, empty)
    store = layer.blocks
    _check_summaries(store, state, file, prefix, saved_level)
    if state["n_blocks"] and state["summaries"]:
        # May coarsen the whole cache, this layer's selector included; the summaries of the layers loaded so far
        # must be whole first (read by the hashing threads: verify() waits for them).
        store.make_summary_room(state["n_blocks"], before_coarsening=file.verify)
    n_used = file.shapes[f"{prefix}.blocks"][0]
    # Run by run into the pool: with a disk tier, chunks of earlier runs spill while later ones are read.
    ids = file.fill(f"{prefix}.blocks", store.host)
    index = file.read(f"{prefix}.block_table")
    if index.numel() and not (0 <= int(index.min()) and int(index.max()) < n_used):
        raise file._corrupted(f"{prefix}.block_table refers to blocks past the {n_used} stored")
    open_k, open_v = file.read(f"{prefix}.open_keys"), file.read(f"{prefix}.open_values")  # in the file's order
    recode = store.selector != saved_level
    # Summaries read straight into the store's buffers (CPU, the file's level kept), else copied there.
    keep = store.device.type == "cpu" and not recode
    summaries = {}
    for name in state["summaries"]:
        key = f"{prefix}.summaries.{name}"
        if keep:
            n, shape = state["n_blocks"], file.shapes[key]
            buffer = torch.empty((shape[0], store.summary_capacity(n), *shape[2:]), dtype=file.dtype(key))
            buffer[:, n:] = 0
            file.read(key, out=buffer[:, :n])
            summaries[name] = buffer
        else:
            summaries[name] = file.read(key)
    level = saved_level
    while recode and level != store.selector:  # on the host, layer by layer: one layer's summaries held twice at most
        coarser = level.coarser()
        if coarser is None:
            raise RuntimeError(f"{prefix}: the cache's selector {store.selector!r} is not a coarser level of the "
                               f"file's {saved_level!r}")  # fmt: skip
        summaries = level.coarsen_summaries(summaries, coarser, store.head_dim, state["n_blocks"])
        level = coarser
    store.adopt(store.refer(ids, index), summaries, open_k, open_v, state["n_tokens"], keep_summaries=keep)


def _check_summaries(store, state: dict, file: CacheFile, prefix: str, saved_level) -> None:
    """Raise :class:`CacheFileError` unless the file's summaries are the ones ``saved_level`` (the selector the file
    names) makes (names, dtypes, shapes per block)."""
    if not state["n_blocks"]:
        return
    block = torch.zeros(store.batch, 1, store.kv_heads, store.block_tokens, store.head_dim, dtype=store.dtype,
                        device=store.device)  # fmt: skip
    made = {name: (s.dtype, tuple(s.shape[2:])) for name, s in store.summaries_of(block, block, saved_level).items()}
    saved = {}
    for name in state["summaries"]:
        saved[name] = (file.dtype(f"{prefix}.summaries.{name}"), file.shapes[f"{prefix}.summaries.{name}"][2:])
    if saved != made:
        raise CacheFileError(
            f"{file.path}: the block summaries of {prefix} ({sorted(saved)}) are not what selector "
            f"{saved_level.name!r} makes now ({sorted(made)}): the selector changed since the file was written. "
            "Load it with the hf-offload that wrote it, or prefill the prompt again."
        )


def _load_sliding(state: dict, file: CacheFile, prefix: str, device: torch.device):
    """A dense sliding-window layer (transformers' own) holding the file's keys and values."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    layer = DynamicSlidingWindowLayer(sliding_window=state["sliding_window"])
    if state["initialized"]:
        keys = file.read(f"{prefix}.keys").to(device)
        values = file.read(f"{prefix}.values").to(device)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        layer.cumulative_length = state["cumulative_length"]
    return layer
