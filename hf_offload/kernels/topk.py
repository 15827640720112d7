"""Two-tier top-k of block scores (the ``k`` best, then the next ``ranked - k``) in one launch.

A decode step picks its blocks from per-row block scores with a top-k. ``torch.topk`` on ``[12, 1, 4096]`` float32
with ``k = 128`` costs ~32 us per call on an H200, launched with only 12 blocks. Here one program handles one
(sequence, row): it loads the row, maps each score to an order-preserving 32-bit integer key, finds the key of the
``k``-th and the ``ranked``-th entry of the order by a 32-step bisection (each step one count over the row), ranks
the entries tied with a threshold by a cumulative sum and writes each selected entry straight to its output
position (a second cumulative sum), with no sort.

The result is defined exactly by :func:`ranked_topk_reference` (a stable sort, then each tier sorted by index); the
kernel's is the same bit for bit, which the tests check on the CPU under Triton's interpreter and on CUDA.

Order of the scores: descending, ties broken toward the lower index. ``+inf`` comes first and ``-inf`` last, like
any other value; ``-0.0`` and ``0.0`` are equal (as in ``torch.sort``), so they tie and the lower index wins. NaN is
not allowed.
"""

from __future__ import annotations

import torch

from .gather import kernels_available, tl, triton

MAX_N = 32768
"""Most entries per row the kernel takes (a row is held in registers in one block); above it the torch code runs.
32768 blocks are 512K tokens at 16-token blocks."""

_PACK_MAX = 32767
"""Rows of at most this many entries count both thresholds in one int32 reduction or scan (the second count in the
upper 16 bits: ``n * 65537 < 2**31``); longer rows (only ``n = MAX_N``) use two."""


def _check(scores: torch.Tensor, k: int, ranked: int) -> None:
    if scores.dim() != 3:
        raise ValueError(f"scores must be [batch, rows, n], got shape {tuple(scores.shape)}")
    n = scores.shape[-1]
    if not 1 <= k <= ranked <= n:
        raise ValueError(f"need 1 <= k <= ranked <= n, got k={k}, ranked={ranked}, n={n}")


