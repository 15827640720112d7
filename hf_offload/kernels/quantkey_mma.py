"""Block log-sum-exp over 2- or 4-bit quantized keys on tensor cores: a CUDA kernel compiled at run time (NVRTC).

Why CUDA: the Triton kernel (:mod:`hf_offload.kernels.quantkey`, ``v2``) forms every logit with float32
multiply-adds and is bound by that arithmetic; with 16 rows per block and a different right-hand side per block
(``kstep * q``), the layout conversions Triton puts around small tensor-core products cost more than they save. This
kernel controls the register layouts of ``mma.sync.m16n8k16`` (bfloat16 in, float32 accumulate) itself:

* **Codes go straight into the A fragments.** A fragment register holds two bfloat16 values, one in each 16-bit half.
  Masking a 32-bit word of packed 2-bit codes with ``0x00030003 << s`` leaves one code in each half, at bit ``s``:
  read as a bfloat16 whose exponent bits are zero, that half is the subnormal ``code * 2**s * 2**-133``, exactly. So
  a word of 16 codes becomes 8 fragment registers with 3 shifts and 8 bitwise ands (no conversion, no subtraction),
  and the power-of-two factors are folded into the right-hand side. 4-bit codes take one shift and one and per
  register (a word of 8 codes, 4 registers), each code at bit 0. Which code lands in which k position follows
  from the packing (:func:`hf_offload.kernels.quant.quantize_keys`); the right-hand side is built in the same
  order, so the format of the codes is unchanged.
* **One right-hand side per block**, ``B[k, g] = kstep[c] * q[g, c] * 2**(112 - s)`` for the channel ``c`` at
  position ``k``, formed with one packed bfloat16 multiply per register (two channels) from the block's ``kstep``
  and the query scaled once per program (so the products stay inside bfloat16's range for ``|kstep * q| <
  65536``). A block is one ``m16n8k16`` row tile (16 tokens) times ``head_dim / 16`` k tiles, with up to 8 query
  heads as the 8 columns.
* **The block's constant** ``q . kmin`` is itself a matrix product: 16 blocks as the rows, ``kmin`` (exact in
  bfloat16) times the query split into a bfloat16 high and low part (about 16 bits of the float32 query), two
  products per 16 blocks.
* **Log-sum-exp through a tile.** Each lane writes the four logits it holds into a tile in shared memory; every 8
  blocks each lane reduces one (block, query head) row of 16 tokens by itself, adds the block's constant and writes
  ``[batch, kv_heads, group, n_blocks]``, float32, as the Triton kernel does (:data:`TRANSPOSE`).
* **Loads ahead through shared memory.** Each warp copies its next blocks' codes and steps into a small ring in
  shared memory with ``cp.async`` (:data:`STAGES` blocks) while it scores the current one, so the loads in flight
  hold no registers.

The only rounding beyond float32 is of ``kstep * q`` to bfloat16 (twice: the scaled query, then the product; relative
error under 2**-8 per channel), small against the error of the codes themselves. :func:`block_lse_emulated` computes
exactly that rounding in pure torch, so the CPU tests check the scheme's accuracy against
:func:`~hf_offload.kernels.quantkey.block_lse_reference`, and the CUDA tests check the kernel against both.

Limits: 2- or 4-bit codes, 16-token blocks, ``head_dim`` 64, 128 or 256, at most 8 query heads per KV head, bfloat16
``kmin`` / ``kstep``, an NVIDIA GPU of compute capability 9.0 or newer (``mul.bf16x2``), and
``torch.cuda._compile_kernel`` (PyTorch's NVRTC wrapper). :func:`mma_supported` says whether all hold; the caller
falls back to the Triton kernel otherwise.

The module constants below are compile-time settings of the one kernel (read when a kernel is compiled; a
benchmark may set them before the first call); the library runs their defaults.
"""

from __future__ import annotations

import struct
import warnings

import torch

from .quant import dequantize_keys

SHIFT = 112
"""The right-hand side is ``kstep * q * 2**(SHIFT - s)``: a subnormal code times it is ``code * kstep * q *
2**(SHIFT - 133)``, so the accumulator holds the logits times ``2**(SHIFT - 133)``; ``SHIFT`` 112 keeps every
product inside bfloat16's range while ``|kstep * q| < 2**16`` and leaves it a normal float32 down to ``2**-105``."""

BLOCKS_PER_WARP = 16
"""Blocks one warp scores per pass (the rows of the product that gives each block's ``q . kmin``)."""

WARPS = 4
"""Warps per program (read when a kernel is compiled and launched)."""

PASSES = 1
"""Passes of 16 blocks one warp scores (read when a kernel is compiled and launched): the query's preparation (its
scaling, the right-hand side factors and the bfloat16 high and low parts) is done once for them all, and every
pass's constants are computed up front into shared memory; more passes keep more state in registers."""

PAIR = True
"""Whether two blocks share one right-hand side (read when a kernel is compiled; used where a KV head has at most 4
query heads, with :data:`TRANSPOSE` and a ring): at 4 query heads the product's columns 4-7 are empty, so lanes
``g >= 4`` build the next block's ``kstep * q`` there and the next block's product reads its logits from those
columns. Each block then costs half the step multiplies and permutes, and a pass runs two independent chains of
products."""

