"""Slot assignment of the device slot pool (hit/miss, LRU victims, bookkeeping) in one launch.

:meth:`~hf_offload.store.DeviceSlotPool.assign` in torch is about seventeen small operations (a compare of every
wanted block with every slot, a sort of the slots by last use, a cumulative sum that ranks the misses, two scatters);
inside a decode step's CUDA graph each is a kernel of a few microseconds, the sort the longest of them. Here one program handles one (sequence, KV head) row of the pool: it loads the row's slots and the wanted blocks,
finds hits, ranks the unprotected slots by last use by counting (no sort: each slot's rank is the number of slots
before it in (last use, slot) order), gives the i-th miss the i-th of them and writes the row's new state. The
result, and the pool's state after it, are those of the torch code (``DeviceSlotPool.assign_reference``), which the
tests compare bit for bit. The pool runs it on CUDA (``DeviceSlotPool.use_kernel``); the tests also run it on the
CPU under Triton's interpreter.

On CUDA the same computation runs as a CUDA kernel compiled at run time (:data:`CUDA_SOURCE`, through
:class:`~hf_offload.kernels.nvrtc.RuntimeKernel`): one program of up to 256 threads per row, the row's slots in shared
memory, each thread one wanted block (its hit found by one pass over the slots) and one slot (its rank by one pass
over the slots' keys, then written to a rank-to-slot table that the misses read). The Triton kernel compares every
slot with every slot as one [slots, slots] tensor in a single program, which at 128 to 256 slots costs tens of
microseconds per decode step and layer; the CUDA kernel's passes are shared-memory loops of one thread per entry.
"""

from __future__ import annotations

import torch

from .gather import kernels_available, tl, triton
from .nvrtc import RuntimeKernel

MAX_SLOTS = 256
"""Most slots per row (and wanted blocks per row) the kernel takes; above it the torch code runs (the kernel's
compare of every slot with every slot grows with the square of the row)."""


CUDA_SOURCE = r"""
// One program of THREADS threads per (sequence, KV head) row of the pool; THREADS >= S >= N, a multiple of 32.
// block, used: int64 [B, H, S + 1]; blocks: int64 [B, HB, N]; keep: uint8 [B, HB, N]; slots: int64 [B, H, N] and
// miss: uint8 [B, H, N], written. Every read of block / used comes before the first barrier, every write after it.
extern "C" __global__ void __launch_bounds__(THREADS) assign_slots(
    long long* __restrict__ block, long long* __restrict__ used, const long long* __restrict__ clock,
    const long long* __restrict__ blocks, const unsigned char* __restrict__ keep, long long* __restrict__ out_slots,
    unsigned char* __restrict__ out_miss, int heads, int blocks_heads, int S, int N, int touch) {
    __shared__ long long held[THREADS];
    __shared__ long long key[THREADS];
    __shared__ int guarded[THREADS];
    __shared__ int victim[THREADS];
    __shared__ unsigned totals[THREADS / 32];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const long long row = blockIdx.x, b = row / heads, h = row - b * heads, hb = h % blocks_heads;
    const long long base = row * (S + 1);
    long long last = 0;
    if (t < S) {
        held[t] = block[base + t];
        last = used[base + t];
    }
    guarded[t] = 0;
    long long want = 0;
    bool kept = false;
    if (t < N) {
        const long long at = (b * blocks_heads + hb) * N + t;
        want = blocks[at];
        kept = keep[at] != 0;
    }
    const long long wanted = kept ? want : -2;  // entries not kept look for block -2, which no slot holds
    __syncthreads();
    // Hit: the first slot holding the wanted block; every slot holding a wanted block is protected from eviction.
    int hit_slot = S;
    if (t < N) {
        for (int s = 0; s < S; ++s) {
            if (held[s] == wanted) {
                hit_slot = min(hit_slot, s);
                guarded[s] = 1;
            }
        }
    }
    const bool miss = kept && hit_slot == S;
    __syncthreads();
    // Eviction order: (protected, last use, slot) ascending, as one integer key per slot.
    if (t < S) key[t] = (static_cast<long long>(guarded[t]) << 62) | ((last + 1) << 9) | t;
    // The misses' ranks in entry order (an exclusive scan over the threads).
    unsigned incl = miss ? 1u : 0u;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    if (lane == 31) totals[warp] = incl;
    __syncthreads();
    if (t < S) {  // the slot of rank r is the r-th victim
        const long long mine = key[t];
        int rank = 0;
        for (int s = 0; s < S; ++s) rank += key[s] < mine ? 1 : 0;
        victim[rank] = t;
    }
    unsigned before = 0;
    for (int w = 0; w < warp; ++w) before += totals[w];
    __syncthreads();
    if (t < N) {
        const long long slot = miss ? victim[before + incl - 1] : (hit_slot < S ? hit_slot : 0);
        out_slots[row * N + t] = slot;
        out_miss[row * N + t] = miss ? 1 : 0;
        if (miss) block[base + slot] = want;
        if (touch) {
            if (kept) used[base + slot] = *clock;
        } else if (miss) {
            used[base + slot] = -1;
        }
    }
}
"""

