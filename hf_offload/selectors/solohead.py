"""SoloHead: one block selection per layer and sequence, shared by all heads (PulseInfer).

A shared selection makes one selected block one contiguous span of the host pool (all KV heads, K and V), so recall
is one large transfer per block instead of ``2 x kv_heads`` small ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selector, key_bound_logits, mask_invalid_logits


@dataclass
class SoloHeadSelector(Selector):
    """Aggregate per-query-head block importance into one score per block.

    Each query head turns its Quest key bounds into a distribution over blocks (a softmax with the attention's
    scale), so that every head votes with the same total weight; the votes are summed over heads.
    """

    name = "solohead"
    per_head = False
    mass_scores = True

    def score(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Summed per-head softmax of Quest bounds, shape ``[batch, 1, n_blocks]``, float32."""
        return self.masked_score(query, summaries, scaling, None)

    def masked_score(self, query, summaries, scaling, valid) -> torch.Tensor:
        """:meth:`score` with each head's vote a softmax over the valid blocks only (``valid``: ``[batch,
        n_blocks]``, bool, or ``None``)."""
        bounds = key_bound_logits(query, summaries["kmin"], summaries["kmax"]) * scaling  # [B, H, G, N]
        return torch.softmax(mask_invalid_logits(bounds, valid), dim=-1).sum(dim=(1, 2))[:, None, :]
