"""One decode query of a plain causal forward whose selection fits the slot pool: plan, recall, one attention over
the slot pool in place (or the paged kernel), replayed from a CUDA graph where the layer captures one."""

from __future__ import annotations

import torch

from ..kernels.paged import paged_decode
from ..kernels.tail import attention_lse
from ..selectors.base import Selection
from .handoff import Handoff, OffloadMask
from .inputs import DecodeInputs


def decode_step(
    handoff: Handoff, query: torch.Tensor, mask: OffloadMask | None, scaling: float, n: int, k: int
) -> torch.Tensor:
    """One decode query of a plain causal forward whose selection fits the slot pool: plan, recall, one SDPA.

    The step scores :meth:`~hf_offload.cache.planner.DecodePlanner.decode_capacity` blocks: the ``n`` sealed ones
    rounded up to ``decode_capacity_blocks``, the rest masked, so that one captured graph serves a step geometry over
    many seals (:meth:`~hf_offload.cache.graphs.GraphRunner.run_decode` captures and replays it).

    Args:
        handoff: this step's handoff.
        query: ``[batch, q_heads, 1, head_dim]``, model dtype, compute device (after RoPE).
        mask: the forward's lazy mask (plain causal), or ``None``.
        scaling: softmax scale.
        n: sealed blocks before this step.
        k: blocks the budget selects (``n`` or more: all of them).

    Returns:
        ``[batch, 1, q_heads, head_dim]``, ``query.dtype``.
    """
    layer = handoff.layer
    planner = layer.planner
    sealed, n = n, planner.decode_capacity(n, k)  # from here on: the blocks the step scores
    capturing = layer.graphs.layer_capture
    if capturing is not None:  # the whole decoder layer is being captured: its step's work, recorded as it is
        if (n, k) != (capturing.n, capturing.k):
            raise RuntimeError(
                f"Layer {layer.layer_idx}: the decode step being captured scores {n} blocks and selects {k}, where "
                f"its decoder layer's capture planned {capturing.n} and {capturing.k}."
            )
        return decode_body(layer, query, capturing.inputs, n, k, scaling, None, None, False, capturing.reuse)
    inputs = layer.decode_inputs(handoff, mask, n)
    reuse = planner.reuses_selection(handoff.first_recent_pos + handoff.recent_tokens - 1, sealed, k, n)
    if reuse:
        layer.stats.add(("reused_selections",), 1)
    out = layer.graphs.run_decode(
        n, k, query, scaling, inputs, reuse,
        op_by_op=lambda: decode_body(layer, query, inputs, n, k, scaling, mask, layer.timer, reuse=reuse),
        body=lambda q: decode_body(layer, q, inputs, n, k, scaling, None, None, False, reuse),
    )  # fmt: skip
    layer.finish_step()
    return out


