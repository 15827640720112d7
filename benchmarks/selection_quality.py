"""Selection quality: how much of the true attention mass of one decode query a selector's blocks capture.

This module measures selectors offline, from a query and the keys it attends to, without a cache, a host pool or a
model. :func:`plan_blocks` reproduces what :meth:`hf_offload.cache.OffloadLayer.select` selects among for one
decode step (selectable sealed blocks, ``k``, forced sink and window blocks, the open block), :func:`block_mass`
computes the true attention of the query over every cached key, and :func:`selection_recall` compares a
:class:`~hf_offload.selectors.base.Selection` with it. :func:`evaluate_selector` does all three for one selector.

Definitions, for one sequence and one layer at one decode step (``H`` KV heads, ``G`` query heads per KV head):

* **mass** ``m[h, n]``: the true softmax attention (over *all* cached keys: sealed blocks, open block and the
  decode token itself) of the ``G`` query heads of KV head ``h`` that falls on sealed block ``n``, summed over those
  query heads and divided by ``H * G``; summed over heads, blocks and the recent tokens it is 1.
* **free blocks**: the blocks the selector really chooses among, valid (not padding-only) and not forced (sink,
  window). The selection takes ``k_free = k - |forced|`` of them.
* **captured**: ``sum_h sum_n m[h, n]`` over free blocks selected for head ``h`` (a shared selection counts for
  every head).
* **recall**: captured / the largest mass any shared selection of ``k_free`` free blocks can capture (the oracle's
  choice, by ``sum_h m[h, n]``). The oracle scores 1.0 by construction; a per-head selector (headwise) can exceed
  1.0, since it is not bound to one selection for all heads.
* **coverage**: captured / the mass of all free blocks (absolute, at most 1, grows with the budget).
* **attended**: captured + the mass of the forced blocks and of the recent tokens: the share of the query's whole
  attention that the decode step attends to (1.0 is exact attention).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_offload.selectors import Selection, Selector


@dataclass
class BlockPlan:
    """What one decode step of :class:`~hf_offload.cache.OffloadLayer` selects among.

    Attributes:
        n_blocks: selectable sealed blocks (sealed before the decode token's update).
        recent: device-resident tokens attended besides the selection: the open block plus the decode token.
        k: blocks to select, ``min(n_blocks, (budget_tokens - recent) // block_tokens)``.
        forced: sink and window blocks, ``[batch, n_blocks]``, ``torch.bool``.
        valid: blocks with a token the query may attend to, ``[batch, n_blocks]``, ``torch.bool``.
    """

    n_blocks: int
    recent: int
    k: int
    forced: torch.Tensor
    valid: torch.Tensor

    @property
    def full(self) -> bool:
        """Whether the budget covers every sealed block (the cache then attends to all of them, no selection)."""
        return self.k >= self.n_blocks


def plan_blocks(
    n_tokens: int,
    *,
    batch: int,
    budget_tokens: int,
    block_tokens: int,
    sink_blocks: int,
    window_blocks: int,
    valid: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> BlockPlan:
    """The blocks a decode step selects among, as ``OffloadLayer._plan`` computes them.

    Args:
        n_tokens: cached tokens including the decode token (its position is ``n_tokens - 1``).
        batch: sequences.
        budget_tokens: ``OffloadConfig.budget_tokens``.
        block_tokens: ``OffloadConfig.block_tokens``.
        sink_blocks: ``OffloadConfig.sink_blocks``.
        window_blocks: ``OffloadConfig.window_blocks``.
        valid: blocks holding a real token, ``[batch, n_blocks]`` bool; ``None``: no padding.
        device: device of the masks.

    Returns:
        The :class:`BlockPlan`.
    """
    n = (n_tokens - 1) // block_tokens
    recent = n_tokens - n * block_tokens
    k = max(0, min(n, (budget_tokens - recent) // block_tokens))
    if valid is None:
        valid = torch.ones((batch, n), dtype=torch.bool, device=device)
    idx = torch.arange(n, device=valid.device)
    start = valid.int().argmax(dim=-1, keepdim=True)
    forced = (idx >= start) & (idx < start + sink_blocks)
    forced |= idx >= n - window_blocks
    return BlockPlan(n_blocks=n, recent=recent, k=k, forced=forced & valid, valid=valid)


def block_keys(keys: torch.Tensor, n_blocks: int, block_tokens: int) -> torch.Tensor:
    """Sealed blocks of a key sequence in the layout ``Selector.summarize`` receives.

    Args:
        keys: ``[batch, kv_heads, n_tokens, head_dim]`` (after RoPE), any dtype and device.

    Returns:
        ``[batch, n_blocks, kv_heads, block_tokens, head_dim]``, a copy in the dtype and device of ``keys``.
    """
    batch, heads, _, dim = keys.shape
    span = keys[:, :, : n_blocks * block_tokens]
    return span.reshape(batch, heads, n_blocks, block_tokens, dim).transpose(1, 2).contiguous()


def block_mass(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, n_blocks: int, block_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """True attention mass of one decode query per KV head on each sealed block, and on the recent tokens.

    Args:
        query: ``[batch, kv_heads, group, head_dim]``, any float dtype.
        keys: every cached key the query attends to, decode token included, ``[batch, kv_heads, n_tokens,
            head_dim]``, same device as ``query``.
        scaling: softmax scale.
        n_blocks: sealed blocks (the first ``n_blocks * block_tokens`` keys); the rest are the recent tokens.
        block_tokens: tokens per block.

    Returns:
        ``(mass, recent)``: ``[batch, kv_heads, n_blocks]`` and ``[batch, kv_heads]``, float32, summed over the
        query heads of each KV head and divided by the number of query heads, so that everything sums to 1 per
        sequence.
    """
    batch, heads, group, _ = query.shape
    logits = torch.einsum("bhgd,bhtd->bhgt", query.float(), keys.float()) * scaling
    weights = torch.softmax(logits, dim=-1).sum(dim=2) / (heads * group)  # [B, H, L]
    span = n_blocks * block_tokens
    mass = weights[..., :span].reshape(batch, heads, n_blocks, block_tokens).sum(-1)
    return mass, weights[..., span:].sum(-1)


def chosen_mask(selection: Selection, n_blocks: int) -> torch.Tensor:
    """``[batch, heads_or_1, n_blocks]`` bool: which blocks a selection attends to."""
    counts = torch.zeros((*selection.blocks.shape[:2], n_blocks), dtype=torch.int32, device=selection.blocks.device)
    # Entries not kept may point at any block: they add 0.
    return counts.scatter_add_(-1, selection.blocks, selection.keep.int()) > 0


def selection_recall(
    selection: Selection, mass: torch.Tensor, recent_mass: torch.Tensor, plan: BlockPlan
) -> dict[str, torch.Tensor]:
    """Compare a selection with the true attention mass (see the module docstring for the definitions).

    Args:
        selection: the selector's choice for this step, blocks ``[batch, 1 or kv_heads, k]``.
        mass: :func:`block_mass`'s per-block mass, ``[batch, kv_heads, n_blocks]`` float32.
        recent_mass: :func:`block_mass`'s recent-token mass, ``[batch, kv_heads]``.
        plan: the step's :class:`BlockPlan`.

    Returns:
        ``recall``, ``coverage``, ``attended``, ``captured``, ``best``, ``free_mass``: float32 tensors ``[batch]``.
        ``recall`` is 1.0 where the free blocks hold no mass or the budget covers them all.
    """
    free = plan.valid & ~plan.forced  # [B, N]
    chosen = chosen_mask(selection, plan.n_blocks) & free[:, None, :]
    captured = (mass * chosen).sum(dim=(1, 2))
    shared = mass.sum(dim=1)  # [B, N]
    free_mass = (shared * free).sum(-1)
    k_free = (plan.k - plan.forced.sum(-1, keepdim=True)).clamp(min=0)  # [B, 1]
    ranked = shared.masked_fill(~free, 0.0).sort(dim=-1, descending=True).values
    rank = torch.arange(plan.n_blocks, device=mass.device)
    best = (ranked * (rank < k_free)).sum(-1)
    tiny = torch.finfo(torch.float32).tiny
    recall = torch.where(best > tiny, captured / best.clamp(min=tiny), torch.ones_like(best))
    coverage = torch.where(free_mass > tiny, captured / free_mass.clamp(min=tiny), torch.ones_like(best))
    attended = captured + (shared * plan.forced).sum(-1) + recent_mass.sum(-1)
    return {
        "recall": recall,
        "coverage": coverage,
        "attended": attended,
        "captured": captured,
        "best": best,
        "free_mass": free_mass,
    }


def evaluate_selector(
    selector: Selector,
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float,
    *,
    budget_tokens: int,
    block_tokens: int,
    sink_blocks: int,
    window_blocks: int,
    summaries: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Selection quality of one selector for one decode query (no padding).

    Args:
        selector: the policy; its ``summarize`` gets the sealed blocks' keys (in ``keys``'s dtype).
        query: ``[batch, kv_heads, group, head_dim]``, the decode token's query (after RoPE).
        keys: ``[batch, kv_heads, n_tokens, head_dim]``, every cached key, the decode token's last (after RoPE).
        scaling: softmax scale.
        budget_tokens: tokens attended per sequence and layer (sink, window and open block included).
        block_tokens: tokens per block.
        sink_blocks: forced first blocks.
        window_blocks: forced last sealed blocks.
        summaries: precomputed ``selector.summarize`` output for the sealed blocks (reuse across queries).

    Returns:
        :func:`selection_recall`'s metrics (``[batch]`` each) plus ``k`` and ``n_blocks`` (ints as tensors).
    """
    batch = query.shape[0]
    plan = plan_blocks(
        keys.shape[2], batch=batch, budget_tokens=budget_tokens, block_tokens=block_tokens,
        sink_blocks=sink_blocks, window_blocks=window_blocks, device=query.device,
    )
    mass, recent = block_mass(query, keys, scaling, plan.n_blocks, block_tokens)
    if plan.full:
        blocks = torch.arange(plan.n_blocks, device=query.device).expand(batch, 1, plan.n_blocks)
        selection = Selection(blocks=blocks, keep=plan.valid[:, None, :])
    else:
        if summaries is None:
            summaries = selector.summarize(block_keys(keys, plan.n_blocks, block_tokens))
        summaries = {name: s[:, : plan.n_blocks] for name, s in summaries.items()}
        selection = selector.select(query, summaries, scaling, plan.k, plan.forced, plan.valid)
    out = selection_recall(selection, mass, recent, plan)
    out["k"] = torch.tensor(plan.k)
    out["n_blocks"] = torch.tensor(plan.n_blocks)
    return out
