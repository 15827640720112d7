"""The estimate of the unselected blocks' attention on tensor cores: a CUDA kernel compiled at run time (NVRTC).

Why CUDA: the Triton ``dot`` kernel (:mod:`hf_offload.kernels.tail`) decodes every key and value into float32 tiles
and spends most of its loop on layout conversions through shared memory. This kernel forms both products of a block
with ``mma.sync.m16n8k16`` (bfloat16 in, float32 accumulate) and decodes the codes straight into fragment registers,
the way the scoring kernel does (:mod:`hf_offload.kernels.quantkey_mma`):

* **Logits**: the block's 16 key rows are the rows of the product, the query heads its 8 columns, with the right-hand
  side ``kstep * q`` (per block; the scoring kernel's decode of the key codes and its right-hand side, unchanged).
  The block's constant ``q . kmin`` goes into the same accumulator as two more products per k tile: every row of
  the left-hand side is the block's ``kmin``, the right-hand side the query's bfloat16 high and low parts.
* **Online softmax** over the blocks, per query head, as flash-decoding: the block's largest logit and its sum of
  exponentials by warp shuffles, the running output rescaled where the maximum grows.
* **Values**: ``out[c, g] = sum_t v[t, c] p[t, g]``, the value channels as the product's rows (8 m-tiles of 16
  channels at ``head_dim`` 128) and the tokens as its k dimension. A fragment register holds two k positions, two
  tokens of one channel, while the codes lie token by token; one byte permute joins two tokens' code words into the
  two halves of a register, and the scoring kernel's masks then leave one channel's code in each half (a subnormal
  bfloat16, exact). The per-channel powers of two and ``vstep`` come back in one float32 multiply per output after
  the product, ``vmin`` as ``vmin * sum_t p``. The probabilities (the right-hand side) pass through a small
  transposing tile in shared memory, rounded to bfloat16.

The only roundings beyond float32 are ``kstep * q`` to bfloat16 and the query to its two bfloat16 parts (as in the
scoring kernel) and the probabilities in
the value product to bfloat16 (relative error under ``2**-8`` per term; the softmax's denominator and ``vmin``'s
share use the float32 ones). :func:`tail_emulated` computes exactly those roundings in pure torch, so the CPU tests
check the scheme against :func:`~hf_offload.kernels.tail.tail_attention_reference` and the CUDA tests check the
kernel against both.

One program takes one (sequence, KV head) and :data:`WARPS` ranges of :data:`BLOCKS_PER_WARP` blocks, one per warp;
each warp writes its range's partial softmax (the ``(o, m, l)`` of :func:`~hf_offload.kernels.tail.merge_ranges`).

Limits: 2- or 4-bit keys and values, 16-token blocks, ``head_dim`` 64, 128 or 256 (no padded channels), at most 8
query heads per KV head, bfloat16 minima and steps, an NVIDIA GPU of compute capability 9.0 or newer and
``torch.cuda._compile_kernel``; :func:`mma_supported` says whether all hold, and the caller runs the Triton kernel
otherwise.
"""

from __future__ import annotations

import warnings

import torch

from .quant import dequantize_keys
from .quantkey_mma import CUDA_COMMON, SHIFT

BLOCKS_PER_WARP = 16
"""Blocks of one sequence and KV head one warp walks (its range; at most 32: a lane per block's index)."""

WARPS = 4
"""Warps per program (read when a kernel is compiled and launched)."""

STAGES = 3
"""Blocks a warp keeps in flight through asynchronous copies into a ring in shared memory (``cp.async``; read when a
kernel is compiled): block ``j + STAGES - 1``'s codes, minima, steps and token flags are copied while block ``j`` is
estimated. Lowered where the ring would not fit the 48 KiB of static shared memory (:func:`stages`); 0 or 1: each
block is loaded straight into registers (a warp then waits for every block's loads)."""

SHARED_BYTES = 48 * 1024
"""Static shared memory a kernel may declare."""


def stages(head_dim: int, key_bits: int, value_bits: int) -> int:
    """The ring depth compiled for these settings: :data:`STAGES`, lowered until the ring (``WARPS * stages *
    (16 * head_dim * (key_bits + value_bits) / 8 + 8 * head_dim + 16)`` bytes) and the probabilities' tile fit
    :data:`SHARED_BYTES`; 0 where fewer than 2 fit."""
    slot = 2 * head_dim * (key_bits + value_bits) + 8 * head_dim + 16
    fits = (SHARED_BYTES - WARPS * 8 * 24 * 2) // (WARPS * slot)
    depth = min(STAGES, fits)
    return depth if depth >= 2 else 0

