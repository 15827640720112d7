"""Exact attention of prefill: a prompt's first forward and each later chunk, through
``scaled_dot_product_attention`` with a causal mask (per sequence on its unpadded span under left padding)."""

from __future__ import annotations

import torch

from .handoff import Handoff, OffloadMask, plain_causal


def chunk_prefill(
    handoff: Handoff, query: torch.Tensor, mask: OffloadMask | None, scaling: float
) -> torch.Tensor | None:
    """Exact attention of a later prefill chunk: every earlier sealed block, recalled in one pass, plus the recent
    tokens, through ``scaled_dot_product_attention`` with a bottom-right-aligned causal mask.

    The chunk's queries are the last ``q_len`` positions of the keys, so the causal mask is the lower-right one;
    left padding is handled per sequence on its unpadded span. The layer's earlier KV is on the device only for
    this call (one layer at a time).

    Args:
        handoff: this call's handoff (sealed blocks before it, recent keys and values).
        query: shape ``[batch, q_heads, q_len, head_dim]``, compute device.
        mask: the forward's lazy mask, or ``None``.
        scaling: softmax scale.

    Returns:
        Shape ``[batch, q_len, q_heads, head_dim]``, ``query.dtype``; ``None`` for a decode step, a first prefill,
        a mask other than plain causal, or padding other than left padding (the tiled path handles those).
    """
    from torch.nn.attention.bias import causal_lower_right

    batch, q_heads, q_len, _ = query.shape
    if q_len == 1 or not handoff.n_blocks_before or not plain_causal(mask):
        return None
    layer = handoff.layer
    total = handoff.first_recent_pos + handoff.key.shape[-2]
    left_padded, starts = left_padding(mask, total)
    if not left_padded:
        return None  # not left padding: the tiled path evaluates the mask exactly
    k, v = layer.blocks.sealed_kv(handoff.n_blocks_before, handoff.key, handoff.recent_values)
    k, v = k.to(query.dtype), v.to(query.dtype)
    kv_heads = layer.blocks.kv_heads
    group = q_heads // kv_heads

    def attend(q, k, v):
        bias = causal_lower_right(q.shape[-2], k.shape[-2])
        if group == 1:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scaling)
        # One KV head (and its query heads) at a time, over as many sequences as keep the repeated keys and values
        # within REPEAT_BYTES: not every KV head's copies for the whole batch at once (at 128K tokens, 8 KV heads
        # and 32 query heads, 1.9 GiB per sequence and layer).
        out = torch.empty_like(q)
        rows = repeat_rows(group, k.shape[-2], k.shape[-1], k.element_size())
        for b in range(0, q.shape[0], rows):
            for h in range(kv_heads):
                heads = slice(h * group, (h + 1) * group)
                out[b : b + rows, heads] = torch.nn.functional.scaled_dot_product_attention(
                    q[b : b + rows, heads],
                    k[b : b + rows, h : h + 1].expand(-1, group, -1, -1).contiguous(),
                    v[b : b + rows, h : h + 1].expand(-1, group, -1, -1).contiguous(),
                    attn_mask=bias,
                    scale=scaling,
                )
        return out

    if starts is None:
        return attend(query, k, v).transpose(1, 2).contiguous()
    return per_sequence(query, k, v, starts, attend)


# Bytes of keys and values repeated for the query heads of one KV head that a later prefill chunk holds at once
# (at least one sequence's): the batch is attended in slices of sequences below it.
REPEAT_BYTES = 256 << 20


def repeat_rows(group: int, tokens: int, head_dim: int, dtype_bytes: int) -> int:
    """Sequences per slice of a later prefill chunk's attention: one KV head's keys and values repeated for its
    ``group`` query heads over ``tokens`` keys stay within :data:`REPEAT_BYTES` (at least one sequence)."""
    per_sequence = 2 * group * tokens * head_dim * dtype_bytes
    return max(1, REPEAT_BYTES // max(per_sequence, 1))


def first_prefill(
    handoff: Handoff, query: torch.Tensor, mask: OffloadMask | None, scaling: float
) -> torch.Tensor | None:
    """Exact attention of a first prefill (no earlier tokens) through ``scaled_dot_product_attention``.

    A prompt's first forward attends only to its own tokens, which are all on the device: one fused causal
    attention per batch (or per sequence, on its unpadded span, when the batch is left-padded) instead of tiles.
    Outputs at padding positions are zero (no real token reads them).

    Args:
        handoff: this call's handoff; used only when nothing was cached before it.
        query: shape ``[batch, q_heads, q_len, head_dim]``, compute device.
        mask: the forward's lazy mask, or ``None``.
        scaling: softmax scale.

    Returns:
        Shape ``[batch, q_len, q_heads, head_dim]``, ``query.dtype``; ``None`` when the call is not a first prefill
        with a plain causal mask and left padding (the tiled path handles every other case).
    """
    batch, q_heads, q_len, _ = query.shape
    key, value = handoff.key, handoff.recent_values
    if q_len == 1 or handoff.n_blocks_before or handoff.first_recent_pos or key.shape[-2] != q_len:
        return None
    if not plain_causal(mask):
        return None
    left_padded, starts = left_padding(mask, q_len)
    if not left_padded:
        return None  # not left padding: the tiled path evaluates the mask exactly
    gqa = key.shape[1] != q_heads

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)

    if starts is None:
        return attend(query, key, value).transpose(1, 2).contiguous()
    return per_sequence(query, key, value, starts, attend)


def left_padding(mask: OffloadMask | None, total: int) -> tuple[bool, list[int] | None]:
    """Whether the padding of the first ``total`` positions is left padding, and where each sequence starts.

    Returns:
        ``(left_padded, starts)``: ``starts`` is ``None`` without padding, else the first real position per
        sequence (``total`` for a sequence without one); ``left_padded`` is ``False`` for any other padding.
    """
    padding = None if mask is None else mask.padding
    if padding is None:
        return True, None
    padding = padding[:, :total]
    if bool(padding.all()):
        return True, None
    real = padding.any(dim=-1)
    starts = torch.where(real, padding.int().argmax(dim=-1), total)
    positions = torch.arange(total, device=padding.device)
    if not bool((padding == (positions >= starts[:, None])).all()):
        return False, None
    return True, starts.tolist()


def per_sequence(query, key, value, starts: list[int], attend) -> torch.Tensor:
    """``attend`` per sequence on its unpadded span; zeros at padded queries (no real token reads them).

    Args:
        query: ``[batch, q_heads, q_len, head_dim]``, the last ``q_len`` positions of the keys.
        key: ``[batch, heads, total, head_dim]``, same device.
        value: same shape as ``key``.
        starts: first real position per sequence (``total``: none).
        attend: ``attend(q, k, v)`` for one sequence's real queries and keys, in SDPA's layout.

    Returns:
        Shape ``[batch, q_len, q_heads, head_dim]``.
    """
    q_len, first_query = query.shape[-2], key.shape[-2] - query.shape[-2]
    out = torch.zeros_like(query)
    for b, start in enumerate(starts):
        q_from = max(0, start - first_query)  # queries before the sequence's first real token are padding
        if q_from < q_len:
            out[b : b + 1, :, q_from:] = attend(
                query[b : b + 1, :, q_from:], key[b : b + 1, :, start:], value[b : b + 1, :, start:]
            )
    return out.transpose(1, 2).contiguous()
