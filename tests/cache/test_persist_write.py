"""How OffloadCache.save writes its file: several tensors written and hashed at once, also when their pieces are
copies (blocks of device chunks, tensors on the device), with the copies held bounded; the file the same byte for
byte whatever the number of threads; any failure or interrupt stops every thread, leaves nothing and raises the
error."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
import time
import weakref

import pytest
import torch
from safetensors.torch import load_file

from hf_offload import OffloadCache
from hf_offload.cache import persist
from hf_offload.cache.persist import Entry, write_file

from ..helpers import build_model
from .test_persist import BUDGETS, _prefilled, continue_recorded

PIECE = 4096  # bytes of each piece of the entries below
METADATA = {"hf_offload.format": persist.FORMAT, "hf_offload.version": str(persist.FORMAT_VERSION)}


def _tensors(n_entries: int = 6, pieces: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sizes = [pieces * PIECE - (i % 3) * 7 for i in range(n_entries)]  # some end in a short piece
    return {f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for i, n in enumerate(sizes)}


class _Live:
    """Bytes of the copies made by :func:`_copied` that are still alive, and the most at once."""

    lock = threading.Lock()
    now = most = 0

    @staticmethod
    def add(nbytes: int) -> None:
        with _Live.lock:
            _Live.now += nbytes
            _Live.most = max(_Live.most, _Live.now)


def _copied(name: str, tensor: torch.Tensor, pieces=None) -> Entry:
    """An entry whose pieces are copies made as they are taken (as device-to-host copies are), counted while alive
    (:class:`_Live`)."""

    def copies():
        for start in range(0, tensor.numel(), PIECE):
            piece = tensor[start : start + PIECE].clone()
            _Live.add(piece.numel())
            weakref.finalize(piece, _Live.add, -piece.numel())
            yield piece
            del piece
            yield tensor[:0].view(2, 0, 3)  # an empty piece between each: nothing to write

    return Entry(name, tensor.dtype, tuple(tensor.shape), pieces or copies, copies=True)


class _Recording:
    """The file's checksum, whose updates each take a few ms and record how many digests are updated at once."""

    lock = threading.Lock()
    active = most = 0

    def __init__(self):
        self._digest = persist._Crc32()

    def update(self, data) -> None:
        with _Recording.lock:
            _Recording.active += 1
            _Recording.most = max(_Recording.most, _Recording.active)
        time.sleep(0.002)
        self._digest.update(data)
        with _Recording.lock:
            _Recording.active -= 1

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def _save_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hf-offload-save")]


def test_entries_of_copies_are_hashed_several_at_once_with_copies_held_bounded(tmp_path, monkeypatch):
    tensors = _tensors()
    entries = [_copied(name, tensor) for name, tensor in tensors.items()]
    monkeypatch.setattr(persist, "_HASH_THREADS", 1)
    write_file(tmp_path / "serial.safetensors", entries, METADATA, overwrite=False)

    held_bytes = 8 * PIECE  # a few pieces: far fewer than one entry's
    monkeypatch.setattr(persist, "_HASH_THREADS", 4)
    monkeypatch.setattr(persist, "_HELD_BYTES", held_bytes)
    monkeypatch.setitem(persist._CHECKSUMS, persist.CHECKSUM, _Recording)
    _Recording.most = _Live.most = 0
    write_file(tmp_path / "parallel.safetensors", entries, METADATA, overwrite=False)
    monkeypatch.undo()

    assert _Recording.most >= 3  # one writer waiting on each copy's hash hashes one entry (and the last's tail)
    assert _Live.now == 0 and 0 < _Live.most <= held_bytes + PIECE  # copies alive: at most one piece past the bound
    data = (tmp_path / "parallel.safetensors").read_bytes()
    assert hashlib.sha256(data).digest() == hashlib.sha256((tmp_path / "serial.safetensors").read_bytes()).digest()
    loaded = load_file(tmp_path / "parallel.safetensors")
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    checksums = json.loads(header["__metadata__"]["hf_offload.checksums"])
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name
        assert checksums[name] == f"{zlib.crc32(tensor.numpy().tobytes()):08x}", name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parallel.safetensors", "serial.safetensors"]
    assert not _save_threads()