_SOURCE = CUDA_COMMON + r"""
#define NEG_INF __int_as_float(0xff800000)

// ---- keys: the scoring kernel's decode (quantkey_mma.py) ----
constexpr int KPER = 8 / KBITS;        // codes per byte
constexpr int KCPW = 4 * KPER;         // channels per 32-bit word
constexpr int KW = D * KBITS / 128;    // code words per token row and lane
constexpr int CH = KCPW * KW;          // key channels per lane (a contiguous range, D / 4 of them)
constexpr int KRB = D * KBITS / 8;     // code bytes per token row
// Register (p, s) of a word: channel KPER s + p in the lower half and KPER (s + 2) + p in the upper half, at bit
// KBIT(p) of its half.
__device__ __forceinline__ constexpr int KBIT(int p) { return KBITS == 2 && p < 3 ? 2 * p : 0; }
__device__ __forceinline__ u32 ktake(u32 x, int p, int s) {
    const u32 m = KBITS == 2 ? 0x00030003u : 0x000F000Fu;
    if (KBITS == 2) {
        if (s == 0) return p < 3 ? (x & (m << (2 * p))) : ((x >> 6) & m);
        return p < 3 ? ((x >> 8) & (m << (2 * p))) : ((x >> 14) & m);
    }
    return (x >> (4 * p + 8 * s)) & m;
}

// ---- values: two tokens' codes of one channel per register ----
constexpr int VC = D / 8;              // value channels per lane (rows g and g + 8 of each m tile)
constexpr int MT = D / 16;             // m tiles (16 channels each)
constexpr int VLB = VC * VBITS / 8;    // code bytes per token row and lane (2, 4, 8 or 16)
constexpr int VNW = VLB < 4 ? 1 : VLB / 4;  // 32-bit words per token row and lane
constexpr int VRB = D * VBITS / 8;     // code bytes per token row
constexpr int VCPW = 32 / VBITS;       // channels per word
// The lane's code words of one token row (its VC channels, VC g .. VC g + VC - 1).
__device__ __forceinline__ void vload(const unsigned char* p, u32* w) {
    if (VLB == 2) {
        w[0] = *reinterpret_cast<const unsigned short*>(p);
    } else if (VLB == 4) {
        w[0] = *reinterpret_cast<const u32*>(p);
    } else if (VLB == 8) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    }
}
// Lane channel c (0 .. VC - 1) of tokens a (lower half) and b (upper half) from their words: a subnormal bfloat16 in
// each half, code * 2**(VBIT(c) - 133).
__device__ __forceinline__ constexpr int VBIT(int c) { return VBITS == 2 ? 2 * (c & 3) : 4 * (c & 1); }
__device__ __forceinline__ u32 vtake(const u32* wa, const u32* wb, int c) {
    const int word = c / VCPW, half = (c % VCPW) / (VCPW / 2), j = c % (VCPW / 2);
    const u32 x = __byte_perm(wa[word], wb[word], half ? 0x7632 : 0x5410);
    if (VBITS == 2) return (j < 4 ? x : x >> 8) & (0x00030003u << (2 * (j & 3)));
    return (j < 2 ? x : x >> 8) & (0x000F000Fu << (4 * (j & 1)));
}

constexpr int KCB = 16 * KRB;          // one block's key codes, bytes
constexpr int VCB = 16 * VRB;          // and its value codes
#if STAGES  // asynchronous copies global -> shared (sm_80+), 16 bytes each, waited for in groups
// A ring slot: key codes, value codes, kstep, kmin, vstep, vmin (D bfloat16 values each), the 16 token flags.
constexpr int SLOT = KCB + VCB + 8 * D + 16;
__shared__ __align__(16) unsigned char ring[WARPS][STAGES][SLOT];
__device__ __forceinline__ unsigned char* ring_at(int warp, int slot) { return ring[warp][slot]; }
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {  // dst: a shared-memory address
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory"); }
// The 16-byte chunks of `bytes` bytes at src into dst (shared), spread over the warp's lanes.
template <int BYTES>
__device__ __forceinline__ void copy_region(unsigned dst, const unsigned char* src, int lane) {
#pragma unroll
    for (int i = 0; i < (BYTES / 16 + 31) / 32; ++i) {
        const int at = 16 * (lane + 32 * i);
        if (BYTES % 512 == 0 || at < BYTES) cp_async16(dst + at, src + at);
    }
}
// Start copying block n (block blk of the summaries) into `slot`.
__device__ __forceinline__ void issue_block(unsigned char* slot, const unsigned char* kcodes,
                                            const unsigned short* kstep, const unsigned short* kmin,
                                            const unsigned char* vcodes, const unsigned short* vstep,
                                            const unsigned short* vmin, const unsigned char* ok, long long b,
                                            long long h, int heads, int n_blocks, int k_stride, int v_stride, int n,
                                            long long blk, int lane) {
    const long long krow = (b * k_stride + blk) * heads + h, vrow = (b * v_stride + blk) * heads + h;
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(slot));
    copy_region<KCB>(dst, kcodes + krow * KCB, lane);
    copy_region<VCB>(dst + KCB, vcodes + vrow * VCB, lane);
    copy_region<2 * D>(dst + KCB + VCB, reinterpret_cast<const unsigned char*>(kstep + krow * D), lane);
    copy_region<2 * D>(dst + KCB + VCB + 2 * D, reinterpret_cast<const unsigned char*>(kmin + krow * D), lane);
    copy_region<2 * D>(dst + KCB + VCB + 4 * D, reinterpret_cast<const unsigned char*>(vstep + vrow * D), lane);
    copy_region<2 * D>(dst + KCB + VCB + 6 * D, reinterpret_cast<const unsigned char*>(vmin + vrow * D), lane);
    if (lane == 0) cp_async16(dst + KCB + VCB + 8 * D, ok + (b * n_blocks + n) * 16);
}
#endif

// One program: one (sequence, KV head) bh and WARPS ranges of PER_WARP blocks; warp w takes range
// blockIdx.y * WARPS + w of the n_blocks listed (block n is idx[b, n] of the summaries with HAS_INDEX).
// q: float32 [B, H, G, D], scaled; kcodes, vcodes: u8 [B, cap, H, 16, D * bits / 8]; kmin, kstep, vmin, vstep:
// bf16 [B, cap, H, D]; ok: u8 [B, N, 16]; idx: int64 [B, N]; o: float32 [B, H, S, G, D]; m, l: float32 [B, H, S, G].
extern "C" __global__ void __launch_bounds__(32 * WARPS) tail_mma(
    const float* __restrict__ q, const unsigned char* __restrict__ kcodes, const unsigned short* __restrict__ kmin,
    const unsigned short* __restrict__ kstep, const unsigned char* __restrict__ vcodes,
    const unsigned short* __restrict__ vmin, const unsigned short* __restrict__ vstep,
    const unsigned char* __restrict__ ok, const long long* __restrict__ idx, float* __restrict__ o_out,
    float* __restrict__ m_out, float* __restrict__ l_out, int n_blocks, int heads, int splits, int k_stride,
    int v_stride, int group) {
    __shared__ __align__(16) unsigned short pt[WARPS][8][16 + 8];  // probabilities, [head][token], bfloat16
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const long long bh = blockIdx.x;
    const long long b = bh / heads, h = bh % heads;
    const int split = blockIdx.y * WARPS + warp;
    if (split >= splits) return;
    const int first = split * PER_WARP;
    const int count = min(PER_WARP, n_blocks - first);

    // The query of head g over this lane's key channels c0 .. c0 + CH - 1, and the right-hand side factors.
    const int c0 = CH * t;
    float qv[CH];
#pragma unroll
    for (int i = 0; i < CH; i += 4) {
        const float4 v = g < group ? *reinterpret_cast<const float4*>(q + (bh * group + g) * D + c0 + i)
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
        qv[i] = v.x; qv[i + 1] = v.y; qv[i + 2] = v.z; qv[i + 3] = v.w;
    }
    u32 qs[2 * KPER * KW];
#pragma unroll
    for (int wi = 0; wi < KW; ++wi)
#pragma unroll
        for (int p = 0; p < KPER; ++p)
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const int lo = KCPW * wi + KPER * s + p;
                const float f = __int_as_float((127 + BEXP - KBIT(p)) << 23);  // 2**(BEXP - bit)
                qs[2 * KPER * wi + 2 * p + s] = bf16x2_of(qv[lo + 2 * KPER] * f, qv[lo] * f);
            }
    // The constant q . kmin as products too, into the same accumulator: every token row of the left-hand side is the
    // block's kmin (exact in bfloat16), the right-hand side the query times 2**-AEXP (the accumulator's unit) split
    // into a bfloat16 high and low part. K tile kt, positions 2t, 2t+1 -> channels c0 + 4kt + 0, 1; 2t+8, 2t+9 ->
    // + 2, 3 (the scoring kernel's constants).
    u32 qh[CH / 2], ql[CH / 2];
    {
        const float unit = __int_as_float((127 - AEXP) << 23);
#pragma unroll
        for (int i = 0; i < CH / 2; ++i) {
            const float x0 = qv[2 * i] * unit, x1 = qv[2 * i + 1] * unit;
            qh[i] = bf16x2_of(x1, x0);
            ql[i] = bf16x2_of(x1 - bf16_hi(qh[i]), x0 - bf16_lo(qh[i]));
        }
    }
    // Each lane's block of the range (lane j holds block first + j's row in the summaries).
    int mine = first + lane;
    if (HAS_INDEX && lane < count) mine = static_cast<int>(idx[b * n_blocks + first + lane]);

    const float scale = __int_as_float((127 + AEXP) << 23);  // key accumulator -> logits
    const float log2e = 1.4426950408889634f;
    // Running softmax of heads 2t + e (the same on the 8 lanes that share t) and the output of rows (channels)
    // VC g + 2i (acc[i][0..1]) and VC g + 2i + 1 (acc[i][2..3]), heads 2t, 2t + 1.
    float mx[2] = {NEG_INF, NEG_INF}, sm[2] = {0.f, 0.f};
    float acc[MT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;

#if STAGES  // the first blocks' copies
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        const int nb = __shfl_sync(0xffffffffu, mine, i < count ? i : 0);
        if (i < count)
            issue_block(ring_at(warp, i), kcodes, kstep, kmin, vcodes, vstep, vmin, ok, b, h, heads, n_blocks,
                        k_stride, v_stride, first + i, nb, lane);
        cp_commit();
    }
#endif
#pragma unroll 1
    for (int j = 0; j < count; ++j) {
#if STAGES  // block j + STAGES - 1 starts copying into the slot block j - 1 left; block j's copies are waited for
        __syncwarp();  // every lane has read block j - 1 from its slot
        {
            const int nj = j + STAGES - 1;
            const int nb = __shfl_sync(0xffffffffu, mine, nj < count ? nj : 0);
            if (nj < count)
                issue_block(ring_at(warp, nj % STAGES), kcodes, kstep, kmin, vcodes, vstep, vmin, ok, b, h, heads,
                            n_blocks, k_stride, v_stride, first + nj, nb, lane);
        }
        cp_commit();
        cp_wait();
        __syncwarp();  // and every lane's copies of block j are visible to the others
        const unsigned char* slot = ring_at(warp, j % STAGES);
        const unsigned char* kc_p = slot;
        const unsigned char* vc_p = slot + KCB;
        const unsigned short* ks_p = reinterpret_cast<const unsigned short*>(slot + KCB + VCB);
        const unsigned short* km_p = ks_p + D;
        const unsigned short* vs_p = ks_p + 2 * D;
        const unsigned short* vm_p = ks_p + 3 * D;
        const unsigned char* ok_p = slot + KCB + VCB + 8 * D;
#else
        const int n = first + j;
        const long long blk = __shfl_sync(0xffffffffu, mine, j);
        const long long krow = (b * k_stride + blk) * heads + h;
        const long long vrow = (b * v_stride + blk) * heads + h;
        const unsigned char* kc_p = kcodes + krow * KCB;
        const unsigned char* vc_p = vcodes + vrow * VCB;
        const unsigned short* ks_p = kstep + krow * D;
        const unsigned short* km_p = kmin + krow * D;
        const unsigned short* vs_p = vstep + vrow * D;
        const unsigned short* vm_p = vmin + vrow * D;
        const unsigned char* ok_p = ok + (b * n_blocks + n) * 16;
#endif
        // Loads: key code words of token rows g, g + 8; kstep and kmin of the lane's key channels; the token mask
        // of rows g, g + 8; value code words of tokens 2t, 2t + 1, 2t + 8, 2t + 9; vstep and vmin of its value
        // channels.
        u32 x0[KW], x1[KW], ks[CH / 2], km[CH / 2];
        {
            const unsigned char* base = kc_p + 4 * KW * t;
#pragma unroll
            for (int i = 0; i < KW; ++i) {
                x0[i] = *reinterpret_cast<const u32*>(base + g * KRB + 4 * i);
                x1[i] = *reinterpret_cast<const u32*>(base + (g + 8) * KRB + 4 * i);
            }
#pragma unroll
            for (int i = 0; i < CH / 2; i += 4) {
                const uint4 v = *reinterpret_cast<const uint4*>(ks_p + c0 + 2 * i);
                ks[i] = v.x; ks[i + 1] = v.y; ks[i + 2] = v.z; ks[i + 3] = v.w;
                const uint4 w = *reinterpret_cast<const uint4*>(km_p + c0 + 2 * i);
                km[i] = w.x; km[i + 1] = w.y; km[i + 2] = w.z; km[i + 3] = w.w;
            }
        }
        const bool ok0 = ok_p[g] != 0, ok1 = ok_p[g + 8] != 0;
        u32 va[VNW], vb[VNW], vc[VNW], vd[VNW], vs[VC / 2], vm[VC / 2];
        {
            const unsigned char* base = vc_p + VLB * g;
            vload(base + (2 * t) * VRB, va);
            vload(base + (2 * t + 1) * VRB, vb);
            vload(base + (2 * t + 8) * VRB, vc);
            vload(base + (2 * t + 9) * VRB, vd);
#pragma unroll
            for (int i = 0; i < VC / 2; i += 4) {  // (VC / 2 >= 4: head_dim >= 64)
                const uint4 v = *reinterpret_cast<const uint4*>(vs_p + VC * g + 2 * i);
                vs[i] = v.x; vs[i + 1] = v.y; vs[i + 2] = v.z; vs[i + 3] = v.w;
                const uint4 w = *reinterpret_cast<const uint4*>(vm_p + VC * g + 2 * i);
                vm[i] = w.x; vm[i + 1] = w.y; vm[i + 2] = w.z; vm[i + 3] = w.w;
            }
        }

        // Logits of token rows g, g + 8 (rows) and heads 2t, 2t + 1 (columns), times 2**-AEXP: the codes' products,
        // then the constant's.
        float lg[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int wi = 0; wi < KW; ++wi)
#pragma unroll
            for (int p = 0; p < KPER; ++p) {
                u32 bb[2];
#pragma unroll
                for (int s = 0; s < 2; ++s) {
                    const int lo = KCPW * wi + KPER * s + p;
                    const u32 pair = __byte_perm(ks[lo >> 1], ks[(lo + 2 * KPER) >> 1], (lo & 1) ? 0x7632 : 0x5410);
                    bb[s] = mul_bf16x2(pair, qs[2 * KPER * wi + 2 * p + s]);
                }
                mma(lg, ktake(x0[wi], p, 0), ktake(x1[wi], p, 0), ktake(x0[wi], p, 1), ktake(x1[wi], p, 1), bb[0],
                    bb[1]);
            }
        float ch[4] = {0.f, 0.f, 0.f, 0.f}, cl[4] = {0.f, 0.f, 0.f, 0.f};  // (three independent chains)
#pragma unroll
        for (int kt = 0; kt < CH / 4; ++kt) {
            mma(ch, km[2 * kt], km[2 * kt], km[2 * kt + 1], km[2 * kt + 1], qh[2 * kt], qh[2 * kt + 1]);
            mma(cl, km[2 * kt], km[2 * kt], km[2 * kt + 1], km[2 * kt + 1], ql[2 * kt], ql[2 * kt + 1]);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) lg[i] += ch[i] + cl[i];

        // Online softmax per head (column): the block's maximum over its 16 tokens, the probabilities, their sum.
        float x[4], p[4], rs[2], tot[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const bool head_ok = 2 * t + e < group;
            x[e] = ok0 && head_ok ? lg[e] * scale : NEG_INF;
            x[2 + e] = ok1 && head_ok ? lg[2 + e] * scale : NEG_INF;
            float top = fmaxf(x[e], x[2 + e]);
#pragma unroll
            for (int s = 4; s < 32; s <<= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, s));
            const float now = fmaxf(mx[e], top);
            const float shift = now == NEG_INF ? 0.f : now;
            rs[e] = ex2((mx[e] - shift) * log2e);  // 0 where nothing was attended before
            p[e] = ex2((x[e] - shift) * log2e);
            p[2 + e] = ex2((x[2 + e] - shift) * log2e);
            float sum = p[e] + p[2 + e];
#pragma unroll
            for (int s = 4; s < 32; s <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
            tot[e] = sum;
            sm[e] = fmaf(sm[e], rs[e], sum);
            mx[e] = now;
        }
        // The probabilities as the value product's right-hand side: [k = token, n = head] through the tile.
        const float up = __int_as_float((127 + BEXP) << 23);  // 2**BEXP keeps the products normal
        __syncwarp();  // the previous block's fragments are read
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const u32 two = bf16x2_of(p[2 + e] * up, p[e] * up);
            pt[warp][2 * t + e][g] = static_cast<unsigned short>(two & 0xffffu);
            pt[warp][2 * t + e][g + 8] = static_cast<unsigned short>(two >> 16);
        }
        __syncwarp();
        const u32 b0 = *reinterpret_cast<const u32*>(&pt[warp][g][2 * t]);
        const u32 b1 = *reinterpret_cast<const u32*>(&pt[warp][g][2 * t + 8]);

        // Values: m tile i, rows g (channel VC g + 2i) and g + 8 (VC g + 2i + 1), k = tokens 0 .. 15.
        const bool grow = rs[0] != 1.f || rs[1] != 1.f;
        const bool any_grow = __any_sync(0xffffffffu, grow);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            mma(d, vtake(va, vb, 2 * i), vtake(va, vb, 2 * i + 1), vtake(vc, vd, 2 * i), vtake(vc, vd, 2 * i + 1), b0,
                b1);
            // code * 2**(VBIT - 133) * p * 2**BEXP: times vstep * 2**(133 - BEXP - VBIT), plus vmin * sum p.
            const float f0 = bf16_lo(vs[i]) * __int_as_float((127 + AEXP - VBIT(2 * i)) << 23);
            const float f1 = bf16_hi(vs[i]) * __int_as_float((127 + AEXP - VBIT(2 * i + 1)) << 23);
            const float m0 = bf16_lo(vm[i]), m1 = bf16_hi(vm[i]);
            if (any_grow) {
                acc[i][0] *= rs[0]; acc[i][1] *= rs[1]; acc[i][2] *= rs[0]; acc[i][3] *= rs[1];
            }
            acc[i][0] = fmaf(d[0], f0, fmaf(tot[0], m0, acc[i][0]));
            acc[i][1] = fmaf(d[1], f0, fmaf(tot[1], m0, acc[i][1]));
            acc[i][2] = fmaf(d[2], f1, fmaf(tot[0], m1, acc[i][2]));
            acc[i][3] = fmaf(d[3], f1, fmaf(tot[1], m1, acc[i][3]));
        }
    }
    // The range's partial softmax: rows (split, head 2t + e), channels VC g + 2i (+1).
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int head = 2 * t + e;
        if (head >= group) continue;
        const long long row = (bh * splits + split) * group + head;
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            o_out[row * D + VC * g + 2 * i] = acc[i][e];
            o_out[row * D + VC * g + 2 * i + 1] = acc[i][2 + e];
        }
        if (g == 0) {
            m_out[row] = mx[e];
            l_out[row] = sm[e];
        }
    }
}
"""

