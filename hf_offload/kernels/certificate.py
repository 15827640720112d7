"""One decode step's accuracy certificate recorded in one launch.

:meth:`~hf_offload.cache.stats.LayerStats.record_step` adds a step's kept entries and its estimated share of
attention left out to persistent float64 buffers: the share per sequence from the estimate's and the selection's
log-sum-exps (a subtraction, a sigmoid, a mean), its mean over the batch, the sums, maximum and last value of the
step buffer and the per-sequence sums, maxima and counts. In torch that is about thirteen small operations per layer
and step, each a kernel of a few microseconds inside a decode step's CUDA graph. Here one program does all of it.

The result is the torch code's (:meth:`LayerStats.record_step_reference`) up to float64 rounding of the sums (they
run in another order) and of float32 rounding of the sigmoid. The tests compare the two on the CPU under Triton's
interpreter and on CUDA.
"""

from __future__ import annotations

import torch

from .gather import kernels_available, tl, triton

MAX_ELEMENTS = 16384
"""Most ``batch x values per sequence`` the kernel takes (one program holds them all); above it the torch code
runs."""

KEEP_BLOCK = 4096
"""Kept-entry flags summed per step of the kernel's loop."""

NONE, LSE, GIVEN, EXACT = range(4)
"""Where a step's missed share comes from: nothing recorded, the two log-sum-exps, a given share per sequence, or a
step that attended every sealed block (share 0)."""


def record_step_supported(device: torch.device, batch: int, per_sequence: int) -> bool:
    """Whether :func:`record_step` runs on ``device`` for ``batch`` sequences of ``per_sequence`` log-sum-exps (or
    one given share) each."""
    return kernels_available(device) and batch * triton.next_power_of_2(max(per_sequence, 1)) <= MAX_ELEMENTS


if triton is not None:

    @triton.jit(do_not_specialize=["n_keep", "batch", "per_seq"])
    def _record_kernel(
        steps_ptr,  # float64 [E]: the step buffer, updated in place
        pattern_ptr,  # float64 [3, E]: added per unit of share, per kept entry and as a constant
        rows_ptr,  # float64 [3, batch]: per sequence sum, maximum and steps of the share (HAS_ROWS)
        keep_ptr,  # uint8 [n_keep]: the step's kept entries
        tail_ptr,  # float32 [batch, per_seq]: the estimate's log-sum-exps (MODE LSE)
        sel_ptr,  # float32 [batch, per_seq]: the selection's log-sum-exps (MODE LSE)
        missed_ptr,  # float64 [batch]: the share per sequence (MODE GIVEN)
        inv_entries,  # float64: 1 / kept rows (the kept entries per row are averaged)
        n_keep,
        batch,
        per_seq,
        E: tl.constexpr,
        EP: tl.constexpr,
        MISSED_MAX: tl.constexpr,
        MISSED_LAST: tl.constexpr,
        MODE: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        KEEP_BLOCK: tl.constexpr,
        KEEP_STEPS: tl.constexpr,
        BP: tl.constexpr,
        PP: tl.constexpr,
    ):
        acc = tl.zeros([KEEP_BLOCK], dtype=tl.int32)
        for step in range(KEEP_STEPS):
            i = step * KEEP_BLOCK + tl.arange(0, KEEP_BLOCK)
            acc += (tl.load(keep_ptr + i, mask=i < n_keep, other=0) != 0).to(tl.int32)
        kept = tl.sum(acc, axis=0).to(tl.float64)
        e = tl.arange(0, EP)
        live = e < E
        steps = tl.load(steps_ptr + e, mask=live, other=0.0)
        per_share = tl.load(pattern_ptr + e, mask=live, other=0.0)
        per_kept = tl.load(pattern_ptr + E + e, mask=live, other=0.0)
        constant = tl.load(pattern_ptr + 2 * E + e, mask=live, other=0.0)
        # The torch code's order: steps + inv * per_kept * kept, then + constant, then + per_share * pooled.
        steps = steps + inv_entries * (per_kept * kept)
        steps = steps + constant
        b = tl.arange(0, BP)
        in_b = b < batch
        if MODE == 1 or MODE == 2:
            if MODE == 1:
                p = tl.arange(0, PP)
                at = b[:, None] * per_seq + p[None, :]
                ok = in_b[:, None] & (p[None, :] < per_seq)
                tail = tl.load(tail_ptr + at, mask=ok, other=0.0)
                sel = tl.load(sel_ptr + at, mask=ok, other=0.0)
                share = tl.sigmoid(tail - sel).to(tl.float64)
                missed = tl.sum(tl.where(ok, share, 0.0), axis=1) / per_seq
            else:
                missed = tl.load(missed_ptr + b, mask=in_b, other=0.0)
            pooled = tl.sum(tl.where(in_b, missed, 0.0), axis=0) / batch
            steps = steps + per_share * pooled
            steps = tl.where(e == MISSED_MAX, tl.maximum(steps, pooled), steps)
            steps = tl.where(e == MISSED_LAST, pooled, steps)
            if HAS_ROWS:
                row_sum = tl.load(rows_ptr + b, mask=in_b, other=0.0)
                row_max = tl.load(rows_ptr + batch + b, mask=in_b, other=0.0)
                row_steps = tl.load(rows_ptr + 2 * batch + b, mask=in_b, other=0.0)
                tl.store(rows_ptr + b, row_sum + missed, mask=in_b)
                tl.store(rows_ptr + batch + b, tl.maximum(row_max, missed), mask=in_b)
                tl.store(rows_ptr + 2 * batch + b, row_steps + 1.0, mask=in_b)
        elif MODE == 3:
            steps = tl.where(e == MISSED_LAST, 0.0, steps)
            if HAS_ROWS:
                row_steps = tl.load(rows_ptr + 2 * batch + b, mask=in_b, other=0.0)
                tl.store(rows_ptr + 2 * batch + b, row_steps + 1.0, mask=in_b)
        tl.store(steps_ptr + e, steps, mask=live)


