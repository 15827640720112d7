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


def _assign_both(kernel_pool, torch_pool, blocks, keep, touch, step):
    """Assign ``blocks`` in both pools; the slots, misses and pool state must be the same. Returns the kernel's."""
    blocks, keep = blocks.to(DEVICE), keep.to(DEVICE)
    got = kernel_pool.assign(blocks, keep, touch=touch)
    want = torch_pool.assign(blocks, keep, touch=touch)
    assert torch.equal(got[1], want[1]), step
    assert torch.equal(got[0], want[0]), step
    assert torch.equal(kernel_pool.block, torch_pool.block), step
    assert torch.equal(kernel_pool.last_used, torch_pool.last_used), step
    assert torch.equal(kernel_pool.clock, torch_pool.clock), step
    return got


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
        _assign_both(kernel_pool, torch_pool, blocks, keep, touch, step)
    assert (kernel_pool.block >= 0).any()  # the pool filled up


@pytest.mark.parametrize("shared", [True, False])
def test_assign_kernel_matches_at_the_decode_shape(shared):
    """The shape of a batch-1 decode at 128K tokens (8 KV heads, 160 slots, 128 wanted blocks per row), with the
    selections of consecutive decode steps: each wants about three quarters of the previous one's blocks again."""
    g = torch.Generator().manual_seed(160 + shared)
    batch, heads, slots, n, universe = 1, 8, 160, 128, 8192
    rows = 1 if shared else heads
    kernel_pool, torch_pool = _pools(batch, heads, slots)
    assert assign_supported(DEVICE, slots, n)
    blocks = torch.rand(batch, rows, universe, generator=g).argsort(-1)[..., :n]
    for step in range(10):
        keep = torch.rand(batch, rows, n, generator=g) > 0.05
        touch = step % 4 != 3
        got = _assign_both(kernel_pool, torch_pool, blocks, keep, touch, step)
        # the next selection: three quarters of these blocks (a random choice) and new ones outside them
        again = blocks.gather(-1, torch.rand(batch, rows, n, generator=g).argsort(-1)[..., : n * 3 // 4])
        score = torch.rand(batch, rows, universe, generator=g).scatter_(-1, blocks, 2.0)
        fresh = score.topk(n - again.shape[-1], dim=-1, largest=False).indices
        blocks = torch.cat([again, fresh], -1)
    assert got[1].any() and not got[1].all()  # hits and misses
    assert (kernel_pool.block >= 0).all()  # the pool filled up


def test_assign_kernel_matches_with_block_ids_beyond_int32():
    """Rows with a block id outside int32 compare in int64: ids that share their low 32 bits stay apart."""
    g = torch.Generator().manual_seed(3)
    batch, heads, slots, n, universe = 2, 2, 24, 10, 60
    kernel_pool, torch_pool = _pools(batch, heads, slots)
    for step in range(8):
        blocks = torch.rand(batch, heads, universe, generator=g).argsort(-1)[..., :n]
        # in the first sequence about half the ids move up by 2**32 (the same block can come back as the other
        # id, equal in the low 32 bits); the second sequence's stay small
        blocks[0] += (torch.rand(heads, n, generator=g) < 0.5).long() << 32
        keep = torch.rand(batch, heads, n, generator=g) > 0.2
        touch = step % 4 != 3
        _assign_both(kernel_pool, torch_pool, blocks, keep, touch, step)
    assert (kernel_pool.block[0] >= 2**32).any()


def test_assign_kernel_limits():
    assert not assign_supported(DEVICE, MAX_SLOTS + 1, 4)
    assert not assign_supported(DEVICE, 16, 17)
    assert not assign_supported(DEVICE, 16, 0)
    assert not assign_supported(torch.device("meta"), 16, 4)


def test_a_triton_without_gather_or_a_masked_histogram_assigns_in_torch(monkeypatch):
    """Triton before 3.4 (torch before 2.8) lacks ``tl.gather`` or ``tl.histogram``'s mask: the pool assigns in
    torch there, with the same result."""
    from hf_offload.kernels import slots as slots_module

    monkeypatch.setattr(slots_module, "LANGUAGE_SUPPORTED", False)
    assert not assign_supported(DEVICE, 160, 128)
    pool, reference = _pools(1, 2, 12)
    g = torch.Generator().manual_seed(5)
    for step in range(4):
        blocks = torch.rand(1, 1, 36, generator=g).argsort(-1)[..., :5].to(DEVICE)
        keep = torch.ones(1, 1, 5, dtype=torch.bool, device=DEVICE)
        got, want = pool.assign(blocks, keep), reference.assign(blocks, keep)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), step
    assert torch.equal(pool.block, reference.block)
