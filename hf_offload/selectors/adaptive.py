"""An adaptive budget: a step takes more blocks, up to a cap, while its selection leaves out too much attention.

The step selects up to the cap (``OffloadConfig.max_budget_tokens``), so every shape stays the same from step to step
(CUDA graphs), and then keeps, best score first, the entries of the base budget and after them each entry whose
better entries together still leave out more than ``target`` of the estimated attention over the sealed blocks
(:func:`~hf_offload.selectors.base.missed_share`: the selector's block masses, an estimate). The entries it does not
keep are neither recalled nor attended, as any entry a selection does not keep.
"""

from __future__ import annotations

import torch

from .base import Selection


def keep_to_target(selection: Selection, base_blocks: int, target: float, query_heads: int) -> Selection:
    """Keep the ``base_blocks`` best entries of a shared selection, and then the next best while the better ones
    leave out more than ``target`` of the estimated attention.

    Args:
        selection: a shared selection of up to the cap's blocks with mass ``scores`` (``Selector.mass_scores``;
            ``[batch, 1, n_blocks]``, float32, ``+inf`` for sink and window, ``-inf`` for blocks never attended) and
            ``blocks`` / ``keep`` ``[batch, 1, k]``.
        base_blocks: entries always kept (the base budget's blocks), ``<= k``.
        target: the share of the estimated attention a step may leave out, in ``(0, 1)``.
        query_heads: query heads of the layer (what each sequence's masses sum to).

    Returns:
        The selection with the same ``blocks``, ``scores``, ``block_lse`` and ``ranked``, and a narrower ``keep``.
    """
    scores, blocks, keep = selection.scores, selection.blocks, selection.keep
    entry = scores.gather(-1, blocks).masked_fill(~keep, float("-inf"))  # [B, 1, k]
    order = entry.sort(dim=-1, descending=True, stable=True).indices  # sink and window (+inf) first
    ranked = entry.gather(-1, order)
    mass = torch.where(torch.isfinite(ranked), ranked, 0.0)
    left = torch.where(torch.isfinite(scores), scores, 0.0).sum(-1, keepdim=True)  # [B, 1, 1]: every block's mass
    # What the entries ranked above each one leave out (they and the blocks never selected), as a share.
    missed_above = (left - (mass.cumsum(-1) - mass)) / query_heads
    rank = torch.arange(blocks.shape[-1], device=blocks.device)
    wanted = ((rank < base_blocks) | (missed_above > target)) & keep.gather(-1, order)
    keep = torch.zeros_like(keep).scatter_(-1, order, wanted)
    return Selection(blocks=blocks, keep=keep, scores=scores, block_lse=selection.block_lse, ranked=selection.ranked)
