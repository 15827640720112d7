"""The seal of a full open block in one launch: its copy into its pool block, its quantized keys (and values) written
into the summary buffers, its column of the device block table.

Sealing a block after a decode step is, op by op, a stack of the keys and values, the copy kernel, about twenty
small kernels of :func:`~hf_offload.kernels.quant.quantize_keys` (twice with ``tail_bits``) and one copy per
buffer. Even replayed from a CUDA graph each of those launches costs a few microseconds of device time, in every
layer of a sealing step. Here one program per (sequence, KV head)
reads the block's ``[block_tokens, head_dim]`` keys and values once and writes everything.

The codes, minima and steps are :func:`~hf_offload.kernels.quant.quantize_keys`' bit for bit: the minimum and
maximum over the block's tokens in float32, the step ``(max - min) / levels`` as torch computes it (on CUDA torch
divides by a Python number as a product with its float32 reciprocal, on the CPU it divides), both rounded to the
cache dtype, then each code ``(key - min) / step`` (an IEEE division; a zero step divides by one) rounded half to even
and clamped to ``[0, levels]``, packed ``8 // bits`` per byte, channel ``per * j + p`` of byte ``j`` at bit
``bits * p``.
"""

from __future__ import annotations

import functools

import torch

from .gather import kernels_available, tl, triton
from .norm import FLOAT_DTYPES, DTYPE_KIND

WARPS = 4
"""Warps per program (one program per sequence and KV head)."""


