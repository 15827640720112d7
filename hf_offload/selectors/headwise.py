"""Headwise (Quest-style) selection: each KV head picks its own blocks by per-block key bounds (Tang et al., 2024).

Accurate per head, but recall fragments into ``2 x kv_heads`` pieces per block (SoloHead shares one selection
instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selector, key_bound_logits


@dataclass
class HeadwiseSelector(Selector):
    """Per KV head: the largest Quest bound over the query heads of its group."""

    name = "headwise"
    per_head = True
    masks_invalid = True  # each block's bound stands alone

    def score(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Quest upper bounds, shape ``[batch, kv_heads, n_blocks]``."""
        return key_bound_logits(query, summaries["kmin"], summaries["kmax"]).amax(dim=2)