_CUDA = RuntimeKernel(CUDA_SOURCE, "assign_slots", "slot assignment", "the Triton kernel")

BACKEND: str | None = None
"""Which kernel :func:`assign_slots` runs on CUDA: ``None`` (the CUDA kernel where it compiles, else Triton),
``"cuda"`` or ``"triton"`` (read at each call; the tests and the benchmark run both)."""


def _cuda_threads(slots: int) -> int:
    """Threads of the CUDA kernel's program for rows of ``slots`` slots: a power of two >= 32."""
    return max(32, 1 << (slots - 1).bit_length())


def cuda_assign_supported(device: torch.device, slots: int, n: int) -> bool:
    """Whether :func:`assign_slots` runs the CUDA kernel for a pool of ``slots`` slots per row and ``n`` wanted
    blocks per row on ``device`` (an NVIDIA GPU of compute capability 8.0 or newer, ``0 < n <= slots <=``
    :data:`MAX_SLOTS`, :data:`BACKEND` not ``"triton"``, and the kernel compiles)."""
    if BACKEND == "triton" or not 0 < n <= slots <= MAX_SLOTS or not _CUDA.runs_on(device):
        return False
    return _CUDA.get(THREADS=_cuda_threads(slots)) is not None


def assign_supported(device: torch.device, slots: int, n: int) -> bool:
    """Whether :func:`assign_slots` runs for a pool of ``slots`` slots per row and ``n`` wanted blocks per row on
    ``device`` (the CUDA kernel or Triton there; both at most :data:`MAX_SLOTS`)."""
    if not 0 < n <= slots <= MAX_SLOTS:
        return False
    return (BACKEND != "cuda" and kernels_available(device)) or cuda_assign_supported(device, slots, n)


