"""The slot-assignment kernel gives the slots, misses and pool state of the torch code, bit for bit, over sequences
of random assignments (hits, misses, entries not kept, speculative ones that do not touch, shared and per-head
selections). Runs where Triton can run: on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch

from hf_offload.kernels.slots import MAX_SLOTS, assign_supported
from hf_offload.store import DeviceSlotPool

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton


def _pools(batch, heads, slots):
    pools = []
    for use_kernel in (True, False):
        pool = DeviceSlotPool(batch, slots, heads, 2, 4, torch.float32, DEVICE)
        pool.use_kernel = use_kernel
        pools.append(pool)
    return pools


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("slots,n", [(12, 5), (160, 127), (40, 40), (7, 1)])
def test_assign_kernel_matches_the_torch_code(shared, slots, n):
    g = torch.Generator().manual_seed(slots * 7 + n)
    batch, heads, universe = 3, 4, slots * 3
    kernel_pool, torch_pool = _pools(batch, heads, slots)
    assert assign_supported(DEVICE, slots, n)
    for step in range(12):
        rows = 1 if shared else heads
        # n distinct blocks per row out of the universe (random, so some are resident and some not)
        blocks = torch.rand(batch, rows, universe, generator=g).argsort(-1)[..., :n]
        keep = torch.rand(batch, rows, n, generator=g) > 0.2
        touch = step % 4 != 3  # every fourth: a speculative assignment
        blocks, keep = blocks.to(DEVICE), keep.to(DEVICE)
        got = kernel_pool.assign(blocks, keep, touch=touch)
        want = torch_pool.assign(blocks, keep, touch=touch)
        assert torch.equal(got[1], want[1]), step
        assert torch.equal(got[0], want[0]), step
        assert torch.equal(kernel_pool.block, torch_pool.block), step
        assert torch.equal(kernel_pool.last_used, torch_pool.last_used), step
        assert torch.equal(kernel_pool.clock, torch_pool.clock), step
    assert (kernel_pool.block >= 0).any()  # the pool filled up


def test_assign_kernel_limits():
    assert not assign_supported(DEVICE, MAX_SLOTS + 1, 4)
    assert not assign_supported(DEVICE, 16, 17)
    assert not assign_supported(DEVICE, 16, 0)
    assert not assign_supported(torch.device("meta"), 16, 4)
