"""The attention function the offload attention registers: the handoff taken, then prefill, a fused decode step or
the general tiled path (other masks, soft-capping, sink logits) with an online softmax."""

from __future__ import annotations

import torch

from ..kernels import OnlineSoftmax
from .decode import decode_step
from .handoff import Handoff, OffloadMask, plain_causal
from .prefill import chunk_prefill, first_prefill


def offload_attention_forward(
    handoff: Handoff,
    query: torch.Tensor,
    mask: OffloadMask | None,
    scaling: float | None = None,
    softcap: float | None = None,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one layer over the offloaded cache: plan (select, make resident), then run.

    Decode (one query): the selected sealed blocks plus the recent tokens; right after the plan, the next offloaded
    layer's likely blocks are prefetched (lookahead). Prefill (several queries): every earlier
    sealed block plus the recent tokens, exactly. With a plain causal mask (left padding allowed) a prompt's first
    forward, each later prefill chunk (its earlier blocks recalled in one pass) and each decode step whose
    selection fits the slot pool run as one ``scaled_dot_product_attention``; other masks, soft-capping and sink
    logits use tiles of ``prefill_chunk_tokens`` with an online softmax.

    Args:
        handoff: what ``OffloadLayer.update`` left for this call.
        query: shape ``[batch, q_heads, q_len, head_dim]``, model dtype, compute device (after RoPE).
        mask: the lazy mask of this forward, or ``None`` for plain causal attention.
        scaling: softmax scale; ``None``: ``head_dim ** -0.5``.
        softcap: optional logit soft-capping.
        sink_logits: optional learned sink logits, shape ``[q_heads]``.

    Returns:
        Shape ``[batch, q_len, q_heads, head_dim]``, ``query.dtype`` (the layout transformers' attention functions
        return).
    """
    layer = handoff.layer
    store, planner, recaller = layer.blocks, layer.planner, layer.recaller
    batch, q_heads, q_len, head_dim = query.shape
    heads = store.kv_heads
    if scaling is None:
        scaling = head_dim**-0.5
    if softcap is None and sink_logits is None:
        out = first_prefill(handoff, query, mask, scaling)
        if out is None:
            out = chunk_prefill(handoff, query, mask, scaling)
        if out is not None:
            if layer.graphs.question_capture is None:  # a replayed question's append is followed by its own
                layer.finish_step()
            return out
    if layer.graphs.question_capture is not None:
        from ..cache.graphs import NotCapturable

        raise NotCapturable("a question whose attention takes the tiled path")
    grouped = query.view(batch, heads, q_heads // heads, q_len, head_dim)
    device = query.device
    end = handoff.first_recent_pos + handoff.key.shape[-2]
    tile = layer.config.prefill_chunk_tokens
    q_tiles = [slice(s, min(s + tile, q_len)) for s in range(0, q_len, tile)]
    acc = q_pos = None  # the tiled path's state, made when it runs (a fused decode step needs neither)

    def tiled():
        nonlocal acc, q_pos
        if acc is None:
            acc = OnlineSoftmax(grouped, scaling, softcap)
            q_pos = torch.arange(end - q_len, end, device=device)
        return acc

    def allowed(q_slice: slice, kv_pos: torch.Tensor) -> torch.Tensor:
        if mask is None:
            return (kv_pos[:, :, None, :] <= q_pos[q_slice].view(1, 1, -1, 1))[:, :, None]
        return mask.allowed(q_pos[q_slice], kv_pos)[:, :, None]

    n = handoff.n_blocks_before
    if q_len == 1 and n and softcap is None and sink_logits is None and plain_causal(mask):
        k = planner.decode_blocks(n, handoff.recent_tokens)
        if min(k, n) <= store.pool.slots:  # the selection fits the slot pool: one fused step
            return decode_step(handoff, query, mask, scaling, n, k)
        layer.graphs.note_rounds(min(k, n), store.pool.slots)
    timer = layer.timer if q_len == 1 else None
    if timer is not None:
        t_start = timer.mark()
    # Sealed blocks: recalled into the slot pool in rounds of at most the pool size.
    if n:
        if q_len == 1:
            selection = planner.select(grouped[:, :, :, 0], mask, scaling, handoff)
        else:
            selection = planner.select_all(n)
        if timer is not None:
            timer.add("select", t_start, t_select := timer.mark())
        if q_len == 1 and layer.execution.lookahead:
            # Lookahead: the next offloaded layer's likely blocks start moving now, behind this layer's work.
            recaller.lookahead_next(grouped[:, :, :, 0], mask, scaling)
            if timer is not None:
                timer.add("prefetch", t_select, t_select := timer.mark())
        # A decode step with a disk tier stages from disk what the selection left out or ranked just below it.
        stage = selection if q_len == 1 and store.host.disk is not None else None
        rounds = recaller.resident_rounds(selection, decode=q_len == 1, stage=stage)
        for blocks, keep, _, keys, values in rounds:
            tiled()
            if timer is not None:
                timer.add("recall", t_select, t_recalled := timer.mark())
            tokens = torch.arange(store.block_tokens, device=device)
            kv_pos = (blocks[..., None] * store.block_tokens + tokens).flatten(-2)  # [B, Hs, n*T]
            keep_tokens = keep[..., None].expand(*keep.shape, store.block_tokens).flatten(-2)
            for q_slice in q_tiles:
                for k_start in range(0, keys.shape[-2], tile):
                    k_slice = slice(k_start, k_start + tile)
                    ok = allowed(q_slice, kv_pos[..., k_slice]) & keep_tokens[:, :, None, None, k_slice]
                    acc.add(keys[:, :, k_slice], values[:, :, k_slice], ok, q_slice)
            if timer is not None:
                timer.add("attention", t_recalled, t_select := timer.mark())
    elif timer is not None:
        t_select = t_start

    # Recent tokens (open block and, in prefill, the new chunk): resident, causal tiles.
    tiled()
    recent_k, recent_v = handoff.key, handoff.recent_values
    for q_slice in q_tiles:
        q_last = int(q_pos[q_slice.stop - 1]) if q_len > 1 else end - 1
        for k_start in range(0, recent_k.shape[-2], tile):
            if handoff.first_recent_pos + k_start > q_last:
                break
            k_slice = slice(k_start, min(k_start + tile, recent_k.shape[-2]))
            kv_pos = torch.arange(
                handoff.first_recent_pos + k_slice.start, handoff.first_recent_pos + k_slice.stop, device=device
            ).view(1, 1, -1)
            acc.add(recent_k[:, :, k_slice], recent_v[:, :, k_slice], allowed(q_slice, kv_pos), q_slice)

    leaves_out = q_len == 1 and n and planner.leaves_out(n, selection.blocks.shape[-1])
    if leaves_out and layer.selector.estimates_tail:
        # The unselected blocks' attention, estimated by the selector, joins the softmax through its log-sum-exp.
        kv_pos = torch.arange(n * store.block_tokens, device=device).view(1, 1, -1)
        tokens_ok = allowed(slice(0, 1), kv_pos)[:, 0, 0, 0].expand(batch, -1).reshape(batch, n, -1)
        tail_out, tail_lse = planner.estimate_tail(grouped[:, :, :, 0], scaling, n, selection, tokens_ok, softcap)
        planner.count_step(selection, q_heads, False, tail_lse, (acc.m + torch.log(acc.l))[:, :, :, 0])
        acc.add_partial(tail_out[:, :, :, None], tail_lse[:, :, :, None])
    elif q_len == 1 and n:
        planner.count_step(selection, q_heads, exact=not leaves_out)

    layer.finish_step()
    out = acc.result(sink_logits)  # [B, H, G, Q, D]
    if timer is not None:
        timer.add("attention", t_select, timer.mark())
    return out.reshape(batch, q_heads, q_len, head_dim).transpose(1, 2).to(query.dtype).contiguous()