def decode_body(
    layer,
    query: torch.Tensor,
    inputs: DecodeInputs,
    n: int,
    k: int,
    scaling: float,
    mask: OffloadMask | None,
    timer,
    count_step: bool = True,
    reuse: bool = False,
) -> torch.Tensor:
    """The work of one decode step of one layer (what a CUDA graph captures): plan, make the selection resident,
    attend. No host synchronisation (with a disk tier: one, between the plan and the recall, which a captured step
    runs between two graphs); reads only the layer's state, ``inputs`` and ``query``.

    Args:
        layer: the offloaded layer.
        query: ``[batch, q_heads, 1, head_dim]``, model dtype, compute device.
        inputs: the step's shared inputs.
        n, k: blocks the step scores (the sealed blocks before it, or its capacity); blocks the budget selects.
        scaling: softmax scale.
        mask: the forward's lazy mask, for lookahead only (``None`` while capturing).
        timer: the layer's phase timer, or ``None``.
        count_step: count a decode step in the layer's stats (not while capturing: each replay counts).
        reuse: attend the layer's kept selection instead of choosing (``OffloadConfig.reselect_every``).
    """
    batch, q_heads, _, head_dim = query.shape
    heads = layer.blocks.kv_heads
    q = query.view(batch, heads, q_heads // heads, head_dim)  # [B, H, G, D]
    if timer is not None:
        t_start = timer.mark()
    selection = layer.planner.plan_decode(q, scaling, n, k, inputs, reuse)
    if timer is not None:
        timer.add("select", t_start, t_select := timer.mark())
    recaller = layer.recaller
    capture = layer.graphs.layer_capture
    if capture is not None and capture.ahead is not None:
        # Lookahead inside the whole layer's graph, from this layer's query: joined at the end of the layer's work.
        capture.ahead.prefetch_in_graph(q, scaling, inputs, n, k)
    if layer.execution.lookahead and count_step and not recaller.prefetched_ahead:
        # Lookahead: the next offloaded layer's likely blocks start moving now, behind this layer's work (unless
        # they started before this layer, from the next layer's predicted query: lookahead_query="next").
        recaller.lookahead_next(q, mask, scaling)
        if timer is not None:
            timer.add("prefetch", t_select, t_select := timer.mark())
    # With a disk tier the recall reads the blocks on disk on the host and stages those ranked below the selection.
    stage = selection if layer.blocks.host.disk is not None else None
    blocks, keep, slots, _, _ = next(
        recaller.resident_rounds(selection, decode=True, count_step=count_step, gather=False,
                                 in_place=layer.execution.paged, stage=stage)
    )
    if timer is not None:
        timer.add("recall", t_select, t_recalled := timer.mark())
    out = decode_sdpa(layer, query, blocks, keep, slots, inputs, n, scaling, selection)
    planner = layer.planner
    if not (planner.leaves_out(n, k) and layer.selector.estimates_tail):  # else counted with the estimate
        planner.count_step(selection, q_heads, exact=not planner.leaves_out(n, k))
    if timer is not None:
        timer.add("attention", t_recalled, timer.mark())
    return out


def decode_sdpa(
    layer,
    query: torch.Tensor,
    blocks: torch.Tensor,
    keep: torch.Tensor,
    slots: torch.Tensor,
    inputs: DecodeInputs,
    n: int,
    scaling: float,
    plan: Selection | None = None,
) -> torch.Tensor:
    """One decode query over its selected blocks and the open block: one ``scaled_dot_product_attention`` over the
    whole slot pool in place.

    The pool's keys of one sequence and head are one contiguous run of every slot's tokens, the open block's slot
    last, so attention reads them where they are (no gather of the selected blocks, no concatenation); the mask lets
    through the selected slots' tokens (minus padding) and the open block's filled positions. The key length is the
    pool's, the same at every step: attention backends that plan per shape (cuDNN) plan once, and a captured graph
    serves every step. The query heads of one KV head stand in the query-length dimension, so grouped query attention
    needs no repeated keys.

    Args:
        layer: the offloaded layer (its slot pool).
        query: shape ``[batch, q_heads, 1, head_dim]``, compute device.
        blocks: selected block indices, ``[batch, 1 or kv_heads, k]``, ``torch.int64``.
        keep: which selected entries are attended, same shape, ``torch.bool``.
        slots: the pool slot of each entry, ``[batch, kv_heads, k]``, ``torch.int64``.
        inputs: the step's shared inputs (``rows``).
        n: blocks the step scores (``inputs.capacity``; row ``n`` of ``inputs.rows`` is the open block).
        scaling: softmax scale.
        plan: the step's selection (its ``scores`` and ``block_lse`` go to the estimate of the unselected blocks).

    Returns:
        Shape ``[batch, 1, q_heads, head_dim]``, ``query.dtype``.
    """
    pool = layer.blocks.pool
    batch, q_heads, _, head_dim = query.shape
    heads, sel_heads, k = pool.kv_heads, blocks.shape[1], blocks.shape[-1]
    tail = layer.planner.leaves_out(n, k) and layer.selector.estimates_tail
    if layer.execution.paged:
        return decode_paged(layer, query, blocks, keep, slots, inputs, n, scaling, plan, tail)
    total, tokens = pool.slots + 1, layer.block_tokens
    entry_rows = inputs.rows[inputs.sequence, torch.where(keep, blocks, n + 1)]  # [B, Hs, k, T]; row n + 1: none
    # Each kept entry's row goes to its slot; other entries to a spare column past the pool (dropped below).
    target = torch.where(keep, slots[:, :sel_heads], total)
    ok = torch.zeros((batch, sel_heads, total + 1, tokens), dtype=torch.bool, device=query.device)
    ok.scatter_(2, target[..., None].expand(batch, sel_heads, k, tokens), entry_rows)
    ok[:, :, total - 1] = inputs.rows[:, None, n]  # the open block's slot
    ok = ok[:, :, :total].flatten(-2)[:, :, None]  # [B, Hs, 1, total * T]
    k_all, v_all = pool.keys, pool.values
    if k_all.dtype != query.dtype:
        k_all, v_all = k_all.to(query.dtype), v_all.to(query.dtype)
    grouped = query.view(batch, heads, q_heads // heads, head_dim)  # the group as the query-length dimension
    if tail:
        out, lse = attention_lse(grouped, k_all, v_all, ok, scaling)
        return with_tail(layer, query, grouped, out, lse, blocks, keep, inputs, n, scaling, plan)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, k_all, v_all, attn_mask=ok, scale=scaling)
    return out.reshape(batch, 1, q_heads, head_dim)


def with_tail(
    layer,
    query: torch.Tensor,
    grouped: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    blocks: torch.Tensor,
    keep: torch.Tensor,
    inputs: DecodeInputs,
    n: int,
    scaling: float,
    plan: Selection | None,
) -> torch.Tensor:
    """The selection's attention (``out``, ``lse``: float32, ``[batch, kv_heads, group, head_dim]`` and ``[batch,
    kv_heads, group]``) merged with the selector's estimate of the unselected blocks through the log-sum-exp;
    returns ``[batch, 1, q_heads, head_dim]``, ``query.dtype``. ``query`` is ``[batch, q_heads, 1, head_dim]`` and
    ``grouped`` its ``[batch, kv_heads, group, head_dim]`` view; the other arguments as :func:`decode_sdpa`'s."""
    batch, q_heads, _, head_dim = query.shape
    selection = Selection(blocks=blocks, keep=keep, scores=None if plan is None else plan.scores,
                          block_lse=None if plan is None else plan.block_lse,
                          ranked=None if plan is None or plan.blocks is not blocks else plan.ranked)  # fmt: skip
    out, tail_lse = layer.planner.estimate_tail_merged(grouped, scaling, n, selection, inputs.rows[:, :n], out, lse,
                                               query.dtype)  # fmt: skip
    layer.planner.count_step(selection, q_heads, False, tail_lse, lse)
    return out.reshape(batch, 1, q_heads, head_dim)


def decode_paged(
    layer,
    query: torch.Tensor,
    blocks: torch.Tensor,
    keep: torch.Tensor,
    slots: torch.Tensor,
    inputs: DecodeInputs,
    n: int,
    scaling: float,
    plan: Selection | None,
    tail: bool,
) -> torch.Tensor:
    """:func:`decode_sdpa` through :func:`~hf_offload.kernels.paged.paged_decode`: each selected block is read
    where it lies (an admitted chunk, or its slot), the open block from the pool's last slot; no mask is built.
    Arguments and result as :func:`decode_sdpa`'s (``tail``: merge the selector's estimate of the unselected
    blocks)."""
    batch, q_heads, _, head_dim = query.shape
    store = layer.blocks
    heads = store.kv_heads
    grouped = query.view(batch, heads, q_heads // heads, head_dim)
    addrs, on_host = store.host.chunk_tables(store.device)
    out, lse = paged_decode(
        grouped, scaling, blocks, keep, slots, inputs.rows, n, store.block_table_dev, addrs, on_host,
        store.host.chunk_blocks, store.pool.data, out_dtype=torch.float32 if tail else query.dtype,
    )  # fmt: skip
    if tail:
        return with_tail(layer, query, grouped, out, lse, blocks, keep, inputs, n, scaling, plan)
    return out.reshape(batch, 1, q_heads, head_dim)
