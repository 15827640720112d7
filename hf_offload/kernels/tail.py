"""Attention over the blocks a decode step did not select, estimated from low-precision copies of their keys and values.

A budget of 1/16 of the context misses 10-20% of the attention mass on real models (``docs/results/selection.md``);
attending only to the selection renormalises that mass onto the selected tokens. Keeping every block's keys and
values on the compute device at a few bits, per block and channel (KIVI's per-channel layout, Liu et al., 2024),
lets each decode query add the blocks it did not select as an estimate: exact attention where it matters, low
precision for the rest, as MiKV (Yang et al., 2024) keeps unimportant tokens at low precision and RetroInfer
(Chen et al., 2025) estimates the attention of the clusters it does not retrieve. The two parts are merged through
their log-sum-exp, so the result is one softmax over selection and estimate.

Pure torch here, ``chunk_blocks`` blocks dequantized at a time (the float32 temporary is bounded); no host
synchronisation, so a captured CUDA graph can hold it.
"""

from __future__ import annotations

import torch


def tail_attention_reference(
    query: torch.Tensor,
    keys: dict[str, torch.Tensor],
    key_bits: int,
    values: dict[str, torch.Tensor],
    value_bits: int,
    tokens_ok: torch.Tensor,
    softcap: float | None = None,
    chunk_blocks: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one decode query over the quantized keys and values of the ``tokens_ok`` tokens.

    Args:
        query: ``[batch, kv_heads, group, channels]``, float32, compute device, already multiplied by the softmax
            scale; ``channels`` is ``keys["kmin"]``'s last size (``head_dim`` padded to whole bytes of codes).
        keys: ``codes`` (``[batch, n_blocks, kv_heads, block_tokens, channels * key_bits // 8]``, ``torch.uint8``),
            ``kmin`` and ``kstep`` (``[batch, n_blocks, kv_heads, channels]``) from
            :func:`hf_offload.selectors.quantkey.quantize_keys`, same device.
        key_bits: bits per key code.
        values: ``codes``, ``kmin`` and ``kstep`` of the values quantized the same way (their own channel count).
        value_bits: bits per value code.
        tokens_ok: which tokens to attend, ``[batch, n_blocks, block_tokens]``, ``torch.bool``, same device.
        softcap: optional logit soft-capping (``softcap * tanh(logits / softcap)``).
        chunk_blocks: blocks dequantized at a time.

    Returns:
        ``(out, lse)``: ``out`` ``[batch, kv_heads, group, value_channels]``, float32 (zero where no token is
        attended); ``lse`` ``[batch, kv_heads, group]``, float32, the log-sum-exp of the attended logits (``-inf``
        where none is attended).
    """
    from ..selectors.quantkey import dequantize_keys

    n = tokens_ok.shape[1]
    batch, heads, group, _ = query.shape
    channels = values["kmin"].shape[-1]
    m = torch.full((batch, heads, group), float("-inf"), dtype=torch.float32, device=query.device)
    l = torch.zeros_like(m)
    o = torch.zeros((batch, heads, group, channels), dtype=torch.float32, device=query.device)
    for start in range(0, n, chunk_blocks):
        part = slice(start, min(n, start + chunk_blocks))
        k = dequantize_keys(keys["codes"][:, part], keys["kmin"][:, part], keys["kstep"][:, part], key_bits)
        logits = torch.einsum("bhgd,bnhtd->bhgnt", query, k)  # [B, H, G, c, T]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits.masked_fill(~tokens_ok[:, None, None, part], float("-inf")).flatten(-2)
        m_new = torch.maximum(m, logits.amax(-1))
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # nothing attended yet: no inf - inf
        p = torch.exp(logits - shift[..., None])
        rescale = torch.exp(m - shift)
        v = dequantize_keys(values["codes"][:, part], values["kmin"][:, part], values["kstep"][:, part], value_bits)
        l = l * rescale + p.sum(-1)
        o = o * rescale[..., None] + torch.einsum("bhgx,bxhd->bhgd", p, v.transpose(2, 3).flatten(1, 2))
        m = m_new
    attended = l > 0
    out = torch.where(attended[..., None], o / l.clamp(min=1e-30)[..., None], torch.zeros_like(o))
    lse = torch.where(attended, m + torch.log(l.clamp(min=1e-30)), torch.full_like(m, float("-inf")))
    return out, lse


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over two disjoint sets of keys from the attention over each.

    Args:
        out_a: ``[..., head_dim]``, float32: attention output over the first set.
        lse_a: ``[...]``, float32: log-sum-exp of its logits (``-inf``: empty set).
        out_b: same shape as ``out_a``, the second set.
        lse_b: same shape as ``lse_a``.

    Returns:
        ``(out, lse)`` over the union, float32, same shapes.
    """
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = wa + wb
    out = (wa[..., None] * out_a + wb[..., None] * out_b) / total.clamp(min=1e-30)[..., None]
    return out, m + torch.log(total)
