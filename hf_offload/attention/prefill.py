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
    store = layer.blocks
    earlier = 2 * store.batch * store.kv_heads * handoff.n_blocks_before * store.block_tokens * store.head_dim
    parts = in_parts(query.device.type == "cpu", q_heads // store.kv_heads, earlier * query.element_size(), batch,
                     q_heads, q_len, query.shape[-1])  # fmt: skip
    if parts and lse_attention_available(query.device, query.dtype, query.shape[-1]):
        segment = segment_blocks(store.batch, store.kv_heads, store.block_tokens, store.head_dim, query.element_size())
        return segmented_prefill(handoff, query, starts, scaling, segment)
    k, v = layer.blocks.sealed_kv(handoff.n_blocks_before, handoff.key, handoff.recent_values)
    k, v = k.to(query.dtype), v.to(query.dtype)
    kv_heads = layer.blocks.kv_heads
    group = q_heads // kv_heads

    grouped = group > 1 and flash_grouped_available(query.device, query.dtype, query.shape[-1])

    def attend(q, k, v):
        if grouped:  # every query head reads its KV head in the fused kernel: no repeated keys and values
            return grouped_flash(q, k, v, scaling)
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


# Bytes of earlier keys and values a later prefill chunk holds on the device at once: past them, the earlier sealed
# blocks are recalled and attended a segment at a time, the segments' attentions merged by their log-sum-exp.
SEGMENT_BYTES = 256 << 20

# Bytes of the float32 output and log-sum-exp a segmented chunk accumulates at once (a slice of the sequences).
ACCUMULATOR_BYTES = 256 << 20


