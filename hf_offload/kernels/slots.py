"""Slot assignment of the device slot pool (hit/miss, LRU victims, bookkeeping) in one launch.

:meth:`~hf_offload.store.DeviceSlotPool.assign` in torch is about seventeen small operations (a compare of every
wanted block with every slot, a sort of the slots by last use, a cumulative sum that ranks the misses, two scatters);
inside a decode step's CUDA graph each is a kernel of a few microseconds, the sort the longest of them. Here one
program (four warps) handles one (sequence, KV head) row of the pool:

- Hits: every wanted block against every slot, 16 slots at a time (``[16, n]`` tiles, the loop unrolled), keeping
  the lowest matching slot per entry. The compares are int32 where every block of the row and every wanted block
  fits in int32 (block ids do), int64 otherwise (a plain loop), so ids that share their low 32 bits stay apart.
- Protected slots (those holding a wanted block, never victims) are the hit slots, marked by a histogram of them: a
  block is in at most one slot per row, as ``assign`` keeps it while the kept entries of a row are distinct.
- Victims: one int64 key per slot, (protected, last use + 1, slot) from the high bits down, the slot in the low 9
  bits; the keys are sorted (a bitonic sort within the program) and the i-th miss (in entry order) takes the slot in
  the low bits of the i-th key (a gather by the misses' cumulative count).
- Bookkeeping: the new blocks and last uses go straight into the row's slots (masked stores; the extra column,
  which takes the torch code's writes of unchanged entries, is not written).

The result, and the pool's state after it, are those of the torch code (``DeviceSlotPool.assign_reference``), which
the tests compare bit for bit. The pool runs it on CUDA (``DeviceSlotPool.use_kernel``); the tests also run it on the
CPU under Triton's interpreter.
"""

from __future__ import annotations

import inspect

import torch

from .gather import kernels_available, tl, triton

MAX_SLOTS = 256
"""Most slots per row (and wanted blocks per row) the kernel takes; above it the torch code runs (a sort key holds
the slot in 9 bits, and the search for hits, unrolled over the slots, compares every wanted block with every slot)."""


def _language_supported() -> bool:
    """Whether this Triton has what the kernel uses: ``tl.gather`` and ``tl.histogram``'s ``mask`` (Triton 3.4 on;
    with an older one, which torch before 2.8 brings, the pool assigns in torch)."""
    if tl is None or not hasattr(tl, "gather"):
        return False
    try:
        return "mask" in inspect.signature(tl.histogram).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


LANGUAGE_SUPPORTED = _language_supported()


def assign_supported(device: torch.device, slots: int, n: int) -> bool:
    """Whether :func:`assign_slots` runs for a pool of ``slots`` slots per row and ``n`` wanted blocks per row on
    ``device`` (Triton 3.4 or later there, :data:`LANGUAGE_SUPPORTED`; both at most :data:`MAX_SLOTS`)."""
    return LANGUAGE_SUPPORTED and kernels_available(device) and 0 < n <= slots <= MAX_SLOTS