PAIR_STAGES = 2
"""The ring depth in pairs of blocks where two blocks share a right-hand side (:data:`PAIR`; at most :data:`STAGES`):
the ring then holds ``2 * PAIR_STAGES`` blocks."""

FAST_LOG = True
"""Whether a block's log-sum-exp takes the logarithm of its sum of exponentials (a number in [1, 16]) from the
hardware's base-2 logarithm (``lg2.approx``, absolute error about 2**-22) instead of ``logf``'s exact rounding
(read when a kernel is compiled)."""

UNROLL = 1
"""Blocks of a warp's pass unrolled into one loop iteration (read when a kernel is compiled)."""

CUDA_COMMON = r"""
typedef unsigned int u32;

__device__ __forceinline__ u32 bf16x2_of(float hi, float lo) {  // {hi: upper half, lo: lower half}, rounded
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ u32 mul_bf16x2(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ float bf16_lo(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(u32 x) { return __uint_as_float(x & 0xffff0000u); }
__device__ __forceinline__ float ex2(float x) {  // 2**x (relative error about 2**-22; tiny results flush to zero)
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""
"""CUDA helpers the tensor-core kernels share (bfloat16 pairs, ``ex2``, ``mma.sync.m16n8k16`` with bfloat16 inputs and
float32 accumulators), put before each kernel's source."""