def ranked_topk_reference(scores: torch.Tensor, k: int, ranked: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-tier top-k in torch.

    All ``n`` entries of a row are ordered by (score descending, index ascending); tier 1 is the first ``k`` of
    that order, tier 2 the next ``ranked - k``. The result lists tier 1's indices in ascending order, then tier 2's
    in ascending order. ``-0.0`` and ``0.0`` are equal (they tie, the lower index first).

    Args:
        scores: block scores, ``[batch, rows, n]``, float32 (``+inf`` and ``-inf`` allowed, no NaN), any device.
        k: entries of tier 1, ``1 <= k <= ranked``.
        ranked: entries of both tiers together, ``ranked <= n``.

    Returns:
        ``(indices, values)``: ``[batch, rows, ranked]``, ``torch.int64`` and ``scores``' dtype, on ``scores``'
        device; ``values`` is ``scores`` gathered at ``indices``.

    Raises:
        ValueError: ``scores`` is not 3-d, or not ``1 <= k <= ranked <= n``.
    """
    _check(scores, k, ranked)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :ranked]
    tier1 = torch.sort(order[..., :k], dim=-1).values
    tier2 = torch.sort(order[..., k:], dim=-1).values
    indices = torch.cat([tier1, tier2], dim=-1)
    return indices, scores.gather(-1, indices)


if triton is not None:

    @triton.jit
    def _count2(a, b, PACK: tl.constexpr):
        # Number of true entries of each of two [BLOCK] masks.
        if PACK:
            both = tl.sum(a.to(tl.int32) + (b.to(tl.int32) << 16), axis=0)
            return both & 0xFFFF, both >> 16
        else:
            return tl.sum(a.to(tl.int32), axis=0), tl.sum(b.to(tl.int32), axis=0)

    @triton.jit
    def _cumsum2(a, b, PACK: tl.constexpr):
        # Inclusive cumulative sums of two [BLOCK] masks.
        if PACK:
            both = tl.cumsum(a.to(tl.int32) + (b.to(tl.int32) << 16), axis=0)
            return both & 0xFFFF, both >> 16
        else:
            return tl.cumsum(a.to(tl.int32), axis=0), tl.cumsum(b.to(tl.int32), axis=0)

    @triton.jit(do_not_specialize=["n", "k", "ranked"])
    def _ranked_topk_kernel(
        scores_ptr,  # float32 [B, R, N], any strides
        idx_ptr,  # int64 [B, R, ranked]: out
        val_ptr,  # float32 [B, R, ranked]: out
        rows,
        n,
        k,
        ranked,
        stride_b,
        stride_r,
        stride_n,
        BLOCK: tl.constexpr,
        PACK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # b * rows + r
        b = row // rows
        r = row % rows
        i = tl.arange(0, BLOCK)
        live = i < n
        x = tl.load(scores_ptr + b * stride_b + r * stride_r + i.to(tl.int64) * stride_n, mask=live, other=0.0)
        # Order-preserving signed key: a float's bits as int32, with the non-sign bits flipped where the sign is
        # set. -0.0 (bits 0x80000000) becomes 0.0 first, in integers (no float compare that could flush
        # subnormals). The keys of non-NaN floats are > INT32_MIN (only the NaN 0xFFFFFFFF maps there), so lanes
        # past the row get INT32_MIN and are never counted: every bisection point below is > INT32_MIN.
        bits = x.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        key = tl.where(live, key, -2147483648)
        # Bisection for T_k, the largest t with count(key >= t) >= k (the k-th largest key), and T_r likewise for
        # ranked. Invariants: count(key >= lo) >= k > count(key >= hi) = above; at the end hi = lo + 1, so
        # above = count(key > T_k). lo = INT32_MIN holds since k <= n; hi = 2**31 holds with count 0.
        lo_k = tl.full([], -2147483648, tl.int64)
        hi_k = tl.full([], 2147483648, tl.int64)
        above_k = tl.full([], 0, tl.int32)
        lo_r = lo_k
        hi_r = hi_k
        above_r = above_k
        for _ in range(32):
            mid_k = lo_k + (hi_k - lo_k) // 2  # lo < mid < hi, and int32
            mid_r = lo_r + (hi_r - lo_r) // 2
            cnt_k, cnt_r = _count2(key >= mid_k.to(tl.int32), key >= mid_r.to(tl.int32), PACK)
            ok_k = cnt_k >= k
            ok_r = cnt_r >= ranked
            lo_k = tl.where(ok_k, mid_k, lo_k)
            hi_k = tl.where(ok_k, hi_k, mid_k)
            above_k = tl.where(ok_k, above_k, cnt_k)
            lo_r = tl.where(ok_r, mid_r, lo_r)
            hi_r = tl.where(ok_r, hi_r, mid_r)
            above_r = tl.where(ok_r, above_r, cnt_r)
        t_k = lo_k.to(tl.int32)
        t_r = lo_r.to(tl.int32)
        # Entries tied with a threshold enter by index: the first (k - count(key > T_k)) of them.
        tie_k = live & (key == t_k)
        tie_r = live & (key == t_r)
        seen_k, seen_r = _cumsum2(tie_k, tie_r, PACK)  # inclusive: a tied entry's rank among the ties is seen - 1
        tier1 = live & ((key > t_k) | (tie_k & (seen_k <= k - above_k)))
        top = live & ((key > t_r) | (tie_r & (seen_r <= ranked - above_r)))
        tier2 = top & ~tier1
        # Output position: tier 1 in index order at 0..k-1, tier 2 in index order at k..ranked-1.
        pos1, pos2 = _cumsum2(tier1, tier2, PACK)
        pos = tl.where(tier1, pos1 - 1, k + pos2 - 1).to(tl.int64)
        out = row * ranked + pos
        tl.store(idx_ptr + out, i.to(tl.int64), mask=top)
        tl.store(val_ptr + out, x, mask=top)


def ranked_topk_supported(scores: torch.Tensor, ranked: int) -> bool:
    """Whether :func:`ranked_topk` runs the kernel for ``scores`` and ``ranked`` (Triton on its device, float32,
    3-d, ``ranked <= n <= MAX_N``)."""
    if scores.dim() != 3:
        return False
    n = scores.shape[-1]
    return (kernels_available(scores.device) and scores.dtype == torch.float32 and 0 < ranked <= n <= MAX_N)


def ranked_topk(scores: torch.Tensor, k: int, ranked: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ranked_topk_reference` in one launch where :func:`ranked_topk_supported`, else the reference.

    Allocates only its two results and never waits for the device, so it can be captured in a CUDA graph once it
    has run outside one (one compiled kernel per power of two of ``n`` and layout, whatever ``k`` and ``ranked``).

    Args:
        scores: block scores, ``[batch, rows, n]``, float32 (``+inf`` and ``-inf`` allowed, no NaN), any strides,
            CUDA (or the CPU under Triton's interpreter; elsewhere the reference runs).
        k: entries of tier 1, ``1 <= k <= ranked``.
        ranked: entries of both tiers together, ``ranked <= n``.

    Returns:
        ``(indices, values)``: ``[batch, rows, ranked]``, ``torch.int64`` and float32, on ``scores``' device: tier
        1's indices in ascending order, then tier 2's, and the scores at them.

    Raises:
        ValueError: ``scores`` is not 3-d, or not ``1 <= k <= ranked <= n``.
    """
    _check(scores, k, ranked)
    if not ranked_topk_supported(scores, ranked):
        return ranked_topk_reference(scores, k, ranked)
    batch, rows, n = scores.shape
    indices = torch.empty((batch, rows, ranked), dtype=torch.int64, device=scores.device)
    values = torch.empty((batch, rows, ranked), dtype=torch.float32, device=scores.device)
    if batch * rows == 0:
        return indices, values
    block = triton.next_power_of_2(n)
    num_warps = 4 if block <= 2048 else 8 if block <= 4096 else 16
    _ranked_topk_kernel[(batch * rows,)](
        scores, indices, values, rows, n, k, ranked, scores.stride(0), scores.stride(1), scores.stride(2),
        BLOCK=block, PACK=n <= _PACK_MAX, num_warps=num_warps,
    )  # fmt: skip
    return indices, values