def seal_block_supported(open_keys: torch.Tensor, stores: dict[str, torch.Tensor], bits: int, value_bits: int) -> bool:
    """Whether :func:`seal_block` can seal this block into these buffers: Triton on the block's device, a float16,
    bfloat16 or float32 cache, ``block_tokens`` and ``head_dim`` powers of two with ``head_dim`` a multiple of ``8 //
    bits`` (no padded channels), unit strides along ``head_dim`` and inside each block's codes, and the buffers
    :func:`seal_block` names (of the cache dtype for the minima and steps, ``torch.uint8`` for the codes)."""
    if not (kernels_available(open_keys.device) and open_keys.dtype in FLOAT_DTYPES and open_keys.dim() == 4):
        return False
    _, _, tokens, dim = open_keys.shape
    if tokens & (tokens - 1) or dim & (dim - 1) or dim < 8 or open_keys.stride(-1) != 1:
        return False
    parts = [("codes", "kmin", "kstep", bits)] + ([("vcodes", "vmin", "vstep", value_bits)] if value_bits else [])
    for codes_name, min_name, step_name, b in parts:
        codes, low, step = (stores.get(name) for name in (codes_name, min_name, step_name))
        if codes is None or low is None or step is None or b not in (1, 2, 4, 8):
            return False
        if codes.dtype != torch.uint8 or codes.dim() != 5 or tuple(codes.shape[3:]) != (tokens, dim * b // 8):
            return False
        if codes.stride(4) != 1 or codes.stride(3) != dim * b // 8:
            return False
        if low.dtype != open_keys.dtype or step.dtype != open_keys.dtype or low.shape != step.shape:
            return False
        if low.stride() != step.stride() or low.dim() != 4 or low.shape[3] != dim or low.stride(3) != 1:
            return False
    return True


def seal_block(
    open_keys: torch.Tensor,
    open_values: torch.Tensor,
    seal_args: torch.Tensor,
    stores: dict[str, torch.Tensor],
    bits: int,
    value_bits: int = 0,
    chunk_addrs: torch.Tensor | None = None,
    chunk_blocks: int = 0,
    table: torch.Tensor | None = None,
) -> None:
    """Seal a full open block in one launch on the current stream (no host synchronisation); where
    :func:`seal_block_supported`.

    Args:
        open_keys: the block's keys, ``[batch, kv_heads, block_tokens, head_dim]``, the cache dtype, unit stride
            along ``head_dim``, CUDA (or the CPU under Triton's interpreter).
        open_values: its values, same shape, dtype, device and strides.
        seal_args: ``[1 + batch]``, ``torch.int64``, same device: the block's position (the column it takes in the
            buffers), then its pool block id in each sequence.
        stores: the summary buffers, ``[batch, capacity, kv_heads, ...]`` with ``capacity`` above the position:
            ``codes`` (``[..., block_tokens, head_dim * bits // 8]``, ``torch.uint8``), ``kmin`` and ``kstep``
            (``[..., head_dim]``, the cache dtype), and with ``value_bits`` ``vcodes``, ``vmin`` and ``vstep``
            (the values at ``value_bits``); written at the position.
        bits: bits per key code (1, 2, 4 or 8).
        value_bits: bits per value code; 0: no value summaries.
        chunk_addrs: the pool's chunk addresses (:meth:`~hf_offload.store.HostBlockPool.chunk_addrs`, ``[n_chunks]``,
            ``torch.int64``, same device): the block is written into its pool block (``[2, kv_heads, block_tokens,
            head_dim]``, keys then values) through them; ``None``: not written.
        chunk_blocks: blocks per chunk (with ``chunk_addrs``).
        table: the device block table, ``[batch, capacity]``, ``torch.int64``: each sequence's id written at the
            position; ``None``: not written.
    """
    batch, heads, tokens, dim = open_keys.shape
    kind = DTYPE_KIND[open_keys.dtype]
    as_kind = (lambda t: t.view(torch.int16)) if kind == 2 else (lambda t: t)  # noqa: E731
    codes, low, step = stores["codes"], stores["kmin"], stores["kstep"]
    if value_bits:
        vcodes, vlow, vstep = stores["vcodes"], stores["vmin"], stores["vstep"]
    else:
        vcodes, vlow, vstep = codes, low, step  # not read
    # float32(1 / levels) as torch's CUDA division by a number forms it (a float32 division)
    inv = [_inverse_levels(b) for b in (bits, value_bits or bits)]
    write_block = chunk_addrs is not None
    write_table = table is not None
    _seal_kernel[(batch, heads)](
        as_kind(open_keys), as_kind(open_values), open_keys.stride(0), open_keys.stride(1), open_keys.stride(2),
        seal_args, chunk_addrs if write_block else seal_args, chunk_blocks,
        table if write_table else seal_args, table.stride(0) if write_table else 0,
        codes, codes.stride(0), codes.stride(1), codes.stride(2),
        as_kind(low), as_kind(step), low.stride(0), low.stride(1), low.stride(2),
        vcodes, vcodes.stride(0), vcodes.stride(1), vcodes.stride(2),
        as_kind(vlow), as_kind(vstep), vlow.stride(0), vlow.stride(1), vlow.stride(2), inv[0], inv[1],
        HEADS=heads, TOKENS=tokens, DIM=dim, KIND=kind, BITS=bits, VBITS=value_bits, WRITE_BLOCK=write_block,
        WRITE_TABLE=write_table, PRECISE=open_keys.is_cuda, num_warps=WARPS,
    )  # fmt: skip



def quantize_blocks_supported(keys: torch.Tensor, bits: int) -> bool:
    """Whether :func:`quantize_blocks` runs for ``keys`` (``[batch, n, kv_heads, block_tokens, head_dim]``): Triton
    on their device, a float16, bfloat16 or float32 tensor with a unit stride along ``head_dim``, ``block_tokens`` and
    ``head_dim`` powers of two with ``head_dim`` a multiple of ``8 // bits`` (no padded channels), 1 to 8 bits."""
    if bits not in (1, 2, 4, 8) or keys.dim() != 5 or keys.dtype not in FLOAT_DTYPES:
        return False
    if not kernels_available(keys.device) or keys.stride(-1) != 1:
        return False
    tokens, dim = keys.shape[3:]
    return tokens > 0 and not tokens & (tokens - 1) and dim >= 8 and not dim & (dim - 1) and dim % (8 // bits) == 0


@functools.cache
def _inverse_levels(bits: int) -> float:
    """``float32(1 / levels)`` of ``bits``-bit codes, as :func:`seal_block` computes it (made once per ``bits``)."""
    return float(torch.tensor(1.0) / ((1 << bits) - 1))


def quantize_blocks(keys: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """:func:`~hf_offload.kernels.quant.quantize_keys_reference` in one launch (one program per block and KV head),
    bit for bit, where :func:`quantize_blocks_supported`: the summaries of many blocks at once (a prefill's seal)
    without the reference's twenty-odd small operations. Never waits for the device.

    Args:
        keys: ``[batch, n, kv_heads, block_tokens, head_dim]``, any strides with a unit one along ``head_dim``.
        bits: 1, 2, 4 or 8.

    Returns:
        ``codes`` (``[batch, n, kv_heads, block_tokens, head_dim * bits // 8]``, ``torch.uint8``), ``kmin`` and
        ``kstep`` (``[batch, n, kv_heads, head_dim]``, ``keys.dtype``), contiguous.
    """
    batch, n, heads, tokens, dim = keys.shape
    codes = torch.empty((batch, n, heads, tokens, dim * bits // 8), dtype=torch.uint8, device=keys.device)
    low = torch.empty((batch, n, heads, dim), dtype=keys.dtype, device=keys.device)
    step = torch.empty_like(low)
    if batch * n * heads:
        kind = DTYPE_KIND[keys.dtype]
        as_kind = (lambda t: t.view(torch.int16)) if kind == 2 else (lambda t: t)  # noqa: E731
        inv = _inverse_levels(bits)
        _quantize_kernel[(batch * n, heads)](
            as_kind(keys), keys.stride(0), keys.stride(1), keys.stride(2), keys.stride(3), codes, as_kind(low),
            as_kind(step), n, heads, inv, TOKENS=tokens, DIM=dim, KIND=kind, BITS=bits, PRECISE=keys.is_cuda,
            num_warps=WARPS,
        )  # fmt: skip
    return {"codes": codes, "kmin": low, "kstep": step}


if triton is not None:
    from .norm import round_to, store_as

    @triton.jit
    def _as_f32(raw, KIND: tl.constexpr):
        # Values of KIND as loaded (bfloat16: int16 patterns) in float32; exact.
        if KIND == 2:
            return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            return raw.to(tl.float32)

    @triton.jit
    def _quantize_tile(x, codes_ptr, low_ptr, step_ptr, inv_levels, t, d, TOKENS: tl.constexpr, DIM: tl.constexpr,
                       KIND: tl.constexpr, BITS: tl.constexpr, PRECISE: tl.constexpr):  # fmt: skip
        # x: [TOKENS, DIM] float32 (exact values of the cache dtype); codes_ptr: this block's codes (rows of DIM *
        # BITS / 8 bytes); low_ptr / step_ptr: its DIM minima and steps (KIND); inv_levels: float32(1 / levels).
        levels: tl.constexpr = (1 << BITS) - 1
        per: tl.constexpr = 8 // BITS
        lo = tl.min(x, axis=0)
        hi = tl.max(x, axis=0)
        if PRECISE:
            step = (hi - lo) * inv_levels  # torch's CUDA division by a number
        else:
            step = (hi - lo) / tl.full(lo.shape, levels, tl.float32)
        lo = round_to(lo, KIND)  # the stored values, which the codes are computed against
        step = round_to(step, KIND)
        store_as(low_ptr, d, lo, d < DIM, KIND)
        store_as(step_ptr, d, step, d < DIM, KIND)
        safe = tl.where(step > 0, step, 1.0)
        if PRECISE:
            q = tl.math.div_rn(x - lo[None, :], tl.broadcast_to(safe[None, :], (TOKENS, DIM)))
        else:
            q = (x - lo[None, :]) / safe[None, :]
        r = tl.floor(q)
        f = q - r  # exact: |q| is far below 2**23
        odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
        r = tl.where((f > 0.5) | ((f == 0.5) & odd), r + 1.0, r)  # half to even, as torch.round
        c = tl.minimum(tl.maximum(r.to(tl.int32), 0), levels)
        shifts = tl.arange(0, per) * BITS
        packed = tl.sum(tl.reshape(c, (TOKENS, DIM // per, per)) << shifts[None, None, :], axis=2)
        j = tl.arange(0, DIM // per)
        tl.store(codes_ptr + t[:, None] * (DIM // per) + j[None, :], packed.to(tl.uint8))

    @triton.jit
    def _seal_kernel(
        k_ptr,  # [batch, heads, TOKENS, DIM] of KIND (bfloat16 as int16), unit stride along DIM
        v_ptr,  # same shape and strides
        stride_b,
        stride_h,
        stride_t,
        args_ptr,  # int64 [1 + batch]: the position, then one pool block id per sequence
        chunk_addr_ptr,  # int64 [n_chunks]: chunk addresses (WRITE_BLOCK)
        chunk_blocks,
        table_ptr,  # int64 [batch, capacity] (WRITE_TABLE)
        table_stride,
        codes_ptr,  # uint8 [batch, capacity, heads, TOKENS, DIM * BITS / 8]
        codes_sb,
        codes_sn,
        codes_sh,
        low_ptr,  # [batch, capacity, heads, DIM] of KIND
        step_ptr,  # same shape and strides
        low_sb,
        low_sn,
        low_sh,
        vcodes_ptr,  # as codes_ptr, for the values at VBITS (VBITS > 0)
        vcodes_sb,
        vcodes_sn,
        vcodes_sh,
        vlow_ptr,
        vstep_ptr,
        vlow_sb,
        vlow_sn,
        vlow_sh,
        inv_levels,  # float32(1 / (2**BITS - 1))
        vinv_levels,  # float32(1 / (2**VBITS - 1))
        HEADS: tl.constexpr,
        TOKENS: tl.constexpr,
        DIM: tl.constexpr,
        KIND: tl.constexpr,  # 0 float32, 1 float16, 2 bfloat16 (pointers to int16)
        BITS: tl.constexpr,
        VBITS: tl.constexpr,
        WRITE_BLOCK: tl.constexpr,
        WRITE_TABLE: tl.constexpr,
        PRECISE: tl.constexpr,  # torch's CUDA arithmetic (CUDA); else its CPU arithmetic (the interpreter's NumPy)
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        pos = tl.load(args_ptr)
        t = tl.arange(0, TOKENS)
        d = tl.arange(0, DIM)
        tile = t[:, None] * stride_t + d[None, :]
        k_raw = tl.load(k_ptr + b * stride_b + h * stride_h + tile)
        v_raw = tl.load(v_ptr + b * stride_b + h * stride_h + tile)
        block_id = tl.load(args_ptr + 1 + b)
        if WRITE_BLOCK:
            base = tl.load(chunk_addr_ptr + block_id // chunk_blocks).to(tl.pointer_type(k_ptr.dtype.element_ty))
            dst = base + (block_id % chunk_blocks) * (2 * HEADS * TOKENS * DIM) + t[:, None] * DIM + d[None, :]
            tl.store(dst + h * (TOKENS * DIM), k_raw)
            tl.store(dst + (HEADS + h) * (TOKENS * DIM), v_raw)
        if WRITE_TABLE:
            if h == 0:
                tl.store(table_ptr + b * table_stride + pos, block_id)
        k = _as_f32(k_raw, KIND)
        _quantize_tile(k, codes_ptr + b * codes_sb + pos * codes_sn + h * codes_sh,
                       low_ptr + b * low_sb + pos * low_sn + h * low_sh,
                       step_ptr + b * low_sb + pos * low_sn + h * low_sh, inv_levels, t, d, TOKENS, DIM, KIND, BITS,
                       PRECISE)  # fmt: skip
        if VBITS:
            v = _as_f32(v_raw, KIND)
            _quantize_tile(v, vcodes_ptr + b * vcodes_sb + pos * vcodes_sn + h * vcodes_sh,
                           vlow_ptr + b * vlow_sb + pos * vlow_sn + h * vlow_sh,
                           vstep_ptr + b * vlow_sb + pos * vlow_sn + h * vlow_sh, vinv_levels, t, d, TOKENS, DIM,
                           KIND, VBITS, PRECISE)  # fmt: skip

    @triton.jit
    def _quantize_kernel(
        k_ptr,  # [batch, n, heads, TOKENS, DIM] of KIND (bfloat16 as int16), unit stride along DIM
        stride_b,
        stride_n,
        stride_h,
        stride_t,
        codes_ptr,  # uint8 [batch, n, heads, TOKENS, DIM * BITS / 8], contiguous
        low_ptr,  # [batch, n, heads, DIM] of KIND, contiguous
        step_ptr,  # same shape
        n,
        heads,
        inv_levels,  # float32(1 / (2**BITS - 1))
        TOKENS: tl.constexpr,
        DIM: tl.constexpr,
        KIND: tl.constexpr,
        BITS: tl.constexpr,
        PRECISE: tl.constexpr,
    ):
        bn = tl.program_id(0).to(tl.int64)  # b * n + block
        h = tl.program_id(1).to(tl.int64)
        b = bn // n
        j = bn % n
        t = tl.arange(0, TOKENS)
        d = tl.arange(0, DIM)
        raw = tl.load(k_ptr + b * stride_b + j * stride_n + h * stride_h + t[:, None] * stride_t + d[None, :])
        row = bn * heads + h  # this block and head in the contiguous results
        _quantize_tile(_as_f32(raw, KIND), codes_ptr + row * (TOKENS * (DIM * BITS // 8)), low_ptr + row * DIM,
                       step_ptr + row * DIM, inv_levels, t, d, TOKENS, DIM, KIND, BITS, PRECISE)  # fmt: skip
