"""Two-tier top-k of block scores (the ``k`` best, then the next ``ranked - k``) in one launch.

A decode step picks its blocks from per-row block scores with a top-k; ``torch.topk`` on a few rows of a few thousand
scores launches only one block per row and is slow at that size. Here one program handles one
(sequence, row): it loads the row, maps each score to an order-preserving 32-bit integer key, finds the key of the
``k``-th and the ``ranked``-th entry of the order by a 32-step bisection (each step one count over the row), ranks
the entries tied with a threshold by a cumulative sum and writes each selected entry straight to its output
position (a second cumulative sum), with no sort.

On CUDA the same algorithm runs as a CUDA kernel compiled at run time (NVRTC, :data:`CUDA_SOURCE`), which Triton
cannot express as cheaply: one program of up to 1,024 threads per row, each thread holding a few consecutive
entries in registers; a bisection step is one warp-wide ``redux`` sum and one barrier (the per-warp counts
double-buffered in shared memory, so no second barrier), and the two cumulative sums are warp scans; the Triton
kernel spends most of its time in the 32 steps' block-wide reductions. The CUDA kernel also writes the ``keep`` mask
of tier 1 (``values > -inf``), one launch less.

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


CUDA_SOURCE = r"""
// One program per (batch, row) of THREADS threads; thread t holds entries PER t .. PER t + PER - 1 of its row.
// scores: float32 [B, R, N] (strides sb, sr, sn in elements); idx: int64 [B, R, ranked]; val: float32 [B, R, ranked];
// keep: uint8 [B, R, k] (written where has_keep). Requires N <= THREADS * PER <= 32768 (counts packed 16 + 16 bits).
constexpr int WARPS = THREADS / 32;
__device__ __forceinline__ unsigned warp_inclusive_scan(unsigned v, int lane) {
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned y = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += y;
    }
    return v;
}
// Exclusive prefix sum of v over the program's threads in thread order (totals: WARPS words of shared memory,
// used by this scan only).
__device__ __forceinline__ unsigned block_exclusive_scan(unsigned v, unsigned* totals, int lane, int warp) {
    const unsigned incl = warp_inclusive_scan(v, lane);
    if (lane == 31) totals[warp] = incl;
    __syncthreads();
    unsigned before = 0;
    for (int w = 0; w < warp; ++w) before += totals[w];
    return before + incl - v;
}
extern "C" __global__ void __launch_bounds__(THREADS) ranked_topk(
    const float* __restrict__ scores, long long* __restrict__ idx, float* __restrict__ val,
    unsigned char* __restrict__ keep, int rows, int n, int k, int ranked, int sb, int sr, int sn, int has_keep) {
    __shared__ unsigned counts[2][WARPS];
    __shared__ unsigned totals[2][WARPS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long row = blockIdx.x;
    const long long b = row / rows, r = row - b * rows;
    const float* src = scores + b * sb + r * sr;
    // Order-preserving unsigned keys: a float's bits, -0.0 as 0.0, negative numbers' other bits flipped, then the
    // sign bit flipped. Every non-NaN float maps above 0x007fffff; entries past the row get 0 and are never taken.
    unsigned u[PER];
    float x[PER];
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        const int i = tid * PER + e;
        x[e] = i < n ? src[static_cast<long long>(i) * sn] : 0.f;
        unsigned bits = __float_as_uint(x[e]);
        if (bits == 0x80000000u) bits = 0u;
        if (bits & 0x80000000u) bits ^= 0x7fffffffu;
        u[e] = i < n ? bits ^ 0x80000000u : 0u;
    }
    // Bisection for T_k, the largest t with count(u >= t) >= k (the k-th largest key), and T_r likewise for ranked;
    // above = count(u > T) at the end (hi = lo + 1).
    unsigned long long lo_k = 0, hi_k = 1ull << 32, lo_r = 0, hi_r = 1ull << 32;
    unsigned above_k = 0, above_r = 0;
#pragma unroll 1
    for (int it = 0; it < 32; ++it) {
        const unsigned mk = static_cast<unsigned>(lo_k + ((hi_k - lo_k) >> 1));
        const unsigned mr = static_cast<unsigned>(lo_r + ((hi_r - lo_r) >> 1));
        unsigned c = 0;
#pragma unroll
        for (int e = 0; e < PER; ++e) c += (u[e] >= mk ? 1u : 0u) + (u[e] >= mr ? 0x10000u : 0u);
        c = __reduce_add_sync(0xffffffffu, c);
        if (lane == 0) counts[it & 1][warp] = c;
        __syncthreads();  // (the other buffer is rewritten only after the next barrier: no second one needed)
        unsigned total = 0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += counts[it & 1][w];
        const unsigned ck = total & 0xffffu, cr = total >> 16;
        if (ck >= static_cast<unsigned>(k)) lo_k = mk; else { hi_k = mk; above_k = ck; }
        if (cr >= static_cast<unsigned>(ranked)) lo_r = mr; else { hi_r = mr; above_r = cr; }
    }
    const unsigned tk = static_cast<unsigned>(lo_k), tr = static_cast<unsigned>(lo_r);
    const unsigned need_k = k - above_k, need_r = ranked - above_r;  // entries tied with T enter by index
    // Ranks among the ties, in index order.
    unsigned ties = 0;
#pragma unroll
    for (int e = 0; e < PER; ++e) ties += (u[e] == tk ? 1u : 0u) + (u[e] == tr ? 0x10000u : 0u);
    const unsigned tie_base = block_exclusive_scan(ties, totals[0], lane, warp);
    unsigned seen_k = tie_base & 0xffffu, seen_r = tie_base >> 16;
    unsigned tier1 = 0, tier2 = 0;  // bit e: entry e is in tier 1 / tier 2
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        const bool t1 = u[e] > tk || (u[e] == tk && seen_k < need_k);
        const bool top = u[e] > tr || (u[e] == tr && seen_r < need_r);
        seen_k += u[e] == tk ? 1u : 0u;
        seen_r += u[e] == tr ? 1u : 0u;
        tier1 |= (t1 ? 1u : 0u) << e;
        tier2 |= (top && !t1 ? 1u : 0u) << e;
    }
    // Output positions: tier 1 in index order at 0 .. k - 1, tier 2 at k .. ranked - 1.
    const unsigned pos_base = block_exclusive_scan(__popc(tier1) + (__popc(tier2) << 16), totals[1], lane, warp);
    unsigned p1 = pos_base & 0xffffu, p2 = k + (pos_base >> 16);