_SOURCE = CUDA_COMMON + r"""
#define PRAGMA_(x) _Pragma(#x)
#define PRAGMA(x) PRAGMA_(x)
__device__ __forceinline__ float lg2(float x) {  // log2(x) (absolute error about 2**-22 for x in [1, 16])
    float r;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}
#if FASTLOG  // the natural logarithm of a block's sum of exponentials (in [1, 16])
#define LOG(x) (lg2(x) * 0.6931471805599453f)
#else
#define LOG(x) logf(x)
#endif
#if STAGES  // asynchronous copies global -> shared (sm_80+), 16 bytes each, waited for in groups
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {  // dst: a shared-memory address
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 1) : "memory"); }
#endif
constexpr int PER = 8 / BITS;         // codes per byte
constexpr int CPW = 4 * PER;          // channels per 32-bit word of codes
// Fragment register (p, s) of a word of packed codes (byte j holds channels PER j .. PER j + PER - 1, code p at bit
// BITS p): the code of channel PER s + p in the lower half and of channel PER (s + 2) + p in the upper half, at bit
// BIT(p) of its half.
__device__ __forceinline__ constexpr int BIT(int p) { return BITS == 2 && p < 3 ? 2 * p : 0; }
__device__ __forceinline__ u32 take(u32 x, int p, int s) {
    const u32 m = BITS == 2 ? 0x00030003u : 0x000F000Fu;
    u32 v;
    if (BITS == 2) {
        if (s == 0) v = p < 3 ? (x & (m << (2 * p))) : ((x >> 6) & m);
        else v = p < 3 ? ((x >> 8) & (m << (2 * p))) : ((x >> 14) & m);
    } else {
        v = (x >> (4 * p + 8 * s)) & m;
    }
    return v;
}

// Block `row` ((sequence, block, KV head) of the summaries): the code words of this thread's channels in token rows
// g and g + 8 (load_codes), kstep of its channels, two per register (load_steps), or both (load_block).
__device__ __forceinline__ void load_codes(const unsigned char* __restrict__ codes, long long row, int g, int t,
                                           u32* x0, u32* x1) {
    constexpr int W = D * BITS / 128, RB = D * BITS / 8;  // RB: code bytes per token row
    const unsigned char* base = codes + row * (16 * RB) + 4 * W * t;
    if (W == 1) {
        x0[0] = *reinterpret_cast<const u32*>(base + g * RB);
        x1[0] = *reinterpret_cast<const u32*>(base + (g + 8) * RB);
    } else {
#pragma unroll
        for (int i = 0; i < W; i += 2) {
            uint2 v0 = *reinterpret_cast<const uint2*>(base + g * RB + 4 * i);
            uint2 v1 = *reinterpret_cast<const uint2*>(base + (g + 8) * RB + 4 * i);
            x0[i] = v0.x; x0[i + 1] = v0.y; x1[i] = v1.x; x1[i + 1] = v1.y;
        }
    }
}
__device__ __forceinline__ void load_steps(const unsigned short* __restrict__ kstep, long long row, int t, u32* ks) {
    constexpr int CH = CPW * (D * BITS / 128);
#pragma unroll
    for (int i = 0; i < CH / 2; i += 4) {
        uint4 v = *reinterpret_cast<const uint4*>(kstep + row * D + CH * t + 2 * i);
        ks[i] = v.x; ks[i + 1] = v.y; ks[i + 2] = v.z; ks[i + 3] = v.w;
    }
}
__device__ __forceinline__ void load_block(const unsigned char* __restrict__ codes,
                                           const unsigned short* __restrict__ kstep, long long row, int g, int t,
                                           u32* x0, u32* x1, u32* ks) {
    load_codes(codes, row, g, t, x0, x1);
    load_steps(kstep, row, t, ks);
}

// The B fragment of word wi's codes at position p: kstep times the scaled query of channels lo and lo + 2 PER for
// register s (lo = CPW wi + PER s + p), from the block's kstep (two channels per register) and the query's factors.
__device__ __forceinline__ void rhs(const u32* ks, const u32* qs, int wi, int p, u32* bb) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
        const int lo = CPW * wi + PER * s + p;
        const u32 pair = __byte_perm(ks[lo >> 1], ks[(lo + 2 * PER) >> 1], (lo & 1) ? 0x7632 : 0x5410);
        bb[s] = mul_bf16x2(pair, qs[2 * PER * wi + 2 * p + s]);
    }
}

#if STAGES
constexpr int CODE_BYTES = 2 * D * BITS;           // one block's codes: 16 token rows of D * BITS / 8 bytes
constexpr int RING_BYTES = CODE_BYTES + 2 * D;     // and its kstep (D bfloat16 values), one ring slot
constexpr int CHUNKS = (RING_BYTES / 16 + 31) / 32;  // 16-byte copies per lane and block
// A lane's share of the copies of one block into a ring slot: chunk lane + 32 i of the slot, from the codes (the
// first CODE_BYTES) or from kstep; `src` points at it in block `first`'s row and moves `step` bytes per block.
struct Copies {
    const unsigned char* src[CHUNKS];
    long long step[CHUNKS];
    unsigned dst[CHUNKS];  // shared address in slot 0
    bool on[CHUNKS];
};
__device__ __forceinline__ Copies plan_copies(const unsigned char* __restrict__ codes,
                                              const unsigned short* __restrict__ kstep, long long row, int heads,
                                              unsigned ring, int lane) {
    Copies c;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const int at = 16 * (lane + 32 * i);
        c.on[i] = at < RING_BYTES;
        c.dst[i] = ring + at;
        if (at < CODE_BYTES) {
            c.src[i] = codes + row * CODE_BYTES + at;
            c.step[i] = static_cast<long long>(heads) * CODE_BYTES;
        } else {
            c.src[i] = reinterpret_cast<const unsigned char*>(kstep + row * D) + (at - CODE_BYTES);
            c.step[i] = static_cast<long long>(heads) * 2 * D;
        }
    }
    return c;
}
// Start copying block `j` (counted from the plan's first block) into ring slot `slot`.
__device__ __forceinline__ void issue_block(const Copies& c, int j, int slot) {
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i)
        if (c.on[i]) cp_async16(c.dst[i] + slot * RING_BYTES, c.src[i] + j * c.step[i]);
}
constexpr int STEP_BLOCKS = PAIR ? 2 : 1;  // blocks scored per loop iteration (and per group of copies)
constexpr int SLOTS = STEP_BLOCKS * STAGES;  // ring slots of one block each
// The copies of a pass's first STAGES - 1 iterations (of `count` blocks), one group per iteration.
__device__ __forceinline__ void prime(const Copies& c, int count) {
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
#pragma unroll
        for (int e = 0; e < STEP_BLOCKS; ++e)
            if (STEP_BLOCKS * i + e < count) issue_block(c, STEP_BLOCKS * i + e, STEP_BLOCKS * i + e);
        cp_commit();
    }
}
#endif

// One program: one (sequence, KV head) and WARPS * 16 blocks; one warp: 16 blocks.
// q: float32 or (QBF16) bfloat16 [B, H, G, D], times qscale_bits (a float32's bits) here; codes: u8
// [B, cap, H, 16, D/4]; kmin, kstep: bf16 [B, cap, H, D]; out: float32 [B, H, G, N].
#if MINBLOCKS
#define BOUNDS __launch_bounds__(32 * WARPS, MINBLOCKS)
#else
#define BOUNDS __launch_bounds__(32 * WARPS)
#endif
extern "C" __global__ void BOUNDS quantkey_mma(
    const void* __restrict__ q, const unsigned char* __restrict__ codes, const unsigned short* __restrict__ kmin,
    const unsigned short* __restrict__ kstep, float* __restrict__ out, int n_blocks, int heads, int stride, int group,
    int qscale_bits) {
    constexpr int W = D * BITS / 128;    // code words per token row and thread
    constexpr int CH = CPW * W;          // channels per thread (a contiguous range, D / 4 of them)
    constexpr int KT = D / 16;           // k tiles
#if TRANSPOSE  // the scaled logits of 8 blocks, [block][head][token] with rows of TP floats, and the constants
    __shared__ __align__(16) float tile[WARPS][8 * GROUP * TP];
    __shared__ float csts[WARPS][16 * PASSES][GROUP];
#else
    __shared__ float stage[WARPS][16][9];  // per block and head: largest scaled logit, then the sum of exponentials
    __shared__ float sums[WARPS][16][9];
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const long long bh = blockIdx.x;
    const long long b = bh / heads, h = bh % heads;
    // Pass p of this warp scores blocks first0 + 16 WARPS p .. + 15 (PASSES passes share the query's preparation).
    const int first0 = (blockIdx.y * WARPS * PASSES + warp) * 16;
    if (first0 >= n_blocks) return;
    const int c0 = CH * t;               // this thread's channels: c0 .. c0 + CH - 1
#if STAGES  // the first pass's first copies run while the query is prepared
    __shared__ __align__(16) unsigned char ring[WARPS][SLOTS][RING_BYTES];
    const unsigned ring0 = static_cast<unsigned>(__cvta_generic_to_shared(ring[warp][0]));
    prime(plan_copies(codes, kstep, (b * stride + first0) * heads + h, heads, ring0, lane), min(16, n_blocks - first0));
#endif

    // The query of head g over this thread's channels, in the two orders the products need.
    // (The softmax scale is applied here as torch would: the query in float32 times the scale in float32.)
    float qv[CH];
    const int qg = PAIR ? (g & 3) : g;  // the query head of B's column g (PAIR: columns 4-7 repeat heads 0-3)
    const bool head_ok = qg < group;
    const float qscale = __int_as_float(qscale_bits);
#pragma unroll
    for (int i = 0; i < CH; i += 4) {
#if QBF16
        const uint2 w = head_ok ? *reinterpret_cast<const uint2*>(
                                      static_cast<const unsigned short*>(q) + ((bh * group + qg) * D + c0 + i))
                                : make_uint2(0, 0);
        const float4 v = make_float4(bf16_lo(w.x), bf16_hi(w.x), bf16_lo(w.y), bf16_hi(w.y));
#else
        const float4 v = head_ok ? *reinterpret_cast<const float4*>(
                                       static_cast<const float*>(q) + ((bh * group + qg) * D + c0 + i))
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
#endif
        qv[i] = v.x * qscale; qv[i + 1] = v.y * qscale; qv[i + 2] = v.z * qscale; qv[i + 3] = v.w * qscale;
    }
    // Right-hand side factors of the code products: register (word wi, p, s) holds channels CPW wi + PER s + p and
    // that + 2 PER.
    u32 qs[2 * PER * W];
#pragma unroll
    for (int wi = 0; wi < W; ++wi)
#pragma unroll
        for (int p = 0; p < PER; ++p)
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const int lo = CPW * wi + PER * s + p;
                const float f = __int_as_float((127 + BEXP - BIT(p)) << 23);  // 2**(BEXP - bit)
                qs[2 * PER * wi + 2 * p + s] = bf16x2_of(qv[lo + 2 * PER] * f, qv[lo] * f);
            }
    // The constant's right-hand side: k tile kt, positions 2t, 2t+1 -> channels c0 + 4kt + 0, 1; 2t+8, 2t+9 -> + 2, 3.
    u32 qh[2 * KT], ql[2 * KT];
#pragma unroll
    for (int i = 0; i < 2 * KT; ++i) {
        const float x0 = qv[2 * i], x1 = qv[2 * i + 1];
        qh[i] = bf16x2_of(x1, x0);
        ql[i] = bf16x2_of(x1 - bf16_hi(qh[i]), x0 - bf16_lo(qh[i]));
    }

    // q . kmin of blocks first + g and first + g + 8 (rows), heads 2t and 2t+1 (columns), added into cst.
    auto constants = [&](int first, float* cst) {
        u32 ka[2][2 * KT];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int n = first + g + 8 * r;
            const long long row = ((b * stride + n) * heads + h) * D + c0;
#pragma unroll
            for (int i = 0; i < 2 * KT; i += 4) {
                uint4 v = n < n_blocks ? *reinterpret_cast<const uint4*>(kmin + row + 2 * i) : make_uint4(0, 0, 0, 0);
                ka[r][i] = v.x; ka[r][i + 1] = v.y; ka[r][i + 2] = v.z; ka[r][i + 3] = v.w;
            }
        }
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
            mma(cst, ka[0][2 * kt], ka[1][2 * kt], ka[0][2 * kt + 1], ka[1][2 * kt + 1], qh[2 * kt], qh[2 * kt + 1]);
            mma(cst, ka[0][2 * kt], ka[1][2 * kt], ka[0][2 * kt + 1], ka[1][2 * kt + 1], ql[2 * kt], ql[2 * kt + 1]);
        }
    };
#if TRANSPOSE  // every pass's constants into shared memory first, so that qh and ql need not outlive this loop
    // (lane (g, t) holds those of blocks first + g, first + g + 8 and heads 2t, 2t + 1)
#pragma unroll 1
    for (int pass = 0; pass < PASSES; ++pass) {
        const int first = first0 + pass * WARPS * 16;
        if (first >= n_blocks) break;
        float cst[4] = {0.f, 0.f, 0.f, 0.f};
        constants(first, cst);
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int e = 0; e < 2; ++e)
                if (2 * t + e < GROUP) csts[warp][16 * pass + g + 8 * r][2 * t + e] = cst[2 * r + e];
    }
#endif
    const float scale = __int_as_float((127 + AEXP) << 23);      // accumulator -> logits
    const float to_exp2 = scale * 1.4426950408889634f;
#pragma unroll 1
    for (int pass = 0; pass < PASSES; ++pass) {
        const int first = first0 + pass * WARPS * 16;
        if (first >= n_blocks) break;
        const int count = min(16, n_blocks - first);
        const long long row0 = (b * stride + first) * heads + h;  // block first + j is row row0 + j * heads
#if STAGES
        const Copies copies = plan_copies(codes, kstep, row0, heads, ring0, lane);
        if (pass > 0) prime(copies, count);  // (the first pass's were issued before the query's preparation)
#endif

#if !TRANSPOSE
        float cst[4] = {0.f, 0.f, 0.f, 0.f};
        constants(first, cst);
#endif
#if TRANSPOSE  // every 8 blocks and after the last, each lane reduces one (block, head) row of 16 tokens of the tile
        auto flush = [&](int last) {
            __syncwarp();
            const int base = last & ~7;
            for (int pair = lane; pair < 8 * GROUP; pair += 32) {
                const int jj = pair / GROUP, head = pair - jj * GROUP;
                if (base + jj > last) break;  // pairs run in block order: the rest lie past the last block
                const float4* v = reinterpret_cast<const float4*>(tile[warp] + pair * TP);
                float x[16];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float4 w = v[i];
                    x[4 * i] = w.x; x[4 * i + 1] = w.y; x[4 * i + 2] = w.z; x[4 * i + 3] = w.w;
                }
                float m = x[0];
#pragma unroll
                for (int i = 1; i < 16; ++i) m = fmaxf(m, x[i]);
                const float n = -m * to_exp2;
                float sum = 0.f;
#pragma unroll
                for (int i = 0; i < 16; ++i) sum += ex2(fmaf(x[i], to_exp2, n));
                const float lse = m * scale + LOG(sum) + csts[warp][16 * pass + base + jj][head];
                out[(bh * group + head) * n_blocks + first + base + jj] = lse;
            }
            __syncwarp();  // the tile is free for the next 8 blocks
        };
#endif
#if PAIR
        // Two blocks per iteration share one right-hand side: lanes g < 4 (columns 0-3) build block j's, lanes g >= 4
        // (columns 4-7, the same query heads) block j + 1's; block j's product is read from columns 0-3 (lanes t < 2),
        // block j + 1's from columns 4-7 (lanes t >= 2). Half the step multiplies and permutes per block, and the two
        // products are independent chains.
        u32 ks[CH / 2];
        for (int j = 0; j < count; j += 2) {
            __syncwarp();  // every lane has read blocks j - 2, j - 1 from their slots
            {
                const int nj = j + 2 * (STAGES - 1);
                if (nj < count) issue_block(copies, nj, nj % SLOTS);
                if (nj + 1 < count) issue_block(copies, nj + 1, (nj + 1) % SLOTS);
            }
            cp_commit();
            cp_wait();
            __syncwarp();  // and every lane's copies of blocks j, j + 1 are visible to the others
            const bool two = j + 1 < count;  // else slot j + 1 holds stale bytes, whose products are never stored
            const unsigned char* sa = ring[warp][j % SLOTS];
            const unsigned char* sb = ring[warp][(j + 1) % SLOTS];
            u32 xa0[W], xa1[W], xb0[W], xb1[W];
            load_codes(sa, 0, g, t, xa0, xa1);
            load_codes(sb, 0, g, t, xb0, xb1);
            load_steps(reinterpret_cast<const unsigned short*>((g >= 4 ? sb : sa) + CODE_BYTES), 0, t, ks);
            float acc[4] = {0.f, 0.f, 0.f, 0.f}, acc2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int wi = 0; wi < W; ++wi)
#pragma unroll
                for (int p = 0; p < PER; ++p) {
                    u32 bb[2];
                    rhs(ks, qs, wi, p, bb);
                    mma(acc, take(xa0[wi], p, 0), take(xa1[wi], p, 0), take(xa0[wi], p, 1), take(xa1[wi], p, 1), bb[0],
                        bb[1]);
                    mma(acc2, take(xb0[wi], p, 0), take(xb1[wi], p, 0), take(xb0[wi], p, 1), take(xb1[wi], p, 1), bb[0],
                        bb[1]);
                }
            // Lane (g, t) holds token rows g, g + 8 of block j + (t >> 1), heads 2 (t & 1) and that + 1.
            // (One base address per iteration, the four stores at fixed offsets from it.)
            const int second = t >> 1, hh = 2 * (t & 1);
            float* at = tile[warp] + ((j + second) & 7) * GROUP * TP + hh * TP + g;
            if (!second || two) {
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int e = 0; e < 2; ++e)
                        if (hh + e < GROUP) at[e * TP + 8 * r] = second ? acc2[2 * r + e] : acc[2 * r + e];
            }
            const int last = two ? j + 1 : j;
            if ((last & 7) == 7 || last == count - 1) flush(last);
        }
#else
        u32 x0[W], x1[W], ks[CH / 2];  // block j: code words of token rows g and g + 8; kstep of this thread's channels
#if !STAGES
        load_block(codes, kstep, row0, g, t, x0, x1, ks);
#endif
        PRAGMA(unroll UNROLL)
        for (int j = 0; j < count; ++j) {
#if STAGES  // block j + STAGES - 1 starts copying into the slot block j - 1 left; block j's copies are waited for
            __syncwarp();  // every lane has read block j - 1 from its slot
            if (j + STAGES - 1 < count)
                issue_block(copies, j + STAGES - 1, (j + STAGES - 1) % STAGES);
            cp_commit();
            cp_wait();
            __syncwarp();  // and every lane's copies of block j are visible to the others
            const unsigned char* slot = ring[warp][j % STAGES];
            load_block(slot, reinterpret_cast<const unsigned short*>(slot + CODE_BYTES), 0, g, t, x0, x1, ks);
#endif
#if PREFETCH && !STAGES  // the next block's loads are in flight while this one is scored
            u32 nx0[W], nx1[W], nks[CH / 2];
            if (j + 1 < count) load_block(codes, kstep, row0 + (j + 1) * heads, g, t, nx0, nx1, nks);
#endif
            float acc[4] = {0.f, 0.f, 0.f, 0.f};
#if CHAINS == 2  // odd products accumulate apart, halving the chain of dependent mma instructions
            float acc2[4] = {0.f, 0.f, 0.f, 0.f};
#endif
#pragma unroll
            for (int wi = 0; wi < W; ++wi)
#pragma unroll
                for (int p = 0; p < PER; ++p) {
                    u32 bb[2];
                    rhs(ks, qs, wi, p, bb);
#if CHAINS == 2
                    mma((PER * wi + p) & 1 ? acc2 : acc, take(x0[wi], p, 0), take(x1[wi], p, 0), take(x0[wi], p, 1),
                        take(x1[wi], p, 1), bb[0], bb[1]);
#else
                    mma(acc, take(x0[wi], p, 0), take(x1[wi], p, 0), take(x0[wi], p, 1), take(x1[wi], p, 1), bb[0],
                        bb[1]);
#endif
                }
#if CHAINS == 2
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] += acc2[i];
#endif
#if TRANSPOSE
            // Token rows g, g + 8 of heads 2t, 2t + 1 into the tile; every 8 blocks each lane reduces one (block, head)
            // row of 16 tokens on its own (no shuffles, no work for the columns past the group).
            float* at = tile[warp] + (j & 7) * GROUP * TP + 2 * t * TP + g;
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (2 * t + e < GROUP) at[e * TP + 8 * r] = acc[2 * r + e];
            if ((j & 7) == 7 || j == count - 1) flush(j);
#else
            // Log-sum-exp over the 16 tokens (rows g and g + 8 of the 8 lanes sharing t) of heads 2t and 2t + 1.
            float m0 = fmaxf(acc[0], acc[2]), m1 = fmaxf(acc[1], acc[3]);
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) {
                m0 = fmaxf(m0, __shfl_xor_sync(0xffffffffu, m0, o));
                m1 = fmaxf(m1, __shfl_xor_sync(0xffffffffu, m1, o));
            }
            const float n0 = -m0 * to_exp2, n1 = -m1 * to_exp2;
            float s0 = ex2(fmaf(acc[0], to_exp2, n0)) + ex2(fmaf(acc[2], to_exp2, n0));
            float s1 = ex2(fmaf(acc[1], to_exp2, n1)) + ex2(fmaf(acc[3], to_exp2, n1));
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) {
                s0 += __shfl_xor_sync(0xffffffffu, s0, o);
                s1 += __shfl_xor_sync(0xffffffffu, s1, o);
            }
            if (g == 0) {  // the logarithm waits for the end of the pass (one per value and lane there)
                stage[warp][j][2 * t] = m0;
                stage[warp][j][2 * t + 1] = m1;
                sums[warp][j][2 * t] = s0;
                sums[warp][j][2 * t + 1] = s1;
            }
#endif
#if STAGES
#elif PREFETCH
#pragma unroll
            for (int i = 0; i < W; ++i) { x0[i] = nx0[i]; x1[i] = nx1[i]; }
#pragma unroll
            for (int i = 0; i < CH / 2; ++i) ks[i] = nks[i];
#else
            if (j + 1 < count) load_block(codes, kstep, row0 + (j + 1) * heads, g, t, x0, x1, ks);
#endif
        }
#endif  // PAIR
#if !TRANSPOSE
        __syncwarp();
        // Lane (g, t) adds the constants it holds: blocks first + g, first + g + 8; heads 2t, 2t + 1.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int j = g + 8 * r;
            if (j >= count) continue;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int head = 2 * t + e;
                if (head < group)
                    out[(bh * group + head) * n_blocks + first + j] =
                        stage[warp][j][head] * scale + logf(sums[warp][j][head]) + cst[2 * r + e];
            }
        }
#endif
        __syncwarp();  // every lane is done with this pass's shared memory
    }  // passes
}
"""

