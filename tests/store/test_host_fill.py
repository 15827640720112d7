"""HostBlockPool.fill: blocks read straight into the pool's chunks, run by run, all or nothing."""

import pytest
import torch

from hf_offload.store import HostBlockPool, HostMemoryBudget


def _pool() -> HostBlockPool:
    return HostBlockPool((2, 2, 4, 8), torch.float32, False, 4 * 512, HostMemoryBudget(None))  # 4 blocks per chunk


def _reader(blocks: torch.Tensor, views: list):
    def read(view: torch.Tensor) -> None:
        start = sum(len(v) for v in views)
        views.append(view)
        view.copy_(blocks[start : start + len(view)])

    return read


def test_fill_reads_runs_of_one_chunk_into_the_chunks_in_order():
    pool, blocks, views = _pool(), torch.randn(10, 2, 2, 4, 8), []
    ids = pool.fill(10, _reader(blocks, views))
    assert [len(v) for v in views] == [4, 4, 2]
    assert [v.data_ptr() for v in views] == [c.data_ptr() for c in pool.chunks]  # in place, no copy
    assert torch.equal(pool.read(ids), blocks)


def test_fill_takes_free_blocks_too():
    pool = _pool()
    pool.write(pool.allocate(6), torch.zeros(6, 2, 2, 4, 8))
    pool.free(torch.tensor([1, 2, 4]))
    blocks, views = torch.randn(5, 2, 2, 4, 8), []
    ids = pool.fill(5, _reader(blocks, views))
    assert torch.equal(pool.read(ids), blocks)
    assert pool.used_blocks == 8


def test_a_failed_fill_gives_its_blocks_back():
    pool, views = _pool(), []
    read = _reader(torch.randn(10, 2, 2, 4, 8), views)

    def failing(view: torch.Tensor) -> None:
        if views:
            raise OSError(5, "Input/output error")
        read(view)

    with pytest.raises(OSError, match="Input/output"):
        pool.fill(10, failing)
    assert pool.used_blocks == 0