if triton is not None:

    @triton.jit
    def _sort(x, LOG: tl.constexpr):
        """``x`` (``[2 ** LOG]``, integers) in ascending order: the bitonic sort of ``tl.sort``, on ``x`` as a
        hypercube of ``LOG`` dimensions of size 2, but each compare-and-swap finds the partner of an element as the
        pair's (wrapping) sum less the element, where ``tl.sort`` takes the pair's xor: Triton's CPU interpreter
        runs ``tl.sum`` in numpy and an xor reduction element by element (and each call of a jitted helper costs it
        more than the operations, hence one function)."""
        h = tl.reshape(x, [2] * LOG if LOG else [1])
        for stage in tl.static_range(1, LOG + 1):
            # Sorts each run of 2 ** stage elements (its halves sorted in opposite directions): ascending and
            # descending in turn (flip: 0, 1 along dimension `stage` from the innermost), the last (whole) one
            # ascending.
            if stage < LOG:
                flip = tl.reshape(tl.arange(0, 2), [1] * (LOG - stage - 1) + [2] + [1] * stage)
            else:
                flip = 0
            for k in tl.static_range(stage):
                # compare-and-swap along dimension j = stage - 1 - k from the innermost (axis LOG - 1 - j)
                other = tl.sum(h, axis=LOG - stage + k, keep_dims=True) - h
                right = tl.reshape(tl.arange(0, 2), [1] * (LOG - stage + k) + [2] + [1] * (stage - 1 - k))
                h = tl.where((h > other) != (flip ^ right), other, h)
        return tl.reshape(h, x.shape)

    @triton.jit
    def _resident(held_ptr, wanted, S: tl.constexpr, SP: tl.constexpr, NP: tl.constexpr, CS: tl.constexpr,
                  NARROW: tl.constexpr):  # fmt: skip
        """The slot of each wanted block (``[NP]``, int32; SP where none holds it) among the S blocks at
        ``held_ptr``: CS slots at a time against every entry, ``[CS, NP]`` tiles whose minimum is kept per element
        and reduced over the slots (within each thread) after the loop. NARROW: ``wanted`` is int32, the compares
        too (every block of the row fits), and the loop is unrolled; else a loop of int64 compares (kept out of the
        unrolled code so that it does not raise the kernel's registers)."""
        first = tl.full([CS, NP], SP, dtype=tl.int32)
        if NARROW:
            for c in tl.static_range(0, S, CS):
                sc = c + tl.arange(0, CS)
                held = tl.load(held_ptr + sc, mask=sc < S, other=-3).to(tl.int32)  # -3: matches nothing
                first = tl.minimum(first, tl.where(held[:, None] == wanted[None, :], sc[:, None], SP))
        else:
            for c in range(0, S, CS):
                sc = c + tl.arange(0, CS)
                held = tl.load(held_ptr + sc, mask=sc < S, other=-3)
                first = tl.minimum(first, tl.where(held[:, None] == wanted[None, :], sc[:, None], SP))
        return tl.min(first, axis=0)

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
        LOG_SP: tl.constexpr,  # log2(SP)
        TOUCH: tl.constexpr,
        CS: tl.constexpr,  # slots per step of the search for resident blocks
    ):
        row = tl.program_id(0).to(tl.int64)  # b * heads + h
        b = row // heads
        h = row % heads
        hb = h % blocks_heads  # a shared selection (one row for all heads): 0
        s = tl.arange(0, SP)
        live_s = s < S
        i = tl.arange(0, NP)
        live_i = i < N
        last = tl.load(used_ptr + row * (S + 1) + s, mask=live_s, other=0)
        base = (b * blocks_heads + hb) * N
        want = tl.load(blocks_ptr + base + i, mask=live_i, other=0)
        keep = (tl.load(keep_ptr + base + i, mask=live_i, other=0) != 0) & live_i
        wanted = tl.where(keep, want, -2)  # entries not kept look for block -2, which no slot holds
        # The slot of each wanted block (SP: not resident), compared in int32 where every block of the row and
        # every wanted block fits (block ids do; the int64 compare is for rows where one does not).
        held = tl.load(block_ptr + row * (S + 1) + s, mask=live_s, other=-3)
        narrow = (tl.min(((held >= -(2**31)) & (held < 2**31)).to(tl.int32)) > 0) & (
            tl.min(((wanted >= -(2**31)) & (wanted < 2**31)).to(tl.int32)) > 0
        )
        if narrow:
            hit_slot = _resident(block_ptr + row * (S + 1), wanted.to(tl.int32), S, SP, NP, CS, True)
        else:
            hit_slot = _resident(block_ptr + row * (S + 1), wanted, S, SP, NP, CS, False)
        hit = hit_slot < SP
        hit_slot = tl.where(hit, hit_slot, 0)
        miss = keep & ~hit
        # Slots holding a wanted block are protected: as a block is in at most one slot per row, the hit slots.
        protected = (tl.histogram(hit_slot, SP, mask=hit) > 0) | ~live_s
        # The slots in (protected, last use, slot) order: one integer key per slot (protected in bit 62, last use
        # + 1 >= 0 above the slot's 9 bits), sorted; the low 9 bits of the r-th key are the slot of rank r.
        key = (protected.to(tl.int64) << 62) | ((last + 1) << 9) | s.to(tl.int64)
        ranked = (_sort(key, LOG_SP) & 511).to(tl.int32)
        # The i-th miss (0-based, in entry order) takes the slot of rank i.
        rank_i = tl.cumsum(miss.to(tl.int32), axis=0) - 1
        rank_i = tl.maximum(rank_i, 0)
        victim = tl.gather(ranked, rank_i, 0)
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
    sp, np_ = triton.next_power_of_2(slots), triton.next_power_of_2(n)
    log_sp = sp.bit_length() - 1
    _assign_kernel[(batch * heads,)](
        block, last_used, clock, blocks, keep, out_slots, out_miss, heads, blocks.shape[1],
        S=slots, N=n, SP=sp, NP=np_, LOG_SP=log_sp, TOUCH=touch, CS=min(16, sp), num_warps=4,
    )  # fmt: skip
    return out_slots, out_miss