def test_a_cache_of_copied_pieces_saves_the_same_file_and_continues_exactly(tmp_path, monkeypatch):
    model = build_model("gemma3")  # offloaded and dense sliding-window layers
    cache, ids, mask = _prefilled(model, BUDGETS["full"])
    cache.save(tmp_path / "views.safetensors")

    class Copied(Entry):  # every piece a copy held until written and hashed, as on a device
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pieces, self.copies = self.pieces, True
            self.pieces = lambda: (piece.clone() for piece in pieces())

    monkeypatch.setattr(persist, "Entry", Copied)
    monkeypatch.setattr(persist, "_HASH_THREADS", 4)
    monkeypatch.setattr(persist, "_HELD_BYTES", 1024)
    cache.save(tmp_path / "copies.safetensors")
    monkeypatch.undo()

    views, copies = (tmp_path / "views.safetensors").read_bytes(), (tmp_path / "copies.safetensors").read_bytes()
    assert hashlib.sha256(copies).digest() == hashlib.sha256(views).digest()
    loaded = OffloadCache.load(tmp_path / "copies.safetensors", model)
    got = continue_recorded(model, loaded, ids, mask)
    assert got == continue_recorded(model, cache, ids, mask)


def test_an_error_in_one_entry_stops_every_thread_and_leaves_nothing(tmp_path, monkeypatch):
    tensors = _tensors(n_entries=8, pieces=32)

    def failing():
        yield tensors["t2"][:PIECE].clone()
        time.sleep(0.01)  # the other threads are writing their entries meanwhile
        raise ValueError("a piece failed")

    entries = [_copied(name, tensor, failing if name == "t2" else None) for name, tensor in tensors.items()]
    monkeypatch.setattr(persist, "_HASH_THREADS", 4)
    monkeypatch.setattr(persist, "_HELD_BYTES", 4 * PIECE)
    with pytest.raises(ValueError, match="a piece failed"):
        write_file(tmp_path / "cache.safetensors", entries, METADATA, overwrite=False)
    assert list(tmp_path.iterdir()) == [] and not _save_threads()


def test_a_failed_write_or_a_changed_cache_leaves_nothing(tmp_path, monkeypatch):
    tensors = _tensors()
    entries = [_copied(name, tensor) for name, tensor in tensors.items()]
    monkeypatch.setattr(persist, "_HASH_THREADS", 4)
    pwrite, calls = os.pwrite, []

    def full_disk(fd, data, offset):
        calls.append(offset)
        if len(calls) > 10:
            raise OSError(28, "No space left on device")
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_file(tmp_path / "cache.safetensors", entries, METADATA, overwrite=False)
    monkeypatch.setattr(os, "pwrite", pwrite)
    assert list(tmp_path.iterdir()) == [] and not _save_threads()

    for grown in (PIECE, -PIECE):  # more bytes than the header gave the tensor (never written past it), or fewer
        bigger = torch.zeros(tensors["t1"].numel() + grown, dtype=torch.uint8)
        changed = [_copied(name, bigger if name == "t1" else tensor) for name, tensor in tensors.items()]
        changed[1].shape = tuple(tensors["t1"].shape)  # the shape the header was written with
        with pytest.raises(RuntimeError, match="the cache changed while it was saved"):
            write_file(tmp_path / "cache.safetensors", changed, METADATA, overwrite=False)
        assert list(tmp_path.iterdir()) == [] and not _save_threads()


def test_an_interrupt_stops_every_thread_and_leaves_nothing(tmp_path, monkeypatch):
    tensors = _tensors(n_entries=8, pieces=64)
    entries = [_copied(name, tensor) for name, tensor in tensors.items()]
    monkeypatch.setattr(persist, "_HASH_THREADS", 4)
    monkeypatch.setitem(persist._CHECKSUMS, persist.CHECKSUM, _Recording)  # slow: still writing

    def interrupted(*args, **kwargs):
        time.sleep(0.02)
        raise KeyboardInterrupt

    monkeypatch.setattr(persist, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_file(tmp_path / "cache.safetensors", entries, METADATA, overwrite=False)
    assert list(tmp_path.iterdir()) == [] and not _save_threads()
