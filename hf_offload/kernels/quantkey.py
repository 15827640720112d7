"""Block log-sum-exp of decode logits over quantized keys, in one launch (the ``quantkey`` selector's scoring).

The pure-torch scoring dequantizes every key into a float32 temporary (four bytes per element where the codes take
a quarter or an eighth of one) and runs a matrix product over it: on an H200 that took 184 ms per decode step for
the 8B shape at 32K tokens and batch 8 (``results/selection/selector_cost_quantkey_h200.json``). This kernel reads
each code once, dequantizes in registers and reduces each block's logits to their log-sum-exp per query head, so
only ``[batch, kv_heads, group, n_blocks]`` floats leave the kernel; the softmax over blocks that follows is exactly
the softmax over all keys summed per block. :func:`block_lse_reference` is the pure-torch reference the tests
compare it with (CPU, or any tensors the kernel does not take).
"""

from __future__ import annotations

import torch

from .gather import kernels_available, tl, triton


def block_lse_reference(
    query: torch.Tensor, codes: torch.Tensor, kmin: torch.Tensor, kstep: torch.Tensor, bits: int, chunk_blocks: int = 512
) -> torch.Tensor:
    """Log-sum-exp over each block's tokens of ``query . key`` for dequantized keys, in pure torch.

    Args:
        query: decode queries, already multiplied by the softmax scale, ``[batch, kv_heads, group, head_dim]``,
            float32, any device.
        codes: ``[batch, n_blocks, kv_heads, block_tokens, head_dim * bits // 8]``, ``torch.uint8``, same device.
        kmin: ``[batch, n_blocks, kv_heads, head_dim]``, float dtype, same device.
        kstep: same shape, dtype and device as ``kmin``.
        bits: bits per code (1, 2, 4 or 8).
        chunk_blocks: blocks dequantized at a time (bounds the float32 temporary).

    Returns:
        ``[batch, kv_heads, group, n_blocks]``, float32.
    """
    from ..selectors.quantkey import dequantize_keys

    n = codes.shape[1]
    parts = []
    for start in range(0, n, chunk_blocks):
        part = slice(start, min(n, start + chunk_blocks))
        keys = dequantize_keys(codes[:, part], kmin[:, part], kstep[:, part], bits)  # [B, n, H, T, D]
        parts.append(torch.einsum("bhgd,bnhtd->bhgnt", query, keys).logsumexp(dim=-1))
    return torch.cat(parts, dim=-1)


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


# Codes are turned into floats without an integer-to-float conversion: a code held in place in its byte,
# ``byte & (mask << s)``, is OR-ed into the mantissa of 2**23 and 2**23 is subtracted, which gives ``code * 2**s``
# exactly; the plane's step is scaled by ``2**-s`` instead (exact as well), so no shift is needed either.
_MAGIC = 0x4B000000  # bits of the float 2**23


