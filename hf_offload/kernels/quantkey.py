"""Block log-sum-exp of decode logits over quantized keys, in one launch (the ``quantkey`` selector's scoring).

Why a kernel: the pure-torch scoring dequantizes every key into a float32 temporary, four bytes per element where
the codes take a quarter or an eighth of one. The kernel reads each code once, decodes it in registers and reduces
each block's logits to their log-sum-exp per query head, so only ``[batch, kv_heads, group, n_blocks]`` floats leave
it; the softmax over blocks that follows is exactly the softmax over all keys summed per block.

:func:`block_lse` picks the kernel by itself: the tensor-core CUDA kernel of :mod:`hf_offload.kernels.quantkey_mma`
where :func:`~hf_offload.kernels.quantkey_mma.mma_supported` allows it (2- or 4-bit codes, 16-token blocks, bfloat16
summaries, compute capability 9.0+), else the Triton kernel below (float32 multiply-adds, any supported shape), else
:func:`block_lse_reference`, the pure-torch reference the tests compare both with. Nothing is chosen through the
environment. The codes' layout is :mod:`hf_offload.kernels.quant`'s.
"""

from __future__ import annotations

import torch

from . import quantkey_mma
from .gather import kernels_available, tl, triton
from .quant import dequantize_keys

REFERENCE_CHUNK_BYTES = 2 << 20
"""Most bytes of float32 keys :func:`block_lse_reference` dequantizes at a time."""


