"""Block scores of a shared selection from per-head block log-sum-exps, in two small launches (the second may also
write the log-sum-exps with the blocks that are not valid at ``-inf``, what the bounded estimate reads).

``quantkey`` scores a block by its attention mass summed over heads: per query head the softmax over blocks of the
block log-sum-exps, summed over the query heads, with blocks that may not be attended left out of every softmax,
then sink and window blocks forced in (``+inf``) and blocks that may not be attended kept out (``-inf``). In torch
that is about nine operations (the masks, two masked fills, the softmax, the sum over heads, two more masked fills),
each a kernel of a few microseconds inside a decode step's CUDA graph. The result is the torch code's
(:func:`block_scores_reference`) up to float32 rounding (the sums run in another order), with the same ``+inf`` and
``-inf`` entries; the tests compare the two on the CPU under Triton's interpreter and on CUDA.

Two launches: per sequence and head the maximum and sum of exponentials over its valid blocks (one program per row,
up to ``STATS_BLOCK_N`` blocks at a time, the running sum rescaled to each new maximum; the step count is a power of
two, so the kernel compiles once per power of two of the block count); per sequence and chunk of ``BLOCK_N`` blocks
the masses summed over heads and the final scores.
"""

from __future__ import annotations

import torch

from .gather import kernels_available, tl, triton

BLOCK_N = 128
"""Blocks per program of the third launch (the scores)."""

STATS_BLOCK_N = 4096
"""Most blocks per step of the first launch's loop (one program per sequence and head; rows of fewer blocks take one
step of the next power of two). Large: the loop's steps wait on each other, so fewer, wider steps are faster."""

MAX_CHUNKS = 1024
"""Most ``BLOCK_N``-block chunks per sequence the kernels take (131,072 blocks, 2M tokens at 16-token blocks);
above it the torch code runs."""