if triton is not None:

    @triton.jit
    def _block_lse_kernel_v1(
        q_ptr,  # float32 [B, H, G, D]
        codes_ptr,  # uint8 [B, N, H, T, D // PER]
        kmin_ptr,  # [B, N, H, D]
        kstep_ptr,  # [B, N, H, D]
        out_ptr,  # float32 [B, H, G, N]
        n_blocks,
        heads,
        G: tl.constexpr,
        T: tl.constexpr,
        D: tl.constexpr,
        BITS: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        # The first kernel, kept for comparison (benchmarks/bench_quantkey_kernel.py): every byte is loaded once
        # per code it holds and each query head reduces a [BLOCK_N, T, D] key tile across threads.
        PER: tl.constexpr = 8 // BITS
        DB: tl.constexpr = D // PER
        bh = tl.program_id(0).to(tl.int64)
        b = bh // heads
        h = bh % heads
        n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.arange(0, T)
        d = tl.arange(0, D)
        live = n < n_blocks
        row = (b * n_blocks + n) * heads + h
        params = row[:, None] * D + d[None, :]
        kmin = tl.load(kmin_ptr + params, mask=live[:, None], other=0.0).to(tl.float32)
        kstep = tl.load(kstep_ptr + params, mask=live[:, None], other=0.0).to(tl.float32)
        where = (row[:, None, None] * T + t[None, :, None]) * DB + (d // PER)[None, None, :]
        byte = tl.load(codes_ptr + where, mask=live[:, None, None], other=0).to(tl.int32)
        code = (byte >> ((d % PER) * BITS)[None, None, :]) & ((1 << BITS) - 1)
        keys = kmin[:, None, :] + code.to(tl.float32) * kstep[:, None, :]
        for g in tl.static_range(G):
            q = tl.load(q_ptr + (bh * G + g) * D + d)
            logits = tl.sum(keys * q[None, None, :], axis=2)
            top = tl.max(logits, axis=1)
            lse = top + tl.log(tl.sum(tl.exp(logits - top[:, None]), axis=1))
            tl.store(out_ptr + (bh * G + g) * n_blocks + n, lse, mask=live)

    @triton.jit
    def _block_lse_split_kernel(
        q_ptr,  # float32 [B, H, G, D]
        codes_ptr,  # uint8 [B, N, H, T, D // PER]
        kmin_ptr,  # [B, N, H, D]
        kstep_ptr,  # [B, N, H, D]
        out_ptr,  # float32 [B, H, G, N]
        n_blocks,
        heads,
        G: tl.constexpr,
        T: tl.constexpr,
        D: tl.constexpr,
        BITS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        # One program: one (batch, KV head) and BLOCK_N blocks. The code bytes of a token row are cut into D // CHUNK
        # chunks of CHUNK channels (CB bytes); each thread holds whole chunks, so each byte is loaded once, the
        # query and the block parameters it needs are those of its chunk, and the sum over a chunk's channels stays
        # inside the thread (only the D // CHUNK partial sums are added across threads).
        PER: tl.constexpr = 8 // BITS
        DB: tl.constexpr = D // PER
        CB: tl.constexpr = CHUNK // PER
        NCH: tl.constexpr = D // CHUNK
        bh = tl.program_id(0).to(tl.int64)
        b = bh // heads
        h = bh % heads
        n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = n < n_blocks
        row = (b * n_blocks + n) * heads + h  # [BLOCK_N]: (b, n, h) of the summaries
        t = tl.arange(0, T)
        k = tl.arange(0, NCH)
        j = tl.arange(0, CB)
        c = tl.arange(0, CHUNK)
        p = tl.arange(0, PER)
        where = (row[:, None, None, None] * T + t[None, :, None, None]) * DB + (k * CB)[None, None, :, None]
        byte = tl.load(codes_ptr + where + j[None, None, None, :], mask=live[:, None, None, None], other=0)
        place = (((1 << BITS) - 1) << (p * BITS))[None, None, None, None, :]
        held = (byte.to(tl.int32)[:, :, :, :, None] & place) | _MAGIC  # [BLOCK_N, T, NCH, CB, PER]
        code = tl.reshape(held.to(tl.float32, bitcast=True) - 8388608.0, (BLOCK_N, T, NCH, CHUNK))
        d = k[:, None] * CHUNK + c[None, :]  # [NCH, CHUNK]: channel
        unscale = ((127 - (c % PER) * BITS) << 23).to(tl.float32, bitcast=True)  # 2**-(bit offset in the byte)
        params = row[:, None, None] * D + d[None, :, :]
        kmin = tl.load(kmin_ptr + params, mask=live[:, None, None], other=0.0).to(tl.float32)
        kstep = tl.load(kstep_ptr + params, mask=live[:, None, None], other=0.0).to(tl.float32) * unscale
        keys = kmin[:, None, :, :] + code * kstep[:, None, :, :]  # [BLOCK_N, T, NCH, CHUNK]
        for g in tl.static_range(G):
            q = tl.load(q_ptr + (bh * G + g) * D + d)  # [NCH, CHUNK]
            logits = tl.sum(tl.sum(keys * q[None, None, :, :], axis=3), axis=2)  # [BLOCK_N, T]
            top = tl.max(logits, axis=1)
            lse = top + tl.log(tl.sum(tl.exp(logits - top[:, None]), axis=1))
            tl.store(out_ptr + (bh * G + g) * n_blocks + n, lse, mask=live)

    @triton.jit
    def _block_lse_chunk_kernel(
        q_ptr,  # float32 [B, H, G, D]
        codes_ptr,  # uint8 [B, N, H, T, D // PER]
        kmin_ptr,  # [B, N, H, D]
        kstep_ptr,  # [B, N, H, D]
        out_ptr,  # float32 [B, H, G, N]
        n_blocks,
        heads,
        G: tl.constexpr,
        GP: tl.constexpr,
        T: tl.constexpr,
        D: tl.constexpr,
        BITS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        # One program: one (batch, KV head) and BLOCK_N blocks, walking the channels CHUNK at a time; each thread
        # holds whole chunks of its token rows, so every sum over channels stays inside the thread, and all GP
        # (G rounded up to a power of two) query heads are scored from each dequantized chunk.
        PER: tl.constexpr = 8 // BITS
        DB: tl.constexpr = D // PER
        CB: tl.constexpr = CHUNK // PER
        bh = tl.program_id(0).to(tl.int64)
        b = bh // heads
        h = bh % heads
        n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        live = n < n_blocks
        row = (b * n_blocks + n) * heads + h
        t = tl.arange(0, T)
        j = tl.arange(0, CB)
        c = tl.arange(0, CHUNK)
        p = tl.arange(0, PER)
        g = tl.arange(0, GP)
        place = (((1 << BITS) - 1) << (p * BITS))[None, None, None, :]
        unscale = ((127 - (c % PER) * BITS) << 23).to(tl.float32, bitcast=True)
        rows = (row[:, None] * T + t[None, :]) * DB  # [BLOCK_N, T]
        acc = tl.zeros((BLOCK_N, T, GP), dtype=tl.float32)
        for chunk in tl.static_range(D // CHUNK):
            byte = tl.load(codes_ptr + rows[:, :, None] + (chunk * CB + j)[None, None, :], mask=live[:, None, None],
                           other=0)  # fmt: skip
            held = (byte.to(tl.int32)[:, :, :, None] & place) | _MAGIC  # [BLOCK_N, T, CB, PER]
            code = tl.reshape(held.to(tl.float32, bitcast=True) - 8388608.0, (BLOCK_N, T, CHUNK))
            d = chunk * CHUNK + c
            params = row[:, None] * D + d[None, :]
            kmin = tl.load(kmin_ptr + params, mask=live[:, None], other=0.0).to(tl.float32)
            kstep = tl.load(kstep_ptr + params, mask=live[:, None], other=0.0).to(tl.float32) * unscale[None, :]
            keys = kmin[:, None, :] + code * kstep[:, None, :]  # [BLOCK_N, T, CHUNK]
            q = tl.load(q_ptr + (bh * G + g[:, None]) * D + d[None, :], mask=(g < G)[:, None], other=0.0)
            acc += tl.sum(keys[:, :, None, :] * q[None, None, :, :], axis=3)
        top = tl.max(acc, axis=1)  # [BLOCK_N, GP]
        lse = top + tl.log(tl.sum(tl.exp(acc - top[:, None, :]), axis=1))
        tl.store(out_ptr + (bh * G + g[None, :]) * n_blocks + n[:, None], lse, mask=live[:, None] & (g < G)[None, :])


VARIANTS = ("v1", "split", "chunk")
"""Kernels :func:`launch_block_lse` can run: ``v1`` the first kernel (kept for comparison), ``split`` and ``chunk``
the current ones (see :func:`default_config`)."""


def default_config(tokens: int, head_dim: int, bits: int) -> dict:
    """Launch settings :func:`block_lse` uses for a shape: ``variant``, ``block_n`` (blocks per program),
    ``num_warps`` and ``chunk`` (channels per thread and chunk).

    Args:
        tokens: tokens per block (``block_tokens``), a power of two.
        head_dim: channels per key (padded to whole bytes of codes), a power of two.
        bits: bits per code (1, 2, 4 or 8).
    """
    per = 8 // bits
    return {"variant": "split", "block_n": max(1, 256 // tokens), "num_warps": 4,
            "chunk": min(head_dim, max(16, per))}  # fmt: skip


def launch_block_lse(
    query: torch.Tensor,
    codes: torch.Tensor,
    kmin: torch.Tensor,
    kstep: torch.Tensor,
    bits: int,
    out: torch.Tensor,
    variant: str = "split",
    block_n: int | None = None,
    num_warps: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Run one scoring kernel into ``out`` with explicit launch settings (no checks beyond shapes; no host sync).

    Args:
        query: ``[batch, kv_heads, group, head_dim]``, float32, contiguous, CUDA (or CPU under the interpreter).
        codes: ``[batch, n_blocks, kv_heads, block_tokens, head_dim * bits // 8]``, ``torch.uint8``, contiguous,
            same device.
        kmin: ``[batch, n_blocks, kv_heads, head_dim]``, float dtype, contiguous, same device.
        kstep: same shape, dtype and device as ``kmin``.
        bits: bits per code (1, 2, 4 or 8).
        out: ``[batch, kv_heads, group, n_blocks]``, float32, contiguous, same device; written in full.
        variant: one of :data:`VARIANTS`.
        block_n: blocks per program (a power of two); ``None``: :func:`default_config`'s.
        num_warps: warps per program; ``None``: :func:`default_config`'s.
        chunk: channels per chunk (``split``, ``chunk``; a power of two, at least ``8 // bits``, at most
            ``head_dim``); ``None``: :func:`default_config`'s.

    Returns:
        ``out``.
    """
    batch, heads, group, head_dim = query.shape
    n_blocks, tokens = codes.shape[1], codes.shape[3]
    if n_blocks == 0:
        return out
    base = default_config(tokens, head_dim, bits)
    if variant == "v1":
        block_n = block_n or max(1, min(16, 4096 // (tokens * head_dim)))
        base["num_warps"] = 4
    block_n = block_n or base["block_n"]
    num_warps = num_warps or base["num_warps"]
    chunk = chunk or base["chunk"]
    grid = (batch * heads, triton.cdiv(n_blocks, block_n))
    args = (query, codes, kmin, kstep, out, n_blocks, heads)
    if variant == "v1":
        _block_lse_kernel_v1[grid](*args, G=group, T=tokens, D=head_dim, BITS=bits, BLOCK_N=block_n,
                                   num_warps=num_warps)  # fmt: skip
    elif variant == "split":
        _block_lse_split_kernel[grid](*args, G=group, T=tokens, D=head_dim, BITS=bits, BLOCK_N=block_n, CHUNK=chunk,
                                      num_warps=num_warps)  # fmt: skip
    elif variant == "chunk":
        _block_lse_chunk_kernel[grid](*args, G=group, GP=triton.next_power_of_2(group), T=tokens, D=head_dim,
                                      BITS=bits, BLOCK_N=block_n, CHUNK=chunk, num_warps=num_warps)  # fmt: skip
    else:
        raise ValueError(f"unknown block_lse kernel variant {variant!r}; expected one of {VARIANTS}")
    return out


def block_lse(
    query: torch.Tensor, codes: torch.Tensor, kmin: torch.Tensor, kstep: torch.Tensor, bits: int, chunk_blocks: int = 512
) -> torch.Tensor:
    """Log-sum-exp over each block's tokens of ``query . key`` for dequantized keys: the kernel where
    :func:`block_lse_supported`, else :func:`block_lse_reference`. Arguments and result as the reference's
    (``chunk_blocks`` is used by the reference only)."""
    if not block_lse_supported(query, codes) or query.shape[-1] % (8 // bits):
        return block_lse_reference(query, codes, kmin, kstep, bits, chunk_blocks)
    batch, heads, group, _ = query.shape
    out = torch.empty((batch, heads, group, codes.shape[1]), dtype=torch.float32, device=query.device)
    config = default_config(codes.shape[3], query.shape[-1], bits)
    return launch_block_lse(query.float().contiguous(), codes.contiguous(), kmin.contiguous(), kstep.contiguous(),
                            bits, out, **config)  # fmt: skip