def block_lse_reference(
    query: torch.Tensor, codes: torch.Tensor, kmin: torch.Tensor, kstep: torch.Tensor, bits: int, chunk_blocks: int = 512
) -> torch.Tensor:
    """Log-sum-exp over each block's tokens of ``query . key`` for dequantized keys, in pure torch.

    The keys of a chunk of blocks are dequantized straight into the layout of one batched matrix product per
    (sequence, KV head), ``[channels, blocks * block_tokens]`` (:func:`dequantize_keys`' ``"bhcnt"``), so no copy
    of them is made into another order; a chunk's float32 keys take at most about :data:`REFERENCE_CHUNK_BYTES`
    (a temporary that stays in the processor's caches), whatever ``chunk_blocks``.

    Args:
        query: decode queries, already multiplied by the softmax scale, ``[batch, kv_heads, group, head_dim]``,
            float32, any device.
        codes: ``[batch, n_blocks, kv_heads, block_tokens, head_dim * bits // 8]``, ``torch.uint8``, same device.
        kmin: ``[batch, n_blocks, kv_heads, head_dim]``, float dtype, same device.
        kstep: same shape, dtype and device as ``kmin``.
        bits: bits per code (1, 2, 4 or 8).
        chunk_blocks: most blocks dequantized at a time (bounds the float32 temporary).

    Returns:
        ``[batch, kv_heads, group, n_blocks]``, float32.
    """
    batch, n, heads, tokens = codes.shape[:4]
    per_block = batch * heads * tokens * query.shape[-1] * 4  # bytes of one block's float32 keys
    chunk = max(1, min(chunk_blocks, REFERENCE_CHUNK_BYTES // max(1, per_block)))
    parts = []
    for start in range(0, n, chunk):
        part = slice(start, min(n, start + chunk))
        keys = dequantize_keys(codes[:, part], kmin[:, part], kstep[:, part], bits, "bhcnt")  # [B, H, D, n, T]
        logits = torch.matmul(query, keys.flatten(-2)).unflatten(-1, keys.shape[-2:])  # [B, H, G, n, T]
        parts.append(logits.logsumexp(dim=-1))
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=-1) if parts else query.new_empty((*query.shape[:-1], 0))


def block_lse_supported(query: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether :func:`block_lse` can run the kernel for these tensors (Triton on their device; power-of-two
    ``head_dim`` and ``block_tokens``)."""
    head_dim, tokens = query.shape[-1], codes.shape[3]
    return (
        kernels_available(query.device)
        and head_dim & (head_dim - 1) == 0
        and tokens & (tokens - 1) == 0
        and head_dim * tokens <= 1 << 15
    )


if triton is not None:

    @triton.jit
    def _block_lse_kernel(
        q_ptr,  # float32 [B, H, G, D]
        codes_ptr,  # uint8 [B, N, H, T, D // PER], sequences block_stride blocks apart
        kmin_ptr,  # [B, N, H, D], sequences block_stride blocks apart
        kstep_ptr,  # [B, N, H, D], sequences block_stride blocks apart
        out_ptr,  # float32 [B, H, G, N]
        n_blocks,
        heads,
        block_stride,  # blocks from one sequence's summaries to the next's (>= n_blocks: buffers with capacity)
        G: tl.constexpr,
        T: tl.constexpr,
        D: tl.constexpr,
        BITS: tl.constexpr,
        VB: tl.constexpr,
        TT: tl.constexpr,
        UNIT: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # One program: one (batch, KV head) and BLOCK_N blocks. A thread owns VB consecutive code bytes (CH
        # channels) of TT token rows of one block. Tensors are laid out [NT, TO, BLOCK_N, TT, ...]: lanes run over
        # the NT threads that share a row, then over the TO groups of TT rows of a block, then over blocks, and the
        # TT rows stay inside the thread (the order in which Triton's coalescing gives lanes to dimensions of equal
        # contiguity). So every thread reads each of its code bytes once, all sums over its channels and rows stay
        # in registers (only the NT partial sums of a row, and the TO row groups of a block in the log-sum-exp,
        # meet, through shuffles), the loop uses no shared memory, and all G query heads are scored from each
        # decoded code. The loop walks the thread's channels one unit (32-bit word, or byte) at a time, loading
        # that unit of its TT rows and the block's parameters of the unit's channels, which keeps registers and
        # compile time low. Per block and channel the weights kstep * q are formed once:
        # logits[t, g] = sum_d kmin[d] q[g, d] + sum_d code[t, d] (kstep[d] q[g, d]).
        PER: tl.constexpr = 8 // BITS  # codes per byte
        DB: tl.constexpr = D // PER  # code bytes per token row
        NT: tl.constexpr = DB // VB  # threads per token row
        TO: tl.constexpr = T // TT  # threads per block and channel range
        NU: tl.constexpr = VB // UNIT  # units (32-bit words, or bytes) per thread and row
        HALVES: tl.constexpr = 2 if UNIT == 4 else 1  # 16-bit halves per unit
        BH: tl.constexpr = 2 if UNIT == 4 else 1  # bytes per half
        CH: tl.constexpr = VB * PER  # channels per thread
        PBITS: tl.constexpr = kmin_ptr.dtype.element_ty.primitive_bitwidth
        PINT: tl.constexpr = tl.int16 if PBITS == 16 else tl.int32
        MAGIC: tl.constexpr = 0x4B000000  # bits of the float 2**23
        bh = tl.program_id(0).to(tl.int64)
        b = bh // heads
        h = bh % heads
        n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = n < n_blocks
        row = (b * block_stride + n) * heads + h  # [BLOCK_N]: (b, n, h) of the summaries
        nt = tl.arange(0, NT)[:, None, None, None, None]
        to = tl.arange(0, TO)[None, :, None, None, None]
        blk = row[None, None, :, None, None]
        tt = tl.arange(0, TT)[None, None, None, :, None]
        CU: tl.constexpr = UNIT * PER  # channels per unit
        VEC: tl.constexpr = 128 // PBITS if CU * PBITS >= 128 else CU  # parameters per 16-byte load
        NV: tl.constexpr = CU // VEC
        nv = tl.arange(0, NV)
        vec = tl.arange(0, VEC)
        pos = (nv[:, None] * VEC + vec[None, :])[None, None, None, None, :, :]  # channel within the unit
        q_at = tl.arange(0, NT)[:, None, None, None] * CH  # [NT, 1, 1, 1]
        codes_at = (blk * T + to * TT + tt) * (DB // UNIT) + nt * (VB // UNIT)  # [NT, TO, BLOCK_N, TT, 1]
        params_at = (blk * D + nt * CH + to * 0)[:, :, :, :, :, None] + pos  # [NT, TO, BLOCK_N, 1, NV, VEC]
        live5 = live[None, None, :, None, None]
        live6 = live[None, None, :, None, None, None]
        accs = ()  # per query head, sum over the thread's channels of code * kstep * q: [NT, TO, BLOCK_N, TT]
        consts = ()  # per query head, sum over the thread's channels of kmin * q: [NT, TO, BLOCK_N, 1]
        for g in tl.static_range(G):
            accs = accs + (tl.zeros((NT, TO, BLOCK_N, TT), dtype=tl.float32),)
            consts = consts + (tl.zeros((NT, TO, BLOCK_N, 1), dtype=tl.float32),)
        for u in range(NU):
            if UNIT == 4:
                unit = tl.load(codes_ptr.to(tl.pointer_type(tl.int32)) + codes_at + u, mask=live5, other=0)
            else:
                unit = tl.load(codes_ptr + codes_at + u, mask=live5, other=0).to(tl.int32)
            unit = tl.sum(unit, axis=4)  # [NT, TO, BLOCK_N, TT]
            kmin_u = tl.load(kmin_ptr + params_at + u * CU, mask=live6, other=0.0).to(PINT, bitcast=True)
            kstep_u = tl.load(kstep_ptr + params_at + u * CU, mask=live6, other=0.0).to(PINT, bitcast=True)
            for hh in tl.static_range(HALVES):
                if hh == 0:
                    half = (unit & 0xFFFF) | MAGIC
                else:
                    half = ((unit >> 16) & 0xFFFF) | MAGIC
                for i in tl.static_range(BH):
                    for p in tl.static_range(PER):
                        # Codes become floats without a conversion or a shift: the half OR 2**23's bits, masked
                        # to the code's bits (in place at bit s), is the float 2**23 + code * 2**s; subtracting
                        # 2**23 leaves code * 2**s exactly, and the step is scaled by 2**-s instead (exact too).
                        held = half & ((((1 << BITS) - 1) << (8 * i + BITS * p)) | MAGIC)
                        code = held.to(tl.float32, bitcast=True) - 8388608.0  # code * 2**s
                        c = (hh * BH + i) * PER + p  # channel within the unit
                        pick = pos == c  # a constant per register: the sums below pick one value, no arithmetic
                        kmin = tl.sum(tl.sum(tl.where(pick, kmin_u, 0), axis=5), axis=4)
                        kstep = tl.sum(tl.sum(tl.where(pick, kstep_u, 0), axis=5), axis=4)
                        kmin = kmin.to(PINT).to(kmin_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
                        kstep = kstep.to(PINT).to(kmin_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
                        kstep = kstep * (1.0 / (1 << (8 * i + BITS * p)))  # [NT, TO, BLOCK_N, 1]
                        new_accs = ()
                        new_consts = ()
                        for g in tl.static_range(G):
                            q = tl.load(q_ptr + (bh * G + g) * D + q_at + u * CU + c)  # [NT, 1, 1, 1]
                            new_accs = new_accs + (accs[g] + code * (kstep * q),)
                            new_consts = new_consts + (consts[g] + kmin * q,)
                        accs = new_accs
                        consts = new_consts
        for g in tl.static_range(G):
            logits = tl.sum(accs[g] + consts[g], axis=0)  # [TO, BLOCK_N, TT]
            top = tl.max(tl.max(logits, axis=2), axis=0)  # [BLOCK_N]
            lse = top + tl.log(tl.sum(tl.sum(tl.exp(logits - top[None, :, None]), axis=2), axis=0))
            tl.store(out_ptr + (bh * G + g) * n_blocks + n, lse, mask=live)


VARIANTS = ("v2", "mma")
"""Kernels :func:`_launch_block_lse` can run: ``v2`` (Triton, float32 multiply-adds; any device Triton runs on) and
``mma`` (the tensor-core CUDA kernel of :mod:`hf_offload.kernels.quantkey_mma`, only where
:func:`~hf_offload.kernels.quantkey_mma.mma_supported` allows it). :func:`block_lse` chooses between them."""


def _layout(tokens: int, head_dim: int, bits: int, group: int) -> dict:
    """How the ``v2`` kernel splits a block over threads: ``VB`` code bytes of a token row per thread (at most 16
    bytes and 64 channels) and ``TT`` token rows per thread (at most 64 accumulators, rows x query heads)."""
    rows = max(1, 64 // (1 << (group - 1).bit_length()))
    return {"VB": min(16, head_dim * bits // 8, 8 * bits), "TT": min(tokens, rows)}


def _default_config(
    tokens: int, head_dim: int, bits: int, group: int = 4, num_warps: int = 4, rows_per_thread: int | None = None
) -> dict:
    """Launch settings of the ``v2`` kernel: ``block_n`` (blocks per program), ``num_warps`` and
    ``rows_per_thread`` (token rows of a block per thread); :func:`block_lse` uses them with the defaults.

    A block is spread over ``(head_dim * bits / 8 / VB) * (tokens / rows_per_thread)`` threads (``VB`` code bytes of
    a row per thread, see :func:`_layout`), so ``block_n`` is the number of blocks that fills ``num_warps`` warps:
    64 blocks for 2-bit codes, ``head_dim`` 128, 16 tokens and 4 query heads per KV head on 4 warps.

    Args:
        tokens: tokens per block (``block_tokens``), a power of two.
        head_dim: channels per key (padded to whole bytes of codes), a power of two.
        bits: bits per code (1, 2, 4 or 8).
        group: query heads per KV head.
        num_warps: warps per program, a power of two.
        rows_per_thread: a power of two dividing ``tokens``; ``None``: :func:`_layout`'s.
    """
    layout = _layout(tokens, head_dim, bits, group)
    rows = min(tokens, rows_per_thread or layout["TT"])
    per_block = max(1, head_dim * bits // 8 // layout["VB"]) * (tokens // rows)
    return {"block_n": max(1, 32 * num_warps // per_block), "num_warps": num_warps, "rows_per_thread": rows}


def _launch_block_lse(
    query: torch.Tensor,
    codes: torch.Tensor,
    kmin: torch.Tensor,
    kstep: torch.Tensor,
    bits: int,
    out: torch.Tensor,
    variant: str = "v2",
    block_n: int | None = None,
    num_warps: int | None = None,
    rows_per_thread: int | None = None,
    scaling: float = 1.0,
) -> torch.Tensor:
    """Run one scoring kernel into ``out`` with explicit launch settings (no checks of the inputs, no host sync).

    Args:
        query: ``[batch, kv_heads, group, head_dim]``, float32 (already scaled), contiguous, CUDA (or CPU under the
            interpreter); for ``mma`` also bfloat16, scaled inside the kernel (``scaling``).
        codes: ``[batch, n_blocks, kv_heads, block_tokens, head_dim * bits // 8]``, ``torch.uint8``, same device;
            the first ``n_blocks`` blocks of a ``[batch, capacity, ...]`` buffer, contiguous past the block
            dimension (:func:`summaries_layout_ok`).
        kmin: ``[batch, n_blocks, kv_heads, head_dim]``, float dtype, same device; laid out like ``codes`` (the same
            capacity).
        kstep: same shape, dtype, device and layout as ``kmin``.
        bits: bits per code (1, 2, 4 or 8; ``mma``: 2 or 4).
        out: ``[batch, kv_heads, group, n_blocks]``, float32, contiguous, same device; written in full.
        variant: one of :data:`VARIANTS`.
        block_n: ``v2`` only: blocks per program, a power of two; ``None``: the fewest that fill the warps
            (:func:`_default_config`).
        num_warps: ``v2`` only: warps per program; ``None``: 4.
        rows_per_thread: ``v2`` only: token rows of a block per thread; ``None``: :func:`_default_config`'s.
        scaling: ``mma`` only: the kernel scores ``query.float() * scaling``.

    Returns:
        ``out``.
    """
    batch, heads, group, head_dim = query.shape
    n_blocks, tokens = codes.shape[1], codes.shape[3]
    if variant not in VARIANTS:
        raise ValueError(f"unknown block_lse kernel variant {variant!r}; expected one of {VARIANTS}")
    if n_blocks == 0:
        return out
    if variant == "mma":
        stride = block_stride(codes, kmin, kstep)
        return quantkey_mma.launch(query, codes, kmin, kstep, out, stride, bits=bits, scaling=scaling)
    args = (query, codes, kmin, kstep, out, n_blocks, heads)
    config = _default_config(tokens, head_dim, bits, group, num_warps or 4, rows_per_thread)
    block_n = block_n or config["block_n"]
    layout = {"VB": _layout(tokens, head_dim, bits, group)["VB"], "TT": config["rows_per_thread"]}
    unit = 4 if layout["VB"] % 4 == 0 and codes.data_ptr() % 4 == 0 else 1
    grid = (batch * heads, triton.cdiv(n_blocks, block_n))
    _block_lse_kernel[grid](*args, block_stride(codes, kmin, kstep), G=group, T=tokens, D=head_dim, BITS=bits,
                            UNIT=unit, BLOCK_N=block_n, num_warps=config["num_warps"], **layout)  # fmt: skip
    return out


def block_stride(codes: torch.Tensor, kmin: torch.Tensor, kstep: torch.Tensor) -> int:
    """Blocks from one sequence's summaries to the next's, shared by ``codes``, ``kmin`` and ``kstep``.

    Raises:
        ValueError: a layout the kernel cannot read (see :func:`summaries_layout_ok`).
    """
    if not summaries_layout_ok(codes, kmin, kstep):
        raise ValueError("block_lse: codes, kmin and kstep must each be contiguous past the block dimension and "
                         "share one block capacity per sequence; pass .contiguous() tensors")  # fmt: skip
    return codes.stride(0) // codes.stride(1) if codes.shape[0] > 1 else codes.shape[1]


def summaries_layout_ok(codes: torch.Tensor, kmin: torch.Tensor, kstep: torch.Tensor) -> bool:
    """Whether the ``v2`` kernel reads these summaries in place: each is the first blocks of a contiguous
    ``[batch, capacity, ...]`` buffer (contiguous itself, or a slice of the block dimension), all with the same
    capacity."""

    def capacity(t: torch.Tensor) -> int | None:
        inner = t[0, 0] if t.shape[0] and t.shape[1] else None
        if inner is None or not inner.is_contiguous() or t.stride(1) != inner.numel():
            return None
        if t.shape[0] == 1:
            return -1  # one sequence: no stride between sequences to agree on
        return t.stride(0) // t.stride(1) if t.stride(0) % t.stride(1) == 0 else None

    caps = {capacity(t) for t in (codes, kmin, kstep)}
    return None not in caps and len(caps - {-1}) <= 1


def block_lse(
    query: torch.Tensor,
    codes: torch.Tensor,
    kmin: torch.Tensor,
    kstep: torch.Tensor,
    bits: int,
    chunk_blocks: int = 512,
    scaling: float = 1.0,
) -> torch.Tensor:
    """Log-sum-exp over each block's tokens of ``query . key`` for dequantized keys, by the fastest path that can
    run: the ``mma`` kernel where :func:`~hf_offload.kernels.quantkey_mma.mma_supported`, else the ``v2`` kernel
    where :func:`block_lse_supported` (and ``kmin`` is bfloat16, float16 or float32), else
    :func:`block_lse_reference`.

    Arguments and result as the reference's (``chunk_blocks`` is read by the reference only), except that ``query``
    may have any float dtype and is scored as ``query.float() * scaling``: a contiguous bfloat16 query goes to the
    ``mma`` kernel as it is (no conversion launch). The ``mma`` kernel rounds ``kstep * q`` to bfloat16 (see
    :mod:`hf_offload.kernels.quantkey_mma`); the others compute in float32.

    CUDA graphs: the kernels allocate only the result and never wait for the device, so a call can be captured once
    it has run (compiled) outside the capture."""

    def scaled() -> torch.Tensor:  # float32 [batch, kv_heads, group, head_dim], contiguous, times the scale
        q = query.float()
        return (q * scaling if scaling != 1.0 else q).contiguous()

    if (
        not block_lse_supported(query, codes)
        or query.shape[-1] % (8 // bits)
        or kmin.dtype not in (torch.bfloat16, torch.float16, torch.float32)
        or kstep.dtype != kmin.dtype  # the kernel reads both with kmin's element type
    ):
        return block_lse_reference(scaled(), codes, kmin, kstep, bits, chunk_blocks)
    batch, heads, group, _ = query.shape
    out = torch.empty((batch, heads, group, codes.shape[1]), dtype=torch.float32, device=query.device)
    variant = "mma" if quantkey_mma.mma_supported(query, codes, kmin, bits) else "v2"
    if not summaries_layout_ok(codes, kmin, kstep):
        codes, kmin, kstep = codes.contiguous(), kmin.contiguous(), kstep.contiguous()
    if not (variant == "mma" and query.dtype == torch.bfloat16 and query.is_contiguous()):
        query, scaling = scaled(), 1.0  # the Triton kernel reads a scaled float32 query
    return _launch_block_lse(query, codes, kmin, kstep, bits, out, variant=variant, scaling=scaling)
