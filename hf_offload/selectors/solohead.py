"""SoloHead: one block selection per layer and sequence, shared by all heads (PulseInfer).

A shared selection makes one selected block one contiguous span of the host pool (all KV heads, K and V), so recall
is one large transfer per block instead of ``2 x kv_heads`` small ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selection, Selector, key_bound_logits


@dataclass
class SoloHeadSelector(Selector):
    """Aggregate per-query-head block importance into one score per block.

    Each query head turns its Quest key bounds into a distribution over blocks (a softmax with the attention's
    scale), so that every head votes with the same total weight; the votes are summed over heads.
    """

    name = "solohead"
    per_head = False

    @property
    def masks_invalid(self) -> bool:
        """The votes are softmaxes over the valid blocks only (unless a subclass scores its own way)."""
        return type(self).score is SoloHeadSelector.score

    def score(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Summed per-head softmax of Quest bounds, shape ``[batch, 1, n_blocks]``."""
        return self._votes(query, summaries, scaling, None)

    def select(self, query, summaries, scaling, k, forced, valid) -> Selection:
        """:meth:`Selector.select <hf_offload.selectors.base.Selector.select>` with each head's vote a softmax
        over the valid blocks only (blocks that may not be attended take no share of it)."""
        if not self.masks_invalid:  # a subclass with its own score()
            return super().select(query, summaries, scaling, k, forced, valid)
        return self.choose(self._votes(query, summaries, scaling, valid), k, forced, valid)

    @staticmethod
    def _votes(query, summaries, scaling: float, valid: torch.Tensor | None) -> torch.Tensor:
        """Summed per-head softmax of the bounds, ``[batch, 1, n_blocks]``, float32; ``valid`` (``[batch,
        n_blocks]``, bool, or ``None``) masks blocks out of each head's softmax."""
        bounds = key_bound_logits(query, summaries["kmin"], summaries["kmax"]) * scaling  # [B, H, G, N]
        if valid is not None:
            bounds = bounds.masked_fill(~valid[:, None, None, :], float("-inf"))
        return torch.softmax(bounds, dim=-1).sum(dim=(1, 2))[:, None, :]
