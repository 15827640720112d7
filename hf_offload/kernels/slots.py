"""Slot assignment of the device slot pool (hit/miss, LRU victims, bookkeeping) in one launch.

:meth:`~hf_offload.store.DeviceSlotPool.assign` in torch is about seventeen small operations (a compare of every
wanted block with every slot, a sort of the slots by last use, a cumulative sum that ranks the misses, two scatters);
inside a decode step's CUDA graph each is a kernel of a few microseconds, the sort the longest of them. Here one program handles one (sequence, KV head) row of the pool: it loads the row's slots and the wanted blocks,
finds hits, ranks the unprotected slots by last use by counting (no sort: each slot's rank is the number of slots
before it in (last use, slot) order), gives the i-th miss the i-th of them and writes the row's new state. The
result, and the pool's state after it, are those of the torch code (``DeviceSlotPool.assign_reference``), which the
tests compare bit for bit. The pool runs it on CUDA (``DeviceSlotPool.use_kernel``); the tests also run it on the
CPU under Triton's interpreter.
"""

from __future__ import annotations

import torch

from .gather import kernels_available, tl, triton

MAX_SLOTS = 256
"""Most slots per row (and wanted blocks per row) the kernel takes; above it the torch code runs (the kernel's
compare of every slot with every slot grows with the square of the row)."""


def assign_supported(device: torch.device, slots: int, n: int) -> bool:
    """Whether :func:`assign_slots` runs for a pool of ``slots`` slots per row and ``n`` wanted blocks per row on
    ``device`` (Triton there; both at most :data:`MAX_SLOTS`)."""
    return kernels_available(device) and 0 < n <= slots <= MAX_SLOTS


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
    """:meth:`~hf_offload.store.DeviceSlotPool.assign` in one launch (after ``clock`` has ticked, if ``touch``).

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
    _assign_kernel[(batch * heads,)](
        block, last_used, clock, blocks, keep, out_slots, out_miss, heads, blocks.shape[1],
        S=slots, N=n, SP=triton.next_power_of_2(slots), NP=triton.next_power_of_2(n), TOUCH=touch, num_warps=8,
    )  # fmt: skip
    return out_slots, out_miss
