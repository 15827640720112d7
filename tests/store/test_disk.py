"""The disk tier on its own (no model): spilled chunks read back bit for bit, the least recently used chunk spills
first, staging stays within its bound, extents return when a pool lets go, and a chunk whose write fails stays."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from hf_offload.store import HostBlockPool, HostMemoryBudget
from hf_offload.store.disk import DiskTier, DiskTierError

SHAPE = (2, 2, 8, 16)  # [2, kv_heads, block_tokens, head_dim]
BLOCK_BYTES = 2 * 2 * 8 * 16 * 4
CHUNK = 4 * BLOCK_BYTES  # four blocks a chunk


def _pool(tmp_path, chunks_in_memory=2, staging_chunks=1):
    tier = DiskTier(str(tmp_path), None, staging_chunks, 2, False, CHUNK)
    budget = HostMemoryBudget(chunks_in_memory * CHUNK / 2**30, tier)
    return HostBlockPool(SHAPE, torch.float32, False, CHUNK, budget), tier


def _blocks(n, seed):
    return torch.randn((n, *SHAPE), generator=torch.Generator().manual_seed(seed))


def test_spilled_blocks_read_back_bit_for_bit(tmp_path):
    pool, tier = _pool(tmp_path)
    data = _blocks(24, 0)
    ids = pool.store(data.split(pool.chunk_blocks))
    assert pool.disk_chunks == 4 and pool.reserved_bytes == 2 * CHUNK  # six chunks, two in memory
    assert tier.used_bytes == 4 * CHUNK and os.path.getsize(tier.path) >= 4 * CHUNK
    order = torch.randperm(24, generator=torch.Generator().manual_seed(1))
    assert torch.equal(pool.read(ids[order]), data[order])
    heads = torch.randint(0, 2, (24,))
    assert torch.equal(pool.read(ids, heads=heads), data[torch.arange(24), :, heads])
    assert torch.equal(torch.cat(list(pool.runs(ids, 3))), data)
    assert tier.counters["read_blocks"] >= 16


def test_the_least_recently_used_chunk_spills_first(tmp_path):
    pool, tier = _pool(tmp_path, chunks_in_memory=3)
    ids = pool.store(_blocks(12, 2).split(pool.chunk_blocks))  # three chunks, all in memory
    assert pool.disk_chunks == 0
    pool.read(ids[:1])  # chunk 0 used: chunk 1 is now the least recently used
    pool.store(_blocks(4, 3).split(pool.chunk_blocks))
    assert [d is not None for d in pool.chunk_disk] == [False, True, False, False]


def test_staging_stays_within_its_bound_and_a_forecast_is_found_there(tmp_path):
    pool, tier = _pool(tmp_path, staging_chunks=1)
    data = _blocks(24, 4)
    ids = pool.store(data.split(pool.chunk_blocks))
    assert torch.equal(pool.read(ids), data)  # 16 blocks on disk through 4 staging slots
    staging = next(iter(tier._staging.values()))
    assert staging.n_slots == 4 and len(staging.entries) <= 4 and tier.staging_bytes() == CHUNK
    hits = tier.counters["staging_hits"]
    pool.stage(ids[:3])
    assert torch.equal(pool.read(ids[:3]), data[:3])
    assert tier.counters["staging_hits"] == hits + 3 and tier.counters["staged_ahead_blocks"] == 3


def test_freed_chunks_give_their_extents_back_and_release_removes_everything(tmp_path):
    pool, tier = _pool(tmp_path)
    ids = pool.store(_blocks(24, 5).split(pool.chunk_blocks))
    pool.free(ids[:4])  # chunk 0, on disk, wholly free
    assert tier.used_bytes == 3 * CHUNK and pool.chunk_disk[0] == (-1, 0)
    assert pool.disk_used_bytes() == 12 * BLOCK_BYTES
    new = pool.allocate(1)
    assert int(new) >= 24  # spilled ids are never handed out again
    pool.release()
    assert tier.used_bytes == 0 and pool.budget.reserved_bytes == 0
    tier.close()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_the_chunk_in_memory(tmp_path, monkeypatch):
    pool, tier = _pool(tmp_path)
    ids = pool.store(_blocks(8, 6).split(pool.chunk_blocks))

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(os, "posix_fallocate", lambda *args: None)
    with pytest.raises(DiskTierError, match="No space left"):
        pool.store(_blocks(8, 7).split(pool.chunk_blocks))
    assert pool.disk_chunks == 0 and pool.used_blocks == 8 and tier.used_bytes == 0
    monkeypatch.undo()
    assert torch.equal(pool.read(ids), _blocks(8, 6))