_COMPILED: dict[tuple, object] = {}
_FAILED: str | None = None  # why compiling failed, once it has (then the kernel is not offered again)


def _kernel(head_dim: int, key_bits: int, value_bits: int, has_index: bool):
    """The compiled kernel for these settings and the current :data:`WARPS`, :data:`BLOCKS_PER_WARP` and
    :func:`stages` (compiled once per process each)."""
    depth = stages(head_dim, key_bits, value_bits)
    key = (head_dim, key_bits, value_bits, has_index, WARPS, BLOCKS_PER_WARP, depth)
    fn = _COMPILED.get(key)
    if fn is None:
        defines = {"D": head_dim, "KBITS": key_bits, "VBITS": value_bits, "WARPS": WARPS, "PER_WARP": BLOCKS_PER_WARP,
                   "HAS_INDEX": int(has_index), "BEXP": SHIFT, "AEXP": 133 - SHIFT, "STAGES": depth}  # fmt: skip
        source = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + _SOURCE
        fn = torch.cuda._compile_kernel(source, "tail_mma")
        _COMPILED[key] = fn
    return fn


def compiled(head_dim: int, key_bits: int, value_bits: int, has_index: bool):
    """The kernel for these settings, compiled on first use; ``None`` (with one warning per process) where NVRTC
    cannot build it, so that the caller runs the Triton kernel instead of failing a decode step."""
    global _FAILED
    if _FAILED is not None:
        return None
    try:
        return _kernel(head_dim, key_bits, value_bits, has_index)
    except Exception as e:  # the reason is kept and reported once; the Triton kernel estimates from here on
        _FAILED = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"hf_offload: the tensor-core tail kernel could not be compiled ({_FAILED[:300]}); estimating with the "
            "Triton kernel instead.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def mma_supported(
    query: torch.Tensor, keys: dict[str, torch.Tensor], key_bits: int, values: dict[str, torch.Tensor], value_bits: int,
    has_index: bool = True,
) -> bool:  # fmt: skip
    """Whether :func:`launch` can estimate these inputs (see the module's limits; the summaries' layout is the
    caller's check, :func:`hf_offload.kernels.quantkey.summaries_layout_ok`).

    Args:
        query: ``[batch, kv_heads, group, channels]``, any dtype and device.
        keys: ``codes`` (``[batch, n_blocks, kv_heads, block_tokens, channels * key_bits // 8]``, ``torch.uint8``),
            ``kmin`` and ``kstep`` (``[batch, n_blocks, kv_heads, channels]``).
        key_bits: bits per key code.
        values: the same for the values.
        value_bits: bits per value code.
        has_index: whether the blocks come through an index (compiled separately).
    """
    if not query.is_cuda or key_bits not in (2, 4) or value_bits not in (2, 4):
        return False
    head_dim = query.shape[-1]
    if head_dim not in (64, 128, 256) or query.shape[2] > 8 or keys["codes"].shape[3] != 16:
        return False
    for part, bits in ((keys, key_bits), (values, value_bits)):
        if part["kmin"].dtype != torch.bfloat16 or part["kstep"].dtype != torch.bfloat16:
            return False
        if part["kmin"].shape[-1] != head_dim or part["codes"].shape[-1] * 8 != head_dim * bits:
            return False
        if any(part[name].data_ptr() % 16 for name in ("codes", "kmin", "kstep")):  # read in 16-byte words
            return False
    if torch.version.hip is not None or not hasattr(torch.cuda, "_compile_kernel"):  # inline PTX: NVIDIA only
        return False
    if torch.cuda.get_device_capability(query.device) < (9, 0):
        return False
    return compiled(head_dim, key_bits, value_bits, has_index) is not None