if triton is not None:

    @triton.jit
    def _assign_kernel(
        block_ptr,  # int64 [B, H, S + 1]: block per slot (-1 empty); column S takes the writes of unchanged entries
        used_ptr,  # int64 [B, H, S + 1]: last use per slot
        clock_ptr,  # int64 []: the clock after this call's tick
        blocks_ptr,  # int64 [B, HB, N]: wanted blocks
        keep_ptr,  # bool [B, HB, N]: wanted at all
        slots_ptr,  # int64 [B, H, N]: out, slot per entry
        miss_ptr,  # bool [B, H, N]: out, kept entries that were not resident
        heads,
        blocks_heads,  # HB: 1 (a selection shared by all heads) or heads
        S: tl.constexpr,
        N: tl.constexpr,
        SP: tl.constexpr,
        NP: tl.constexpr,
        TOUCH: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # b * heads + h
        b = row // heads
        h = row % heads
        hb = h % blocks_heads  # a shared selection (one row for all heads): 0
        s = tl.arange(0, SP)
        live_s = s < S
        i = tl.arange(0, NP)
        live_i = i < N
        held = tl.load(block_ptr + row * (S + 1) + s, mask=live_s, other=-3)  # -3: matches nothing
        last = tl.load(used_ptr + row * (S + 1) + s, mask=live_s, other=0)
        at = (b * blocks_heads + hb) * N + i
        want = tl.load(blocks_ptr + at, mask=live_i, other=0)
        keep = (tl.load(keep_ptr + at, mask=live_i, other=0) != 0) & live_i
        wanted = tl.where(keep, want, -2)  # entries not kept look for block -2, which no slot holds
        match = held[None, :] == wanted[:, None]  # [NP, SP]
        hit = tl.max(match.to(tl.int32), axis=1) > 0
        hit_slot = tl.min(tl.where(match, s[None, :], SP), axis=1)
        hit_slot = tl.where(hit, hit_slot, 0)
        miss = keep & ~hit
        # Slots holding a wanted block are protected: they rank after every other slot (as last use "never").
        protected = (tl.max(match.to(tl.int32), axis=0) > 0) | ~live_s
        # Rank of each slot in (protected, last use, slot) order: how many slots come before it. The order is that
        # of one integer key per slot (protected in bit 62, last use + 1 >= 0 above the slot's 9 bits), so each pair
        # of slots costs one comparison.
        key = (protected.to(tl.int64) << 62) | ((last + 1) << 9) | s.to(tl.int64)
        rank_s = tl.sum((key[None, :] < key[:, None]).to(tl.int32), axis=1)  # [SP]: slots before each slot
        # The i-th miss (0-based, in entry order) takes the slot of rank i.
        rank_i = tl.cumsum(miss.to(tl.int32), axis=0) - 1
        rank_i = tl.maximum(rank_i, 0)
        victim = tl.sum(tl.where(rank_s[None, :] == rank_i[:, None], s[None, :], 0), axis=1)
        slot = tl.where(miss, victim, hit_slot)
        out = row * N + i
        tl.store(slots_ptr + out, slot, mask=live_i)
        tl.store(miss_ptr + out, miss, mask=live_i)
        filled = tl.where(miss, slot, S)
        tl.store(block_ptr + row * (S + 1) + filled, want, mask=live_i & miss)
        if TOUCH:
            clock = tl.load(clock_ptr)
            used = tl.where(keep, slot, S)
            tl.store(used_ptr + row * (S + 1) + used, tl.zeros_like(used) + clock, mask=live_i & keep)
        else:
            tl.store(used_ptr + row * (S + 1) + filled, tl.zeros_like(filled) - 1, mask=live_i & miss)


def assign_slots(
    block: torch.Tensor,
    last_used: torch.Tensor,
    clock: torch.Tensor,
    blocks: torch.Tensor,
    keep: torch.Tensor,
    touch: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`~hf_offload.store.DeviceSlotPool.assign` in one launch (after ``clock`` has ticked, if ``touch``): the
    CUDA kernel where :func:`cuda_assign_supported`, else the Triton kernel.

    Args:
        block: block per slot, ``[batch, kv_heads, slots + 1]``, ``torch.int64``, contiguous (the pool's, with its
            extra column); updated in place.
        last_used: last use per slot, same shape, dtype and layout; updated in place.
        clock: the pool's clock, 0-d ``torch.int64``, same device (already advanced for this call when ``touch``).
        blocks: wanted blocks, ``[batch, 1 or kv_heads, n]``, ``torch.int64``, same device.
        keep: which entries are wanted at all, same shape, ``torch.bool``.
        touch: mark the kept entries used at ``clock`` (else: filled slots rank as never used).

    Returns:
        ``(slots, miss)``, ``[batch, kv_heads, n]``, ``torch.int64`` and ``torch.bool``.
    """
    batch, heads, width = block.shape
    slots, n = width - 1, blocks.shape[-1]
    blocks = blocks.contiguous()
    keep = keep.contiguous()
    out_slots = torch.empty((batch, heads, n), dtype=torch.int64, device=block.device)
    out_miss = torch.empty((batch, heads, n), dtype=torch.bool, device=block.device)
    if cuda_assign_supported(block.device, slots, n):
        threads = _cuda_threads(slots)
        _CUDA.get(THREADS=threads)(grid=(batch * heads, 1, 1), block=(threads, 1, 1),
                                   args=[block, last_used, clock, blocks, keep.view(torch.uint8), out_slots,
                                         out_miss.view(torch.uint8), heads, blocks.shape[1], slots, n, int(touch)])
        return out_slots, out_miss
    _assign_kernel[(batch * heads,)](
        block, last_used, clock, blocks, keep, out_slots, out_miss, heads, blocks.shape[1],
        S=slots, N=n, SP=triton.next_power_of_2(slots), NP=triton.next_power_of_2(n), TOUCH=touch, num_warps=8,
    )  # fmt: skip
    return out_slots, out_miss