PREFETCH = False
"""Whether a warp loads the next block's codes and steps into registers before scoring the current one, where there
is no ring (read when a kernel is compiled). Off: the extra registers cost more than the latency they hide."""

CHAINS = 1
"""Accumulators per block (read when a kernel is compiled): 1, or 2 (the products of odd register pairs go to a
second accumulator, summed at the end: half as long a chain of dependent ``mma`` instructions, 4 more registers;
the float32 sum runs in another order)."""

MIN_BLOCKS: int | None = 0
"""Programs per multiprocessor the compiler is asked to fit (``__launch_bounds__``' second argument; read when a
kernel is compiled): 0 leaves the registers to the compiler, 8 caps them at 64 per thread, 7 at 72; ``None``: 7
for ``head_dim`` up to 128, 0 above."""


def min_blocks(head_dim: int) -> int:
    """The ``__launch_bounds__`` programs per multiprocessor compiled for ``head_dim`` (:data:`MIN_BLOCKS`)."""
    if MIN_BLOCKS is None:
        return 7 if head_dim <= 128 else 0
    return MIN_BLOCKS


STAGES = 3
"""Blocks a warp keeps in flight through asynchronous copies into a ring in shared memory (``cp.async``; read when a
kernel is compiled): block ``j + STAGES - 1``'s codes and steps are copied while block ``j`` is scored, without
holding registers as :data:`PREFETCH` does. 0: each block is loaded straight into registers when the previous one
is done. Capped where the ring would not fit the 48 KiB of static shared memory (:func:`stages`)."""