def launch(
    query: torch.Tensor,
    keys: dict[str, torch.Tensor],
    key_bits: int,
    values: dict[str, torch.Tensor],
    value_bits: int,
    tokens_ok: torch.Tensor,
    index: torch.Tensor | None,
    k_stride: int,
    v_stride: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the kernel (no checks of the inputs, no host synchronisation; call :func:`mma_supported` first).

    Args:
        query: ``[batch, kv_heads, group, head_dim]``, float32, contiguous, CUDA, already multiplied by the softmax
            scale.
        keys: ``codes`` / ``kmin`` / ``kstep`` (``[batch, n_blocks, kv_heads, 16, ...]``, bfloat16 parameters), the
            first blocks of ``[batch, k_stride, ...]`` buffers, contiguous past the block dimension, same device.
        key_bits: 2 or 4.
        values: the same for the values (``v_stride`` blocks per sequence).
        value_bits: 2 or 4.
        tokens_ok: ``[batch, n, 16]``, ``torch.bool``, same device: the tokens to attend of the ``n`` blocks.
        index: ``[batch, n]``, ``torch.int64``: entry ``j`` is block ``index[b, j]`` of the summaries; ``None``: block
            ``j`` itself.
        k_stride, v_stride: blocks from one sequence's key (value) summaries to the next's.

    Returns:
        ``(o, m, l)`` of the ranges, ``[batch, kv_heads, splits, group, head_dim]`` and ``[batch, kv_heads, splits,
        group]``, float32 (see :func:`hf_offload.kernels.tail.merge_ranges`).
    """
    batch, heads, group, head_dim = query.shape
    n = tokens_ok.shape[1]
    splits = max(1, -(-n // BLOCKS_PER_WARP))
    if n == 0 or batch == 0:
        return (torch.zeros((batch, heads, 1, group, head_dim), dtype=torch.float32, device=query.device),
                torch.full((batch, heads, 1, group), float("-inf"), dtype=torch.float32, device=query.device),
                torch.zeros((batch, heads, 1, group), dtype=torch.float32, device=query.device))  # fmt: skip
    # Every range has a block, and its warp writes every row of its range: no fill needed.
    o = torch.empty((batch, heads, splits, group, head_dim), dtype=torch.float32, device=query.device)
    m = torch.empty((batch, heads, splits, group), dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    ok = tokens_ok.contiguous().view(torch.uint8)
    idx = index.contiguous() if index is not None else ok  # not read without an index
    kernel = _kernel(head_dim, key_bits, value_bits, index is not None)
    grid = (batch * heads, -(-splits // WARPS), 1)
    kernel(grid=grid, block=(32 * WARPS, 1, 1),
           args=[query, keys["codes"], keys["kmin"], keys["kstep"], values["codes"], values["kmin"], values["kstep"],
                 ok, idx, o, m, l, n, heads, splits, k_stride, v_stride, group])  # fmt: skip
    return o, m, l


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 and back."""
    return x.to(torch.bfloat16).float()


def tail_emulated(
    query: torch.Tensor,
    keys: dict[str, torch.Tensor],
    key_bits: int,
    values: dict[str, torch.Tensor],
    value_bits: int,
    tokens_ok: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in pure torch (any device): the estimate with ``kstep * q`` rounded as the kernel
    rounds it and the constant ``q . kmin`` from the query's bfloat16 high and low parts (the scoring kernel's
    :func:`~hf_offload.kernels.quantkey_mma.block_lse_emulated` rounding), and the probabilities of the value
    product rounded to bfloat16 relative to the largest logit (the kernel rounds them relative to the running
    maximum; the two agree but for an occasional last bit).

    Args:
        query: ``[batch, kv_heads, group, head_dim]``, float32, already multiplied by the softmax scale.
        keys: ``codes`` (``[batch, n, kv_heads, 16, head_dim * key_bits // 8]``, ``torch.uint8``), ``kmin`` and
            ``kstep`` (``[batch, n, kv_heads, head_dim]``, ``torch.bfloat16``): the blocks themselves.
        key_bits: 2 or 4.
        values: the same for the values.
        value_bits: 2 or 4.
        tokens_ok: ``[batch, n, 16]``, ``torch.bool``.

    Returns:
        ``(out, lse)`` as :func:`~hf_offload.kernels.tail.tail_attention_reference`'s.
    """
    head_dim = query.shape[-1]
    kmin, kstep = keys["kmin"], keys["kstep"]
    code = dequantize_keys(keys["codes"], torch.zeros_like(kmin), torch.ones_like(kmin), key_bits)  # [B, n, H, T, D]
    p = torch.arange(head_dim, device=query.device) % 4
    bit = torch.where((p < 3) & (key_bits == 2), 2 * p, torch.zeros_like(p)).float()
    f = torch.exp2(SHIFT - bit)
    qs = _round_bf16(query.float() * f)  # [B, H, G, D]
    w = _round_bf16(kstep.float()[:, :, :, None, :] * qs[:, None]) / f  # [B, n, H, G, D], exact division
    logits = torch.einsum("bnhtd,bnhgd->bhgnt", code, w)
    hi = _round_bf16(query.float())
    lo = _round_bf16(query.float() - hi)  # the constant from the query's bfloat16 high and low parts
    const = torch.einsum("bnhd,bhgd->bhgn", kmin.float(), hi) + torch.einsum("bnhd,bhgd->bhgn", kmin.float(), lo)
    logits = logits + const[..., None]
    logits = logits.masked_fill(~tokens_ok[:, None, None], float("-inf"))  # [B, H, G, n, T]
    top = logits.amax(dim=(-2, -1), keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    prob = torch.exp(logits - top)  # [B, H, G, n, T]
    total = prob.sum(dim=(-2, -1))  # [B, H, G]
    vcode = dequantize_keys(values["codes"], torch.zeros_like(values["kmin"]), torch.ones_like(values["kmin"]),
                            value_bits)  # fmt: skip
    numer = torch.einsum("bhgnt,bnhtd,bnhd->bhgd", _round_bf16(prob), vcode, values["kstep"].float())
    numer = numer + torch.einsum("bhgnt,bnhd->bhgd", prob, values["kmin"].float())
    some = total > 0
    out = torch.where(some[..., None], numer / torch.where(some, total, torch.ones_like(total))[..., None], 0.0)
    lse = torch.where(some, top[..., 0, 0] + torch.log(torch.where(some, total, torch.ones_like(total))),
                      torch.full_like(total, float("-inf")))  # fmt: skip
    return out, lse
