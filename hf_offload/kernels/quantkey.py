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


if triton is not None:

    @triton.jit
    def _block_lse_kernel(
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
        PER: tl.constexpr = 8 // BITS
        DB: tl.constexpr = D // PER
        bh = tl.program_id(0).to(tl.int64)
        b = bh // heads
        h = bh % heads
        n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        t = tl.arange(0, T)
        d = tl.arange(0, D)
        live = n < n_blocks
        row = (b * n_blocks + n) * heads + h  # [BLOCK_N]: (b, n, h) of the summaries
        params = row[:, None] * D + d[None, :]
        kmin = tl.load(kmin_ptr + params, mask=live[:, None], other=0.0).to(tl.float32)
        kstep = tl.load(kstep_ptr + params, mask=live[:, None], other=0.0).to(tl.float32)
        where = (row[:, None, None] * T + t[None, :, None]) * DB + (d // PER)[None, None, :]
        byte = tl.load(codes_ptr + where, mask=live[:, None, None], other=0).to(tl.int32)
        code = (byte >> ((d % PER) * BITS)[None, None, :]) & ((1 << BITS) - 1)
        keys = kmin[:, None, :] + code.to(tl.float32) * kstep[:, None, :]  # [BLOCK_N, T, D]
        for g in tl.static_range(G):
            q = tl.load(q_ptr + (bh * G + g) * D + d)
            logits = tl.sum(keys * q[None, None, :], axis=2)  # [BLOCK_N, T]
            top = tl.max(logits, axis=1)
            lse = top + tl.log(tl.sum(tl.exp(logits - top[:, None]), axis=1))
            tl.store(out_ptr + (bh * G + g) * n_blocks + n, lse, mask=live)


def block_lse(
    query: torch.Tensor, codes: torch.Tensor, kmin: torch.Tensor, kstep: torch.Tensor, bits: int, chunk_blocks: int = 512
) -> torch.Tensor:
    """Log-sum-exp over each block's tokens of ``query . key`` for dequantized keys: the kernel where
    :func:`block_lse_supported`, else :func:`block_lse_reference`. Arguments and result as the reference's
    (``chunk_blocks`` is used by the reference only)."""
    if not block_lse_supported(query, codes):
        return block_lse_reference(query, codes, kmin, kstep, bits, chunk_blocks)
    batch, heads, group, head_dim = query.shape
    n_blocks, tokens = codes.shape[1], codes.shape[3]
    out = torch.empty((batch, heads, group, n_blocks), dtype=torch.float32, device=query.device)
    if n_blocks == 0:
        return out
    block_n = max(1, min(16, 4096 // (tokens * head_dim)))
    grid = (batch * heads, triton.cdiv(n_blocks, block_n))
    _block_lse_kernel[grid](
        query.float().contiguous(), codes.contiguous(), kmin.contiguous(), kstep.contiguous(), out,
        n_blocks, heads, G=group, T=tokens, D=head_dim, BITS=bits, BLOCK_N=block_n, num_warps=4,
    )  # fmt: skip
    return out