TRANSPOSE = True
"""How a block's 16 logits per query head become its log-sum-exp (read when a kernel is compiled). ``True``: each lane
writes the four logits it holds into a tile in shared memory, and every 8 blocks each lane reduces one (block, head)
row of 16 tokens by itself, so a block costs 4 stores and an eighth of one lane's row reduction instead of 12
dependent warp shuffles, and heads past the group cost nothing. ``False``: the shuffles, every lane reducing its
rows of heads ``2t, 2t + 1`` across the 8 lanes that share ``t``."""

TILE_ROW = 20
"""Floats per (block, head) row of the transposed tile: 16 tokens and 4 of padding, so that the stores of one
instruction (heads ``2t, 2t + 1``, tokens ``g``) fall in 32 different banks and each row starts 16-byte aligned."""

SHARED_BYTES = 48 * 1024
"""Static shared memory a kernel may declare."""


def staging_bytes(group: int = 8) -> int:
    """Shared memory of a program besides its ring: the transposed tile and the constants (:data:`TRANSPOSE`:
    ``WARPS * (8 * group * TILE_ROW + 16 * PASSES * group)`` floats) or the per-block staging arrays
    (``2 * WARPS * 16 * 9`` floats)."""
    if TRANSPOSE:
        return 4 * WARPS * (8 * group * TILE_ROW + 16 * PASSES * group)
    return 4 * 2 * WARPS * 16 * 9