def segment_blocks(batch: int, kv_heads: int, block_tokens: int, head_dim: int, dtype_bytes: int) -> int:
    """Sealed blocks per segment of a later prefill chunk: the keys and values of that many blocks of every
    sequence stay within :data:`SEGMENT_BYTES` (at least one block)."""
    per_block = 2 * batch * kv_heads * block_tokens * head_dim * dtype_bytes
    return max(1, SEGMENT_BYTES // max(per_block, 1))


def accumulator_rows(q_heads: int, q_len: int, head_dim: int) -> int:
    """Sequences per slice of a segmented chunk: their float32 output and log-sum-exp stay within
    :data:`ACCUMULATOR_BYTES` (at least one sequence)."""
    return max(1, ACCUMULATOR_BYTES // max(4 * q_heads * q_len * (head_dim + 1), 1))


def accumulator_bytes(batch: int, q_heads: int, q_len: int, head_dim: int) -> int:
    """Bytes of the float32 output and log-sum-exp of one slice of a segmented chunk's sequences."""
    per_row = 4 * q_heads * q_len * (head_dim + 1)
    return per_row * min(batch, accumulator_rows(q_heads, q_len, head_dim))


def in_parts(cpu: bool, group: int, earlier_bytes: int, batch: int, q_heads: int, q_len: int, head_dim: int) -> bool:
    """Whether a later chunk attends in parts merged by their log-sum-exp (:func:`segmented_prefill`) rather than
    with one masked attention over all its keys (:func:`chunk_prefill`): where the parts hold less on the device
    (:func:`segments_pay`), and on the CPU also wherever ``group`` query heads share a KV head.

    On the CPU the parts were faster (2 cores, the Qwen2.5-Coder-1.5B shape cut to 2 layers, 8K prefix: the masked
    calls, one per KV head over its repeated keys, took 1.51x their time for a 36-token question, 1.10x for a
    1,024-token chunk; ``results/prefill/cpu_qwen15_2layers_8k.json``). On an H100 those masked calls were faster
    for a question, where the step is bound by launches on the host (the parts launch more: 0.93x the parts' time
    at the 1.5B shape with a 32K prefix, 0.81x at the Llama-3.1-8B shape with 64K), and within 9% either way for
    chunks of 1,024-8,192 tokens (``results/prefill/h100_qwen15_32k.json``, ``h100_llama8b_64k.json``)."""
    return (cpu and group > 1) or segments_pay(earlier_bytes, batch, q_heads, q_len, head_dim)


def segments_pay(earlier_bytes: int, batch: int, q_heads: int, q_len: int, head_dim: int) -> bool:
    """Whether a later chunk whose earlier keys and values take ``earlier_bytes`` holds less in segments: one
    segment, the accumulator and one call's output (under twice the accumulator) against all of them at once."""
    return earlier_bytes > SEGMENT_BYTES + 2 * accumulator_bytes(batch, q_heads, q_len, head_dim)


# Bytes of float32 output a later prefill chunk's part merges at once (a short chunk's: every query head in one
# merge; a long one's: a KV head's query heads at a time).
MERGE_BYTES = 64 << 20

# Bytes of keys and values repeated for the query heads of one KV head that a later prefill chunk holds at once
# (at least one sequence's): the batch is attended in slices of sequences below it.
REPEAT_BYTES = 256 << 20


def repeat_rows(group: int, tokens: int, head_dim: int, dtype_bytes: int) -> int:
    """Sequences per slice of a later prefill chunk's attention: one KV head's keys and values repeated for its
    ``group`` query heads over ``tokens`` keys stay within :data:`REPEAT_BYTES` (at least one sequence)."""
    per_sequence = 2 * group * tokens * head_dim * dtype_bytes
    return max(1, REPEAT_BYTES // max(per_sequence, 1))


def _attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """Attention and its log-sum-exp per query through the fused kernel's own entry point (the one
    ``scaled_dot_product_attention`` dispatches to): ``(out, lse)``, ``out`` like ``q``, ``lse`` ``[B, H, L]``
    float32. ``causal`` only with as many keys as queries."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None, scale=scale
        )
        return out, lse
    if q.device.type != "cuda":
        raise NotImplementedError(f"no fused attention with a log-sum-exp on {q.device.type}")
    if q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    else:
        result = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return result[0], result[1][..., : q.shape[-2]].float()


_LSE_CHECKED: dict[tuple, bool] = {}


def lse_attention_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :func:`_attention_with_lse` runs on ``device`` for ``dtype`` and ``head_dim`` and its segments,
    merged, give the attention ``scaled_dot_product_attention`` gives over all keys at once; checked once per
    combination on a small random case (a torch build without these entry points, or with other conventions,
    keeps the unsegmented path)."""
    return _checked_once(_LSE_CHECKED, _check_lse, device, dtype, head_dim)


def _checked_once(checked: dict, check, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """``check(device, dtype, head_dim)``, run once per combination and remembered in ``checked``."""
    key = (device.type, device.index, dtype, head_dim)
    if key not in checked:
        checked[key] = check(device, dtype, head_dim)
    return checked[key]


def _check_lse(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, head_dim, generator=g).to(device, dtype) for n in (24, 56, 56))
    scale = head_dim**-0.5
    try:
        with torch.no_grad():
            expected = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=causal_lower_right(24, 56), scale=scale
            )
            merge = _Merge(q.shape, device)
            for part, causal in ((slice(0, 32), False), (slice(32, 56), True)):
                out, lse = _attention_with_lse(q, k[:, :, part].contiguous(), v[:, :, part].contiguous(), causal, scale)
                merge.add(out, lse, slice(None), slice(None), slice(None))
            got = merge.out
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    return bool((got - expected).abs().max() <= tolerance)


def grouped_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` (``[B, q_heads, L, D]``) over ``k`` and ``v`` (``[B, kv_heads, S, D]``, ``S >= L``,
    ``q_heads`` a multiple of ``kv_heads``), the mask aligned to the last key, through the fused flash kernel's
    grouped-query form (where :func:`flash_grouped_available`)."""
    return torch.ops.aten._scaled_dot_product_flash_attention(q.contiguous(), k, v, 0.0, True, False, scale=scale)[0]


_GROUPED_CHECKED: dict[tuple, bool] = {}


def flash_grouped_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the fused flash kernel on ``device`` attends queries of several heads per KV head directly (its
    grouped-query form) with the causal mask aligned to the last key (``is_causal`` with fewer queries than keys),
    giving what ``scaled_dot_product_attention`` gives over keys and values repeated per query head: then a later
    prefill chunk attends in one call instead of one call per KV head over repeated copies. Checked once per
    combination on a small random case; CUDA with float16 or bfloat16 only."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim > 256 or head_dim % 8:
        return False
    return _checked_once(_GROUPED_CHECKED, _check_flash_grouped, device, dtype, head_dim)


def _check_flash_grouped(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator().manual_seed(0)
    # Long enough for the kernel to split the keys across programs, as it does over a long prefix.
    q = torch.randn(2, 6, 24, head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(2, 2, 1056, head_dim, generator=g).to(device, dtype) for _ in range(2))
    scale = head_dim**-0.5
    try:
        with torch.no_grad():
            expected = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float().repeat_interleave(3, 1), v.float().repeat_interleave(3, 1),
                attn_mask=causal_lower_right(24, 1056), scale=scale,
            )  # fmt: skip
            got = grouped_flash(q, k, v, scale)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return False
    return got.shape == expected.shape and bool((got.float() - expected).abs().max() <= 3e-2)


class _Merge:
    """The attention of queries over several parts of their keys, merged by each part's log-sum-exp: ``out``
    float32, normalized over the keys added so far (zeros where none), ``lse`` ``-inf`` where none."""

    def __init__(self, shape: torch.Size, device: torch.device):
        self.out = torch.zeros(shape, dtype=torch.float32, device=device)  # [rows, q_heads, q_len, head_dim]
        self.lse = torch.full(shape[:-1], float("-inf"), dtype=torch.float32, device=device)
        self.empty = True  # nothing added yet: a part is copied in, not merged

    def add(self, out: torch.Tensor, lse: torch.Tensor, rows: slice, heads: slice, queries: slice) -> None:
        """Merge one part's ``out`` ``[r, h, q, head_dim]`` and ``lse`` ``[r, h, q]`` into ``rows``, ``heads`` and
        ``queries`` (in place, on views of the accumulator)."""
        acc, acc_lse = self.out[rows, heads, queries], self.lse[rows, heads, queries]
        if self.empty:
            acc.copy_(out)
            acc_lse.copy_(lse)
            self.empty = False
            return
        new = torch.logaddexp(acc_lse, lse)
        acc.mul_(torch.exp(acc_lse - new)[..., None]).add_(out.float() * torch.exp(lse - new)[..., None])
        acc_lse.copy_(new)


def segmented_prefill(
    handoff: Handoff, query: torch.Tensor, starts: list[int] | None, scaling: float, segment: int
) -> torch.Tensor:
    """Exact attention of a later prefill chunk whose earlier blocks are attended a segment at a time (at least
    ``segment`` blocks, as many as :data:`SEGMENT_BYTES` allows for one slice of the sequences; each recalled in one
    pass, :meth:`~hf_offload.cache.blocks.BlockStore.sealed_segment`), then the recent tokens before the chunk,
    then the chunk's own tokens (causal); the parts merged by their log-sum-exp.
    The device holds one segment of the layer's earlier KV instead of all of it. Sequences are taken in slices
    (:func:`accumulator_rows`); left padding is cut per sequence from each part.

    Returns:
        Shape ``[batch, q_len, q_heads, head_dim]``, ``query.dtype``; zeros at padded queries.
    """
    layer = handoff.layer
    store = layer.blocks
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, T, n = store.kv_heads, store.block_tokens, handoff.n_blocks_before
    group = q_heads // kv_heads
    recent_k, recent_v = handoff.key.to(query.dtype), handoff.recent_values.to(query.dtype)
    before = recent_k.shape[-2] - q_len  # recent tokens before the chunk (the open block's)
    first_query = handoff.first_recent_pos + before
    starts = [0] * batch if starts is None else starts
    out = torch.zeros_like(query)

    def attend(merge: _Merge, rows: slice, k: torch.Tensor, v: torch.Tensor, causal: bool, q_from: int, merged) -> None:
        """One part for the sequences ``rows`` (queries from ``q_from``), merged into ``merge`` at ``merged`` (its
        rows): keys that every query sees in one call, the query heads of each KV head stacked as more queries of
        it (no copy of the keys and values per query head); the causal part, short, in one call over keys and values
        repeated per query head, else one KV head at a time."""
        q = query[rows, :, q_from:]
        if not causal and group > 1:
            b, _, n_q, _ = q.shape  # query head h * group + g of KV head h: its queries g * n_q + i
            o, lse = _attention_with_lse(q.reshape(b, kv_heads, group * n_q, head_dim).contiguous(), k.contiguous(),
                                         v.contiguous(), False, scaling)  # fmt: skip
            o, lse = o.view(b, kv_heads, group, n_q, head_dim), lse.view(b, kv_heads, group, n_q)
            if 4 * o.numel() <= MERGE_BYTES:  # one merge for every query head (query head h * group + g)
                merge.add(o.reshape(b, q_heads, n_q, head_dim), lse.reshape(b, q_heads, n_q), merged, slice(None),
                          slice(q_from, None))  # fmt: skip
                return
            for h in range(kv_heads):  # merged a KV head at a time: the merge's temporaries stay a head's
                merge.add(o[:, h], lse[:, h], merged, slice(h * group, (h + 1) * group), slice(q_from, None))
            return
        b, _, n_q, _ = q.shape
        repeated = 2 * b * q_heads * k.shape[-2] * head_dim * k.element_size() if group > 1 else 0
        if repeated <= REPEAT_BYTES and 4 * b * q_heads * n_q * head_dim <= MERGE_BYTES:
            # A short part: every query head in one call (the keys and values repeated per query head) and one merge.
            if group > 1:
                k = k[:, :, None].expand(-1, -1, group, -1, -1).reshape(b, q_heads, k.shape[-2], head_dim)
                v = v[:, :, None].expand(-1, -1, group, -1, -1).reshape(b, q_heads, v.shape[-2], head_dim)
            o, lse = _attention_with_lse(q.contiguous(), k.contiguous(), v.contiguous(), causal, scaling)
            merge.add(o, lse, merged, slice(None), slice(q_from, None))
            return
        sub = repeat_rows(group, k.shape[-2], head_dim, k.element_size())
        for r in range(0, q.shape[0], sub):
            for h in range(kv_heads):
                heads = slice(h * group, (h + 1) * group)
                kk, vv = k[r : r + sub, h : h + 1], v[r : r + sub, h : h + 1]
                if group > 1:
                    kk, vv = kk.expand(-1, group, -1, -1), vv.expand(-1, group, -1, -1)
                o, lse = _attention_with_lse(q[r : r + sub, heads].contiguous(), kk.contiguous(), vv.contiguous(),
                                             causal, scaling)  # fmt: skip
                merge.add(o, lse, _sub_rows(merged, r, sub), heads, slice(q_from, None))

    def earlier(merge: _Merge, r0: int, r1: int, k: torch.Tensor, v: torch.Tensor, pos: int) -> None:
        """Keys at positions ``pos`` onwards, before every query of the chunk: no mask, but each sequence's
        padding cut off."""
        cut = [max(0, starts[b] - pos) for b in range(r0, r1)]
        if not any(cut):
            attend(merge, slice(r0, r1), k, v, False, 0, slice(0, r1 - r0))
            return
        for i, c in enumerate(cut):
            if c < k.shape[-2]:
                attend(merge, slice(r0 + i, r0 + i + 1), k[i : i + 1, :, c:], v[i : i + 1, :, c:], False, 0,
                       slice(i, i + 1))  # fmt: skip

    rows_per = accumulator_rows(q_heads, q_len, head_dim)
    for r0 in range(0, batch, rows_per):
        r1 = min(batch, r0 + rows_per)
        merge = _Merge((r1 - r0, q_heads, q_len, head_dim), query.device)
        # Segments as large as the bound allows for this slice of the sequences (``segment``: for all of them).
        segment = max(segment, segment_blocks(r1 - r0, kv_heads, T, head_dim, query.element_size()))
        for first in range(0, n, segment):
            last = min(n, first + segment)
            if all(starts[b] >= last * T for b in range(r0, r1)):
                continue  # padding only
            k, v = store.sealed_segment(slice(r0, r1), first, last)
            earlier(merge, r0, r1, k.to(query.dtype), v.to(query.dtype), first * T)
        if before:
            earlier(merge, r0, r1, recent_k[r0:r1, :, :before], recent_v[r0:r1, :, :before], handoff.first_recent_pos)
        # The chunk's own tokens: as many keys as queries from each sequence's first real one, causal.
        own_k, own_v = recent_k[r0:r1, :, before:], recent_v[r0:r1, :, before:]
        q_from = [max(0, starts[b] - first_query) for b in range(r0, r1)]
        if not any(q_from):
            attend(merge, slice(r0, r1), own_k, own_v, True, 0, slice(0, r1 - r0))
        else:
            for i, f in enumerate(q_from):
                if f < q_len:
                    attend(merge, slice(r0 + i, r0 + i + 1), own_k[i : i + 1, :, f:], own_v[i : i + 1, :, f:], True,
                           f, slice(i, i + 1))  # fmt: skip
        result = merge.out
        for i, f in enumerate(q_from):
            if f:
                result[i, :, :f] = 0  # padded queries (no real token reads them)
        out[r0:r1] = result.to(query.dtype)
    return out.transpose(1, 2).contiguous()


def _sub_rows(rows: slice, r: int, sub: int) -> slice:
    """Rows ``r`` to ``r + sub`` of the slice ``rows`` (clipped to it)."""
    start = rows.start + r
    return slice(start, min(rows.stop, start + sub))


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
    # Every layer of a forward asks alike, and the answer reads the mask on the host: once per forward.
    return mask.memo(("left_padding", total), lambda: _left_padding(padding, total))


def _left_padding(padding: torch.Tensor, total: int) -> tuple[bool, list[int] | None]:
    """:func:`left_padding` of a 2D padding mask (``[batch, >= total]``, ``torch.bool``)."""
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