def block_scores_reference(lse: torch.Tensor, valid: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Scores of a shared selection in torch: the softmax over valid blocks per head, summed over heads, forced
    blocks ``+inf``, blocks that are not valid ``-inf`` (not valid wins).

    Args:
        lse: block log-sum-exps, ``[batch, kv_heads, group, n_blocks]``, float32, any device.
        valid: blocks that may be attended, ``[batch, n_blocks]``, ``torch.bool``, same device.
        forced: blocks always selected (sink and window), same shape, dtype and device.

    Returns:
        ``[batch, 1, n_blocks]``, float32.
    """
    masked = lse.masked_fill(~valid[:, None, None, :], float("-inf"))
    scores = torch.softmax(masked, dim=-1).sum(dim=(1, 2))[:, None, :]
    scores = scores.masked_fill(forced[:, None, :], float("inf"))
    return scores.masked_fill(~valid[:, None, :], float("-inf"))


if triton is not None:

    @triton.jit(do_not_specialize=["n_blocks"])
    def _row_stats_kernel(
        lse_ptr,  # float32 [B, R, N]
        valid_ptr,  # bool as uint8 [B, N]
        stats_ptr,  # float32 [B, R, 2]: max and sum of exp(lse - max) over the row's valid blocks
        rows,
        n_blocks,
        BLOCK: tl.constexpr,
        STEPS: tl.constexpr,  # a power of two >= cdiv(n_blocks, BLOCK): one compilation per power of two
    ):
        br = tl.program_id(0).to(tl.int64)
        b = br // rows
        top = tl.full([], float("-inf"), tl.float32)
        total = tl.full([], 0.0, tl.float32)
        for step in range(STEPS):  # (steps past the row load nothing and leave both unchanged)
            n = step * BLOCK + tl.arange(0, BLOCK)
            live = n < n_blocks
            ok = tl.load(valid_ptr + b * n_blocks + n, mask=live, other=0) != 0
            x = tl.load(lse_ptr + br * n_blocks + n, mask=live & ok, other=float("-inf"))
            new = tl.maximum(top, tl.max(x, axis=0))
            # Rescale the running sum to the new maximum; -inf entries add exp(-inf) = 0 (and while every entry so
            # far is -inf, the maximum is taken as 0 and the sum stays 0: no inf - inf).
            safe = tl.where(new == float("-inf"), 0.0, new)
            kept = total * tl.exp(tl.where(top == float("-inf"), safe, top) - safe)
            total = kept + tl.sum(tl.exp(x - safe), axis=0)
            top = new
        tl.store(stats_ptr + br * 2, top)
        tl.store(stats_ptr + br * 2 + 1, total)

    @triton.jit
    def _scores_kernel(
        lse_ptr,  # float32 [B, R, N]
        valid_ptr,  # uint8 [B, N]
        forced_ptr,  # uint8 [B, N]
        stats_ptr,  # float32 [B, R, 2]
        out_ptr,  # float32 [B, N]
        masked_ptr,  # float32 [B, R, N]: lse, -inf where not valid (written with MASKED)
        rows,
        n_blocks,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        r = tl.arange(0, ROWS)
        live = n < n_blocks
        ok = tl.load(valid_ptr + b * n_blocks + n, mask=live, other=0) != 0
        row_live = r < rows
        top = tl.load(stats_ptr + (b * rows + r) * 2, mask=row_live, other=float("-inf"))
        total = tl.load(stats_ptr + (b * rows + r) * 2 + 1, mask=row_live, other=1.0)
        x = tl.load(lse_ptr + (b * rows + r[:, None]) * n_blocks + n[None, :],
                    mask=row_live[:, None] & (live & ok)[None, :], other=float("-inf"))  # fmt: skip
        if MASKED:
            tl.store(masked_ptr + (b * rows + r[:, None]) * n_blocks + n[None, :], x,
                     mask=row_live[:, None] & live[None, :])  # fmt: skip
        # A row whose valid blocks are all -inf (top -inf) adds nothing.
        p = tl.where(x == float("-inf"), 0.0, tl.exp(x - top[:, None]) / total[:, None])
        acc = tl.sum(p, axis=0)
        forced = tl.load(forced_ptr + b * n_blocks + n, mask=live, other=0) != 0
        acc = tl.where(forced, float("inf"), acc)
        acc = tl.where(ok, acc, float("-inf"))
        tl.store(out_ptr + b * n_blocks + n, acc, mask=live)


def block_scores_supported(lse: torch.Tensor) -> bool:
    """Whether :func:`block_scores` runs the kernels for ``lse`` (Triton on its device, float32, at most
    ``MAX_CHUNKS * BLOCK_N`` blocks and 128 heads)."""
    batch, heads, group, n = lse.shape
    return (kernels_available(lse.device) and lse.dtype == torch.float32 and 0 < n <= MAX_CHUNKS * BLOCK_N
            and heads * group <= 128)  # fmt: skip


def block_scores(lse: torch.Tensor, valid: torch.Tensor, forced: torch.Tensor,
                 masked: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`block_scores_reference` in two launches where :func:`block_scores_supported`, else the reference.

    Allocates only its result (and, with ``masked``, the masked log-sum-exps) and one small float32 temporary and
    never waits for the device, so it can be captured in a CUDA graph once it has run outside one. Arguments and
    result as the reference's; with ``masked`` also ``lse`` with ``-inf`` for the blocks that are not valid
    (``lse.masked_fill(~valid[:, None, None, :], -inf)``, written by the second launch), as ``(scores, masked)``.
    """
    if not block_scores_supported(lse):
        scores = block_scores_reference(lse, valid, forced)
        return (scores, lse.masked_fill(~valid[:, None, None, :], float("-inf"))) if masked else scores
    batch, heads, group, n = lse.shape
    rows, chunks = heads * group, triton.cdiv(n, BLOCK_N)
    lse = lse.contiguous()
    valid_u8 = valid.contiguous().view(torch.uint8)
    forced_u8 = forced.contiguous().view(torch.uint8)
    stats = torch.empty((batch, rows, 2), dtype=torch.float32, device=lse.device)
    out = torch.empty((batch, 1, n), dtype=torch.float32, device=lse.device)
    lse_masked = torch.empty_like(lse) if masked else out
    step = min(STATS_BLOCK_N, max(128, triton.next_power_of_2(n)))
    _row_stats_kernel[(batch * rows,)](lse, valid_u8, stats, rows, n, BLOCK=step,
                                       STEPS=triton.next_power_of_2(triton.cdiv(n, step)), num_warps=4)
    _scores_kernel[(batch, chunks)](lse, valid_u8, forced_u8, stats, out, lse_masked, rows, n,
                                    ROWS=triton.next_power_of_2(rows), BLOCK=BLOCK_N, MASKED=masked)  # fmt: skip
    return (out, lse_masked) if masked else out