def paired(group: int, depth: int) -> bool:
    """Whether a kernel for ``group`` query heads per KV head and a ring of ``depth`` scores two blocks per right-hand
    side (:data:`PAIR`)."""
    return bool(PAIR) and TRANSPOSE and group <= 4 and depth >= 2


def stages(head_dim: int, bits: int, group: int = 8) -> int:
    """The ring depth compiled for ``head_dim``, ``bits`` and ``group`` query heads per KV head: :data:`STAGES`,
    lowered until the ring (``WARPS * stages * (2 * head_dim * bits + 2 * head_dim)`` bytes) and
    :func:`staging_bytes` fit :data:`SHARED_BYTES`; 0 or 1 mean no ring (a ring of one block would only serialise
    the copies)."""
    pair = paired(group, 2)
    ring = WARPS * (2 * head_dim * bits + 2 * head_dim) * (2 if pair else 1)
    fits = (SHARED_BYTES - staging_bytes(group)) // ring
    depth = min(STAGES, PAIR_STAGES, fits) if pair else min(STAGES, fits)
    return depth if depth >= 2 else 0


_COMPILED: dict[tuple, object] = {}
_FAILED: str | None = None  # why compiling failed, once it has (then the kernel is not offered again)


def _kernel(head_dim: int, bits: int = 2, group: int = 8, query_bf16: bool = False):
    """The compiled kernel for ``head_dim``, ``bits``, ``group`` query heads per KV head (1-8), a
    bfloat16 (``query_bf16``) or float32 query and the current :data:`PREFETCH`, :data:`WARPS`, :data:`UNROLL`,
    :data:`CHAINS`, :data:`MIN_BLOCKS`, :data:`TRANSPOSE` and :func:`stages` (compiled once per process each)."""
    bounds, depth = min_blocks(head_dim), stages(head_dim, bits, group)
    pair = paired(group, depth)
    key = (head_dim, bits, group, query_bf16, PREFETCH, WARPS, UNROLL, CHAINS, bounds, TRANSPOSE, depth,
           PASSES, pair, FAST_LOG)
    fn = _COMPILED.get(key)
    if fn is None:
        defines = {"D": head_dim, "BITS": bits, "WARPS": WARPS, "BEXP": SHIFT, "AEXP": 133 - SHIFT,
                   "PREFETCH": int(PREFETCH), "UNROLL": UNROLL, "CHAINS": CHAINS, "MINBLOCKS": bounds,
                   "STAGES": depth, "GROUP": group, "TRANSPOSE": int(TRANSPOSE), "TP": TILE_ROW,
                   "QBF16": int(query_bf16), "PASSES": PASSES, "PAIR": int(pair),
                   "FASTLOG": int(FAST_LOG)}  # fmt: skip
        source = "".join(f"#define {k} {v}\n" for k, v in defines.items()) + _SOURCE
        fn = torch.cuda._compile_kernel(source, "quantkey_mma")
        _COMPILED[key] = fn
    return fn