def record_step(
    steps: torch.Tensor,
    pattern: torch.Tensor,
    rows: torch.Tensor | None,
    keep: torch.Tensor,
    mode: int,
    missed_max: int,
    missed_last: int,
    missed: torch.Tensor | None = None,
    tail_lse: torch.Tensor | None = None,
    selection_lse: torch.Tensor | None = None,
) -> None:
    """Record one decode step in one launch (no host synchronisation; capturable).

    Args:
        steps: the step buffer, ``[E]``, float64, contiguous; updated in place.
        pattern: what one step adds to it per unit of share, per kept entry and as a constant, ``[3, E]``, float64,
            contiguous.
        rows: the per-sequence sums, maxima and steps, ``[3, batch]``, float64, contiguous, or ``None``.
        keep: the step's kept entries, ``[batch, 1 or kv_heads, k]``, ``torch.bool``.
        mode: :data:`NONE`, :data:`LSE` (``tail_lse`` and ``selection_lse``), :data:`GIVEN` (``missed``) or
            :data:`EXACT`.
        missed_max, missed_last: the entries of ``steps`` that take the maximum and the last pooled share.
        missed: the share per sequence, ``[batch]``, float64 (mode :data:`GIVEN`).
        tail_lse, selection_lse: ``[batch, ...]``, float32 (mode :data:`LSE`); the share of a sequence is the mean
            over its entries of ``sigmoid(tail_lse - selection_lse)``.
    """
    batch = keep.shape[0]
    entries = keep.numel() // max(keep.shape[-1], 1)
    flags = keep.contiguous().view(torch.uint8).reshape(-1)
    per_seq = 1
    tail = sel = given = steps  # not read
    if mode == LSE:
        tail, sel = tail_lse.reshape(batch, -1).contiguous(), selection_lse.reshape(batch, -1).contiguous()
        per_seq = tail.shape[1]
    elif mode == GIVEN:
        given = missed.contiguous()
    n_keep = flags.numel()
    _record_kernel[(1,)](
        steps, pattern, rows if rows is not None else steps, flags, tail, sel, given, 1.0 / max(entries, 1), n_keep,
        batch, per_seq, E=steps.shape[0], EP=triton.next_power_of_2(steps.shape[0]), MISSED_MAX=missed_max,
        MISSED_LAST=missed_last, MODE=mode, HAS_ROWS=rows is not None, KEEP_BLOCK=KEEP_BLOCK,
        KEEP_STEPS=triton.next_power_of_2(max(1, triton.cdiv(n_keep, KEEP_BLOCK))),
        BP=triton.next_power_of_2(max(batch, 1)), PP=triton.next_power_of_2(per_seq), num_warps=4,
    )  # fmt: skip
