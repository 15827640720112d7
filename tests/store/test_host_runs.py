"""HostBlockPool.runs: blocks streamed out as runs of consecutive ids within one chunk, views of the chunks."""

import torch

from hf_offload.store import HostBlockPool, HostMemoryBudget


def test_runs_are_the_blocks_in_order_split_at_chunks_gaps_and_the_limit():
    pool = HostBlockPool((2, 2, 4, 8), torch.float32, False, 4 * 512, HostMemoryBudget(None))  # 4 blocks per chunk
    ids = pool.allocate(12)
    blocks = torch.randn(12, 2, 2, 4, 8)
    pool.write(ids, blocks)
    order = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9, 8, 10, 11])
    runs = list(pool.runs(order, max_blocks=3))
    assert [len(run) for run in runs] == [3, 1, 3, 1, 1, 2]  # the limit, the chunk end, a gap, out of order
    assert torch.equal(torch.cat(runs), blocks[order])
    assert runs[0].data_ptr() == pool.chunks[0].data_ptr()  # host chunks are read in place
