"""A per-step transfer cap: keep resident near-equals instead of recalling (NOSA's locality idea, training-free).

When a decode step would recall more than ``cap_blocks`` blocks for one sequence (and head), the lowest-scored missing
blocks are swapped for the best-scored resident blocks that were not selected, as long as a resident block's score is
within a relative ``margin`` of the missing block's: ``resident >= missing - margin * |missing|``. Forced (sink and
window) blocks are never swapped; the number of attended blocks does not change.
"""

from __future__ import annotations

import torch

from .base import Selection


def resident_blocks(slot_blocks: torch.Tensor, heads: int, n_blocks: int) -> torch.Tensor:
    """Which blocks are in the slot pool.

    Args:
        slot_blocks: block held per slot, shape ``[batch, kv_heads, slots]``, ``torch.int64`` (``-1``: empty).
        heads: 1 for a shared selection (head 0 speaks for all), else ``kv_heads``.
        n_blocks: blocks that can be selected.

    Returns:
        Shape ``[batch, heads, n_blocks]``, ``torch.bool``.
    """
    held = slot_blocks[:, :heads]
    # Empty slots (and blocks beyond n_blocks) go to a spare column that is dropped, so no two writes collide.
    index = torch.where((held >= 0) & (held < n_blocks), held, n_blocks)
    out = torch.zeros((*held.shape[:2], n_blocks + 1), dtype=torch.bool, device=held.device)
    return out.scatter_(-1, index, True)[..., :n_blocks]


def cap_transfers(selection: Selection, resident: torch.Tensor, cap_blocks: int, margin: float | None,
                  drop: bool = False) -> Selection:  # fmt: skip
    """Apply the transfer cap to a selection.

    Args:
        selection: a selection with ``scores``.
        resident: which blocks are resident, shape ``[batch, heads_or_1, n_blocks]``, ``torch.bool``.
        cap_blocks: most blocks to recall per sequence and head in this step.
        margin: relative score margin within which a resident block replaces a missing one; ``None``: the best
            resident blocks replace the excess whatever their scores.
        drop: missing blocks past the cap that no resident block replaces leave the selection (fewer blocks are
            attended; a hard bound); else they stay.

    Returns:
        The capped selection (same ``k``).
    """
    scores = selection.scores
    k = selection.blocks.shape[-1]
    chosen = torch.zeros_like(resident).scatter_(-1, selection.blocks, selection.keep)
    swappable = torch.isfinite(scores)
    miss = chosen & ~resident & swappable
    spare = ~chosen & resident & swappable
    excess = (miss.sum(-1, keepdim=True) - cap_blocks).clamp(min=0)
    miss_order = scores.masked_fill(~miss, float("inf")).sort(dim=-1).indices  # lowest-scored misses first
    spare_order = scores.masked_fill(~spare, float("-inf")).sort(dim=-1, descending=True).indices
    miss_score, spare_score = scores.gather(-1, miss_order), scores.gather(-1, spare_order)
    rank = torch.arange(scores.shape[-1], device=scores.device)
    over = (rank < excess) & miss.gather(-1, miss_order)  # the lowest-scored misses past the cap
    swap = over & spare.gather(-1, spare_order)
    if margin is not None:
        swap &= spare_score >= miss_score - margin * miss_score.abs()
    # Both orders are permutations, so each scatter writes every position once.
    chosen = chosen.scatter(-1, miss_order, chosen.gather(-1, miss_order) & ~(over if drop else swap))
    chosen = chosen.scatter(-1, spare_order, chosen.gather(-1, spare_order) | swap)
    top = chosen.float().topk(k, dim=-1)
    return Selection(blocks=top.indices, keep=top.values > 0, scores=scores, block_lse=selection.block_lse)
