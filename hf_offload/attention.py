"""The attention function and mask function that an :class:`~hf_offload.cache.OffloadCache` switches a model to.

transformers calls ``cache.update(k, v, layer_idx)`` and then the attention function with the same key tensor, but
never passes the cache to the attention function. ``OffloadLayer.update`` therefore leaves a :class:`Handoff` (the
layer, and the key tensor it returned) that the next attention call takes. A call without a handoff (a
``DynamicCache``, no cache, a sliding layer) is handed to the model's original attention function with the
original mask, so a switched model behaves exactly as before whenever the cache is not an ``OffloadCache``.

The registered mask function returns an :class:`OffloadMask`: the arguments transformers prepared, kept lazily.
The original mask is built from them only if the original attention function needs it (once per forward, shared by
the layers); the offload path evaluates the same mask function only at the positions it attends to, so no
``q_len x context`` mask is ever built.

The registration and the switch of a model live in :mod:`hf_offload.patches.attention`; nothing is registered
at import time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from .kernels import OnlineSoftmax
from .kernels.paged import paged_decode
from .kernels.tail import attention_lse
from .graphs import DecodeInputs
from .selectors.base import Selection

if TYPE_CHECKING:
    from .cache import OffloadLayer

# ----------------------------------------------------------------------------------------------------------- handoff
@dataclass
class Handoff:
    """What ``OffloadLayer.update`` leaves for the attention call that follows it.

    Attributes:
        layer: the cache layer that was updated.
        key: the key tensor ``update`` returned (the attention call must receive this very object).
        recent_values: the value tensor ``update`` returned.
        first_recent_pos: cache position of the first token of ``key`` (the device-resident recent tokens).
        n_blocks_before: sealed blocks before this update (the blocks this call selects from).
        n_recent: recent tokens that may be attended; ``None``: all of ``key`` (a decode step being captured with
            its whole decoder layer hands over the whole open block, only its first ``n_recent`` tokens filled).
    """

    layer: "OffloadLayer"
    key: torch.Tensor
    recent_values: torch.Tensor
    first_recent_pos: int
    n_blocks_before: int
    n_recent: int | None = None

    @property
    def recent_tokens(self) -> int:
        """Recent tokens that may be attended (the open block, this step's tokens included)."""
        return self.key.shape[-2] if self.n_recent is None else self.n_recent


_local = threading.local()


def leave_handoff(handoff: Handoff) -> None:
    """Record the handoff of an update; raises if the previous update of the same cache was never attended."""
    stale = getattr(_local, "pending", None)
    if stale is not None and stale.layer.cache_id == handoff.layer.cache_id:
        if stale.layer.layer_idx == handoff.layer.layer_idx - 1:
            raise RuntimeError(
                "An OffloadCache was updated but the model's attention never used it: the model running this cache "
                "does not use the offload attention. An OffloadCache serves only the model it was built with "
                f"(built for {handoff.layer.model_name}); build one OffloadCache(model) per model."
            )
    _local.pending = handoff


def take_handoff() -> Handoff | None:
    """Remove and return the pending handoff of this thread, if any."""
    handoff = getattr(_local, "pending", None)
    _local.pending = None
    return handoff


# -------------------------------------------------------------------------------------------------------------- mask
class OffloadMask:
    """The arguments of one mask construction, evaluated lazily.

    Args:
        original: the original attention implementation whose mask function builds the dense mask.
        kwargs: the keyword arguments transformers passed to the mask function (``batch_size``, ``q_length``,
            ``kv_length``, ``q_offset``, ``kv_offset``, ``mask_function``, ``attention_mask`` (2D padding mask,
            ``[batch, >= kv_length]``, ``torch.bool``), ...).
    """

    def __init__(self, original: str, kwargs: dict[str, Any]):
        self.original = original
        self.kwargs = kwargs
        self._dense: Any = None
        self._built = False
        self._block_valid: dict[tuple[int, int, int], torch.Tensor] = {}
        self._memo: dict[tuple, Any] = {}
        padding = kwargs.get("attention_mask")
        if padding is not None:
            needed = kwargs["kv_length"] + kwargs.get("kv_offset", 0)
            if padding.shape[-1] < needed:
                padding = torch.nn.functional.pad(padding, (0, needed - padding.shape[-1]))
            padding = padding.bool()
        self.padding = padding

    def materialize(self) -> Any:
        """The mask the original implementation would have received (built once)."""
        if not self._built:
            self._dense = ALL_MASK_ATTENTION_FUNCTIONS[self.original](**self.kwargs)
            self._built = True
        return self._dense

    def to(self, *args, **kwargs) -> "OffloadMask":
        """Move the padding mask (used by accelerate's device hooks)."""
        moved = dict(self.kwargs)
        if moved.get("attention_mask") is not None:
            moved["attention_mask"] = moved["attention_mask"].to(*args, **kwargs)
        return OffloadMask(self.original, moved)

    def allowed(self, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """Which (query, key) pairs may attend.

        Args:
            q_pos: absolute query positions, shape ``[q]``, ``torch.int64``, compute device.
            kv_pos: absolute key positions, shape ``[batch or 1, heads or 1, n]``, ``torch.int64``.

        Returns:
            Shape ``[batch or 1, heads or 1, q, n]``, ``torch.bool``.
        """
        batch = self.kwargs.get("batch_size", kv_pos.shape[0])
        b = torch.arange(batch, device=kv_pos.device).view(-1, 1, 1, 1)
        q = q_pos.view(1, 1, -1, 1)
        kv = kv_pos[:, :, None, :]
        mask_function = self.kwargs.get("mask_function")
        ok = torch.as_tensor(mask_function(b, 0, q, kv), device=kv.device) if mask_function else kv <= q
        if self.padding is not None:
            ok = ok & self.padding.to(kv.device)[b, kv]
        return ok

    def block_valid(self, q_pos: int, n_blocks: int, block_tokens: int, device) -> torch.Tensor:
        """Blocks with at least one token that query position ``q_pos`` may attend, ``[batch, n_blocks]`` bool."""
        key = (q_pos, n_blocks, block_tokens)
        if key not in self._block_valid:
            kv = torch.arange(n_blocks * block_tokens, device=device).view(1, 1, -1)
            ok = self.allowed(torch.full((1,), q_pos, device=device), kv)[:, 0, 0]  # no host-to-device copy
            batch = self.kwargs.get("batch_size", ok.shape[0])
            self._block_valid[key] = ok.expand(batch, -1).reshape(batch, n_blocks, block_tokens).any(-1)
        return self._block_valid[key]


    def memo(self, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per key for this mask (one forward): what every layer of the forward would
        compute alike, e.g. a decode step's forced blocks."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]


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
    layer's likely blocks are prefetched (lookahead, :meth:`~hf_offload.cache.OffloadLayer.lookahead_next`). Prefill (several queries): every earlier
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
    batch, q_heads, q_len, head_dim = query.shape
    heads = layer.kv_heads
    if scaling is None:
        scaling = head_dim**-0.5
    if softcap is None and sink_logits is None:
        out = _first_prefill(handoff, query, mask, scaling)
        if out is None:
            out = _chunk_prefill(handoff, query, mask, scaling)
        if out is not None:
            layer.finish_step()
            return out
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
    if q_len == 1 and n and softcap is None and sink_logits is None and _plain_causal(mask):
        k = layer.decode_blocks(n, handoff.recent_tokens)
        if min(k, n) <= layer.pool.slots:  # the selection fits the slot pool: one fused step
            return _decode_step(handoff, query, mask, scaling, n, k)
    timer = layer.timer if q_len == 1 else None
    if timer is not None:
        t_start = timer.mark()
    # Sealed blocks: recalled into the slot pool in rounds of at most the pool size.
    if n:
        if q_len == 1:
            selection = layer.select(grouped[:, :, :, 0], mask, scaling, handoff)
        else:
            selection = layer.select_all(n)
        if timer is not None:
            timer.add("select", t_start, t_select := timer.mark())
        if q_len == 1 and layer.lookahead:
            # Lookahead: the next offloaded layer's likely blocks start moving now, behind this layer's work.
            layer.lookahead_next(grouped[:, :, :, 0], mask, scaling)
            if timer is not None:
                timer.add("prefetch", t_select, t_select := timer.mark())
        rounds = layer.resident_rounds(selection, decode=q_len == 1)
        for blocks, keep, _, keys, values in rounds:
            tiled()
            if timer is not None:
                timer.add("recall", t_select, t_recalled := timer.mark())
            tokens = torch.arange(layer.block_tokens, device=device)
            kv_pos = (blocks[..., None] * layer.block_tokens + tokens).flatten(-2)  # [B, Hs, n*T]
            keep_tokens = keep[..., None].expand(*keep.shape, layer.block_tokens).flatten(-2)
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

    if q_len == 1 and n and selection.blocks.shape[-1] < n and layer.selector.estimates_tail:
        # The unselected blocks' attention, estimated by the selector, joins the softmax through its log-sum-exp.
        kv_pos = torch.arange(n * layer.block_tokens, device=device).view(1, 1, -1)
        tokens_ok = allowed(slice(0, 1), kv_pos)[:, 0, 0, 0].expand(batch, -1).reshape(batch, n, -1)
        tail_out, tail_lse = layer.estimate_tail(grouped[:, :, :, 0], scaling, n, selection, tokens_ok, softcap)
        layer.count_tail(tail_lse, (acc.m + torch.log(acc.l))[:, :, :, 0])
        acc.add_partial(tail_out[:, :, :, None], tail_lse[:, :, :, None])

    layer.finish_step()
    out = acc.result(sink_logits)  # [B, H, G, Q, D]
    if timer is not None:
        timer.add("attention", t_select, timer.mark())
    return out.reshape(batch, q_heads, q_len, head_dim).transpose(1, 2).to(query.dtype).contiguous()


def _chunk_prefill(
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
    if q_len == 1 or not handoff.n_blocks_before or not _plain_causal(mask):
        return None
    layer = handoff.layer
    total = handoff.first_recent_pos + handoff.key.shape[-2]
    left_padded, starts = _left_padding(mask, total)
    if not left_padded:
        return None  # not left padding: the tiled path evaluates the mask exactly
    sealed_k, sealed_v = layer.sealed_kv(handoff.n_blocks_before)
    group = q_heads // layer.kv_heads
    k = torch.cat([sealed_k, handoff.key], dim=-2).to(query.dtype)
    v = torch.cat([sealed_v, handoff.recent_values], dim=-2).to(query.dtype)
    del sealed_k, sealed_v
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def attend(q, k, v):
        bias = causal_lower_right(q.shape[-2], k.shape[-2])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scaling)

    if starts is None:
        return attend(query, k, v).transpose(1, 2).contiguous()
    return _per_sequence(query, k, v, starts, attend)


def _decode_step(
    handoff: Handoff, query: torch.Tensor, mask: OffloadMask | None, scaling: float, n: int, k: int
) -> torch.Tensor:
    """One decode query of a plain causal forward whose selection fits the slot pool: plan, recall, one SDPA.

    The step scores :meth:`~hf_offload.cache.OffloadLayer.decode_capacity` blocks: the ``n`` sealed ones rounded up
    to ``decode_capacity_blocks``, the rest masked. Where the layer replays CUDA graphs, each geometry (that capacity,
    ``k`` selected, the buffers it reads) is captured at its first step and replayed from then on. A geometry whose
    kind this layer has already run op by op (the same ``k``, query and branch of the work; see
    :meth:`~hf_offload.cache.OffloadLayer.warm_for`) is captured right away and replayed for the step itself;
    otherwise the step first runs op by op (compiling kernels and planning what a capture must not), then is
    captured. With a capacity of 64 blocks that is once per 64 seals (every ``64 * block_tokens`` steps) instead of
    once per seal (at 32K tokens and batch 8, 8B shape, ~2.4 ms per layer for an op-by-op run and ~1.9 ms for a
    capture).

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
    sealed, n = n, layer.decode_capacity(n, k)  # from here on: the blocks the step scores
    capturing = layer._layer_capture
    if capturing is not None:  # the whole decoder layer is being captured: its step's work, recorded as it is
        if (n, k) != (capturing.n, capturing.k):
            raise RuntimeError(
                f"Layer {layer.layer_idx}: the decode step being captured scores {n} blocks and selects {k}, where "
                f"its decoder layer's capture planned {capturing.n} and {capturing.k}."
            )
        return _decode_body(layer, query, capturing.inputs, n, k, scaling, None, None, False, capturing.reuse)
    inputs = layer.decode_inputs(handoff, mask, n)
    reuse = layer.reuses_selection(handoff.first_recent_pos + handoff.recent_tokens - 1, sealed, k, n)
    if reuse:
        layer.stats.add(("reused_selections",), 1)
    key = (n, k, tuple(query.shape), query.dtype, scaling, inputs.rows.data_ptr(), layer.storage_key(), reuse)
    layer._fused_key = key
    graph = layer.captured(key) if layer.graphs else None
    body = lambda q: _decode_body(layer, q, inputs, n, k, scaling, None, None, False, reuse)  # noqa: E731
    warm = layer.warm_for(n, k, query, scaling, reuse)
    if graph is None and layer.graphs and warm in layer.warm_geometries:
        start = time.perf_counter()
        graph = layer.capture_decode(key, body, query, inputs, retry_op_by_op=True)
        layer.stats.add(("graph_capture_us",), round((time.perf_counter() - start) * 1e6))
    if graph is not None:
        out = layer.replay(graph, query)
        layer.finish_step()
        return out
    start = time.perf_counter()
    out = _decode_body(layer, query, inputs, n, k, scaling, mask, layer.timer, reuse=reuse)
    layer.warm_geometries.add(warm)
    if layer.graphs:
        layer.capture_decode(key, body, query, inputs)
        layer.stats.add(("graph_capture_us",), round((time.perf_counter() - start) * 1e6))
    layer.finish_step()
    return out


def _decode_body(
    layer: "OffloadLayer",
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
    attend. No host synchronisation; reads only the layer's state, ``inputs`` and ``query``.

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
    q = query.view(batch, layer.kv_heads, q_heads // layer.kv_heads, head_dim)  # [B, H, G, D]
    if timer is not None:
        t_start = timer.mark()
    selection = layer.plan_decode(q, scaling, n, k, inputs, reuse)
    if timer is not None:
        timer.add("select", t_start, t_select := timer.mark())
    if layer.lookahead and count_step and not layer._prefetched_ahead:
        # Lookahead: the next offloaded layer's likely blocks start moving now, behind this layer's work (unless
        # they started before this layer, from the next layer's predicted query: lookahead_query="next").
        layer.lookahead_next(q, mask, scaling)
        if timer is not None:
            timer.add("prefetch", t_select, t_select := timer.mark())
    blocks, keep, slots, _, _ = next(
        layer.resident_rounds(selection, decode=True, count_step=count_step, gather=False, in_place=layer.paged)
    )
    if timer is not None:
        timer.add("recall", t_select, t_recalled := timer.mark())
    out = _decode_sdpa(layer, query, blocks, keep, slots, inputs, n, scaling, selection)
    if timer is not None:
        timer.add("attention", t_recalled, timer.mark())
    return out


def _decode_sdpa(
    layer: "OffloadLayer",
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
    pool = layer.pool
    batch, q_heads, _, head_dim = query.shape
    heads, sel_heads, k = pool.kv_heads, blocks.shape[1], blocks.shape[-1]
    tail = k < n and layer.selector.estimates_tail
    if layer.paged:
        return _decode_paged(layer, query, blocks, keep, slots, inputs, n, scaling, plan, tail)
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
        return _with_tail(layer, query, grouped, out, lse, blocks, keep, inputs, n, scaling, plan)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, k_all, v_all, attn_mask=ok, scale=scaling)
    return out.reshape(batch, 1, q_heads, head_dim)


def _with_tail(
    layer: "OffloadLayer",
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
    ``grouped`` its ``[batch, kv_heads, group, head_dim]`` view; the other arguments as :func:`_decode_sdpa`'s."""
    batch, q_heads, _, head_dim = query.shape
    selection = Selection(blocks=blocks, keep=keep, scores=None if plan is None else plan.scores,
                          block_lse=None if plan is None else plan.block_lse,
                          ranked=None if plan is None or plan.blocks is not blocks else plan.ranked)  # fmt: skip
    out, tail_lse = layer.estimate_tail_merged(grouped, scaling, n, selection, inputs.rows[:, :n], out, lse,
                                               query.dtype)  # fmt: skip
    layer.count_tail(tail_lse, lse)
    return out.reshape(batch, 1, q_heads, head_dim)


def _decode_paged(
    layer: "OffloadLayer",
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
    """:func:`_decode_sdpa` through :func:`~hf_offload.kernels.paged.paged_decode`: each selected block is read
    where it lies (an admitted chunk, or its slot), the open block from the pool's last slot; no mask is built.
    Arguments and result as :func:`_decode_sdpa`'s (``tail``: merge the selector's estimate of the unselected
    blocks)."""
    batch, q_heads, _, head_dim = query.shape
    heads = layer.kv_heads
    grouped = query.view(batch, heads, q_heads // heads, head_dim)
    addrs, on_host = layer.host.chunk_tables(layer.device)
    out, lse = paged_decode(
        grouped, scaling, blocks, keep, slots, inputs.rows, n, layer.block_table_dev, addrs, on_host,
        layer.host.chunk_blocks, layer.pool.data, out_dtype=torch.float32 if tail else query.dtype,
    )  # fmt: skip
    if tail:
        return _with_tail(layer, query, grouped, out, lse, blocks, keep, inputs, n, scaling, plan)
    return out.reshape(batch, 1, q_heads, head_dim)


def _plain_causal(mask: OffloadMask | None) -> bool:
    """Whether ``mask`` is transformers' plain causal mask (with or without a padding mask) over keys from position
    0 whose last ``q_length`` positions are the queries (a prompt, a later prefill chunk or a decode step)."""
    if mask is None:
        return True
    from transformers.masking_utils import causal_mask_function

    kwargs = mask.kwargs
    if kwargs.get("mask_function") is not causal_mask_function or kwargs.get("kv_offset", 0):
        return False
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    if q_length is None or kv_length is None:
        return False
    return int(kwargs.get("q_offset", 0)) + int(q_length) == int(kv_length)


def _first_prefill(
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
    if not _plain_causal(mask):
        return None
    left_padded, starts = _left_padding(mask, q_len)
    if not left_padded:
        return None  # not left padding: the tiled path evaluates the mask exactly
    gqa = key.shape[1] != q_heads

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)

    if starts is None:
        return attend(query, key, value).transpose(1, 2).contiguous()
    return _per_sequence(query, key, value, starts, attend)


def _left_padding(mask: OffloadMask | None, total: int) -> tuple[bool, list[int] | None]:
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


def _per_sequence(query, key, value, starts: list[int], attend) -> torch.Tensor:
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