#pragma unroll
    for (int e = 0; e < PER; ++e) {
        const bool t1 = (tier1 >> e) & 1u, t2 = (tier2 >> e) & 1u;
        if (!(t1 || t2)) continue;
        const long long at = row * ranked + (t1 ? p1 : p2);
        idx[at] = tid * PER + e;
        val[at] = x[e];
        if (t1 && has_keep) keep[row * k + p1] = x[e] > -__int_as_float(0x7f800000) ? 1 : 0;
        p1 += t1 ? 1u : 0u;
        p2 += t2 ? 1u : 0u;
    }
}
"""

CUDA_MAX_N = 32768
"""Most entries per row the CUDA kernel takes (1,024 threads of 32 entries)."""

CUDA_AUTO_MAX_N = CUDA_MAX_N
"""Most entries per row for which :data:`BACKEND` ``None`` picks the CUDA kernel: every row it takes. On an H100 it
was the faster of the two at every shape timed, batch 1 to 12, 2,048 to 16,400 entries
(``results/selection/topk_h100.json``)."""

BACKEND: str | None = None
"""Which kernel :func:`ranked_topk` runs on CUDA: ``None`` (the CUDA kernel where it compiles, else Triton),
``"cuda"`` or ``"triton"`` (read at each call; the benchmark times both)."""

_CUDA_COMPILED: dict[tuple[int, int], object] = {}
_CUDA_FAILED: str | None = None


def _cuda_layout(n: int) -> tuple[int, int]:
    """``(threads, entries per thread)`` of the CUDA kernel for rows of ``n`` entries: 8 entries per thread up to
    2,048 entries (at least one warp), 16 up to 16,384, then 32 (1,024 threads)."""
    if n <= 2048:
        return max(32, 1 << max(0, (n - 1).bit_length() - 3)), 8
    if n <= 16384:
        return 1 << ((n - 1).bit_length() - 4), 16
    return 1024, 32


def _cuda_kernel(n: int):
    """The compiled CUDA kernel for rows of ``n`` entries, or ``None`` (with one warning per process) where NVRTC
    cannot build it."""
    global _CUDA_FAILED
    layout = _cuda_layout(n)
    fn = _CUDA_COMPILED.get(layout)
    if fn is None and _CUDA_FAILED is None:
        try:
            source = f"#define THREADS {layout[0]}\n#define PER {layout[1]}\n" + CUDA_SOURCE
            fn = _CUDA_COMPILED[layout] = torch.cuda._compile_kernel(source, "ranked_topk")
        except Exception as e:  # reported once; the Triton kernel runs from here on
            if torch.cuda.is_current_stream_capturing():  # perhaps only the capture forbids it: this call only
                return None
            _CUDA_FAILED = f"{type(e).__name__}: {e}"
            import warnings

            warnings.warn(f"hf_offload: the CUDA top-k kernel could not be compiled ({_CUDA_FAILED[:300]}); using "
                          "the Triton kernel instead.", RuntimeWarning, stacklevel=3)  # fmt: skip
    return fn


def cuda_topk_supported(scores: torch.Tensor, ranked: int) -> bool:
    """Whether :func:`ranked_topk` runs the CUDA kernel for ``scores``: a 3-d float32 CUDA tensor of at most
    :data:`CUDA_AUTO_MAX_N` entries per row (:data:`CUDA_MAX_N` with :data:`BACKEND` ``"cuda"``), on an NVIDIA
    GPU of compute capability 8.0 or newer, with PyTorch's NVRTC wrapper, :data:`BACKEND` not ``"triton"``."""
    if BACKEND == "triton" or scores.dim() != 3 or not scores.is_cuda or scores.dtype != torch.float32:
        return False
    n = scores.shape[-1]
    largest = CUDA_MAX_N if BACKEND == "cuda" else CUDA_AUTO_MAX_N
    last = sum((d - 1) * st for d, st in zip(scores.shape, scores.stride()))
    if not 0 < ranked <= n <= largest or last >= 2**31:  # (the kernel takes element offsets as 32-bit integers)
        return False
    if torch.version.hip is not None or not hasattr(torch.cuda, "_compile_kernel"):
        return False
    if torch.cuda.get_device_capability(scores.device) < (8, 0):  # __reduce_add_sync
        return False
    return _cuda_kernel(n) is not None


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
    """:func:`ranked_topk_reference` in one launch: the CUDA kernel where :func:`cuda_topk_supported`, else the
    Triton kernel where :func:`ranked_topk_supported`, else the reference.

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
    return _ranked_topk(scores, k, ranked, with_keep=False)[:2]


def ranked_topk_keep(scores: torch.Tensor, k: int, ranked: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ranked_topk` and the mask of tier 1's entries above ``-inf`` (``values[..., :k] > -inf``), which the
    CUDA kernel writes in the same launch.

    Args:
        scores: as :func:`ranked_topk`'s.
        k: entries of tier 1.
        ranked: entries of both tiers together.

    Returns:
        ``(indices, values, keep)``: as :func:`ranked_topk`'s, and ``keep`` ``[batch, rows, k]``, ``torch.bool``.
    """
    return _ranked_topk(scores, k, ranked, with_keep=True)


def _ranked_topk(scores: torch.Tensor, k: int, ranked: int, with_keep: bool) -> tuple:
    _check(scores, k, ranked)
    if cuda_topk_supported(scores, ranked):
        batch, rows, n = scores.shape
        indices = torch.empty((batch, rows, ranked), dtype=torch.int64, device=scores.device)
        values = torch.empty((batch, rows, ranked), dtype=torch.float32, device=scores.device)
        keep = torch.empty((batch, rows, k), dtype=torch.bool, device=scores.device) if with_keep else values
        if batch * rows:
            threads, _ = _cuda_layout(n)
            _cuda_kernel(n)(grid=(batch * rows, 1, 1), block=(threads, 1, 1),
                            args=[scores, indices, values, keep, rows, n, k, ranked, *scores.stride(),
                                  int(with_keep)])  # fmt: skip
        return indices, values, keep if with_keep else None
    indices, values = _ranked_topk_triton(scores, k, ranked)
    return indices, values, values[..., :k] > float("-inf") if with_keep else None


def _ranked_topk_triton(scores: torch.Tensor, k: int, ranked: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel where :func:`ranked_topk_supported`, else the reference."""
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