def mma_supported(query: torch.Tensor, codes: torch.Tensor, kmin: torch.Tensor, bits: int) -> bool:
    """Whether :func:`launch` can score these inputs (see the module's limits).

    Args:
        query: ``[batch, kv_heads, group, head_dim]``, any dtype and device.
        codes: ``[batch, n_blocks, kv_heads, block_tokens, head_dim * bits // 8]``, ``torch.uint8``.
        kmin: ``[batch, n_blocks, kv_heads, head_dim]``.
        bits: bits per code.
    """
    if not (query.is_cuda and bits in (2, 4) and codes.shape[3] == 16 and kmin.dtype == torch.bfloat16):
        return False
    head_dim = query.shape[-1]
    if head_dim not in (64, 128, 256) or query.shape[2] > 8 or codes.shape[-1] * 8 != head_dim * bits:
        return False
    if torch.version.hip is not None or not hasattr(torch.cuda, "_compile_kernel"):  # inline PTX: NVIDIA only
        return False
    if torch.cuda.get_device_capability(query.device) < (9, 0):
        return False
    return compiled(head_dim, bits, group=query.shape[2]) is not None


def compiled(head_dim: int, bits: int, group: int = 8):
    """The kernel for these settings, compiled on first use; ``None`` (with one warning per process) where NVRTC
    cannot build it (no NVRTC library, a toolkit too old for sm_90's instructions, ...), so that the caller falls
    back to the Triton kernel instead of failing a decode step."""
    global _FAILED
    if _FAILED is not None:
        return None
    try:
        return _kernel(head_dim, bits, group)
    except Exception as e:  # the reason is kept and reported once; the Triton kernel scores from here on
        _FAILED = f"{type(e).__name__}: {e}"
        warnings.warn(
            f"hf_offload: the tensor-core quantkey kernel could not be compiled ({_FAILED[:300]}); scoring with "
            "the Triton kernel instead.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def launch(
    query: torch.Tensor,
    codes: torch.Tensor,
    kmin: torch.Tensor,
    kstep: torch.Tensor,
    out: torch.Tensor,
    block_stride: int,
    bits: int = 2,
    scaling: float = 1.0,
) -> torch.Tensor:
    """Run the kernel into ``out`` (no checks of the inputs, no host synchronisation; call :func:`mma_supported`
    first).

    Args:
        query: ``[batch, kv_heads, group, head_dim]``, float32 or bfloat16, contiguous, CUDA; the kernel scores
            ``query.float() * scaling`` (the same float32 product torch forms), so a float32 query may come already
            scaled (``scaling`` 1.0) and a bfloat16 one needs no conversion launch.
        codes: ``[batch, n_blocks, kv_heads, 16, head_dim * bits // 8]``, ``torch.uint8``, same device: the first
            ``n_blocks`` blocks of a ``[batch, block_stride, ...]`` buffer, contiguous past the block dimension.
        kmin: ``[batch, n_blocks, kv_heads, head_dim]``, ``torch.bfloat16``, same device and block capacity.
        kstep: same shape, dtype, device and layout as ``kmin``.
        out: ``[batch, kv_heads, group, n_blocks]``, float32, contiguous, same device; written in full.
        block_stride: blocks from one sequence's summaries to the next's.
        bits: bits per code, 2 or 4.
        scaling: the softmax scale, applied in float32.

    Returns:
        ``out``.
    """
    batch, heads, group, head_dim = query.shape
    n_blocks = codes.shape[1]
    if n_blocks == 0 or batch == 0:
        return out
    per_program = WARPS * BLOCKS_PER_WARP * PASSES
    grid = (batch * heads, -(-n_blocks // per_program), 1)
    qscale_bits = struct.unpack("<i", struct.pack("<f", scaling))[0]  # rounded to float32 as torch rounds it
    kernel = _kernel(head_dim, bits, group, query.dtype == torch.bfloat16)
    kernel(grid=grid, block=(32 * WARPS, 1, 1),
           args=[query, codes, kmin, kstep, out, n_blocks, heads, block_stride, group, qscale_bits])  # fmt: skip
    return out


def _round_bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 and back."""
    return x.to(torch.bfloat16).float()


def block_lse_emulated(
    query: torch.Tensor, codes: torch.Tensor, kmin: torch.Tensor, kstep: torch.Tensor, bits: int = 2
) -> torch.Tensor:
    """What the kernel computes, in pure torch (any device): the block log-sum-exp with ``kstep * q`` rounded as the
    kernel rounds it and the constant ``q . kmin`` from the query's bfloat16 high and low parts.

    Args:
        query: ``[batch, kv_heads, group, head_dim]``, float32, already multiplied by the softmax scale.
        codes: ``[batch, n_blocks, kv_heads, block_tokens, head_dim * bits // 8]``, ``torch.uint8``.
        kmin: ``[batch, n_blocks, kv_heads, head_dim]``, ``torch.bfloat16``.
        kstep: same as ``kmin``.
        bits: bits per code, 2 or 4.

    Returns:
        ``[batch, kv_heads, group, n_blocks]``, float32.
    """
    head_dim = query.shape[-1]
    zero = torch.zeros_like(kmin)
    code = dequantize_keys(codes, zero, torch.ones_like(kmin), bits)  # [B, N, H, T, D] float32 codes
    # The power of two the code carries at its bit position: 2-bit codes 2**(2p) for p = channel % 4 < 3, else 1;
    # 4-bit codes 1 (a shift puts each at bit 0).
    p = torch.arange(head_dim, device=query.device) % 4
    bit = torch.where((p < 3) & (bits == 2), 2 * p, torch.zeros_like(p)).float()
    f = torch.exp2(SHIFT - bit)  # [D]
    qs = _round_bf16(query.float() * f)  # [B, H, G, D]
    w = _round_bf16(kstep.float()[:, :, :, None, :] * qs[:, None])  # [B, N, H, G, D]
    w = w / f  # exact: a power of two
    logits = torch.einsum("bnhtd,bnhgd->bhgnt", code, w)
    hi = _round_bf16(query.float())
    lo = _round_bf16(query.float() - hi)
    const = torch.einsum("bnhd,bhgd->bhgn", kmin.float(), hi) + torch.einsum("bnhd,bhgd->bhgn", kmin.float(), lo)
    return logits.logsumexp(dim=-1) + const
