"""Tempered votes: SoloHead's per-head block votes, sharpened, with peaked heads weighing more.

SoloHead (PulseInfer's shared selection) lets every query head vote with a softmax over its Quest key bounds (Tang
et al., 2024) and sums the votes. Two things blunt those votes: Quest bounds are loose (a block's bound sits above
its best key by an amount that grows with the spread of its keys), so each head's distribution over blocks is
flatter than its true attention; and a head whose bounds are flat (no block stands out) votes with the same total
weight as a head that points at one block. This policy sharpens each head's distribution (a softmax of the bounds
at ``power`` times the attention's scale) and weighs each head by how peaked its distribution is (its largest
vote, raised to ``head_weight``). ``power=1, head_weight=0`` is SoloHead.

Summaries are SoloHead's (``kmin``/``kmax``); scoring costs the same two matrix products plus one max per head.

Not registered (sharper votes and head weights lowered the selection recall of SoloHead on RULER decode queries;
``results/selection/qwen05_4k_tune_A.json``): build it directly or register it with
:func:`hf_offload.selectors.register_selector` to try it in an evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selector, key_bound_logits, mask_invalid_logits


@dataclass
class TemperedVoteSelector(Selector):
    """Sharpened per-query-head votes over Quest bounds, summed with weights that favour peaked heads.

    Attributes:
        power: multiplies the softmax scale of each head's vote (``> 1`` sharpens toward each head's best blocks).
        head_weight: exponent of each head's largest vote in its weight (``0``: every head weighs the same).
    """

    name = "tempered"
    per_head = False
    power: float = 2.0
    head_weight: float = 0.0

    def score(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Weighted sum of sharpened per-head votes, shape ``[batch, 1, n_blocks]``, float32.

        Args:
            query: ``[batch, kv_heads, group, head_dim]``.
            summaries: ``kmin``/``kmax``, ``[batch, n_blocks, kv_heads, head_dim]`` each.
            scaling: softmax scale.
        """
        return self.masked_score(query, summaries, scaling, None)

    def masked_score(self, query, summaries, scaling, valid) -> torch.Tensor:
        """:meth:`score` with each head's vote a softmax over the valid blocks only (``valid``: ``[batch,
        n_blocks]``, bool, or ``None``)."""
        bounds = key_bound_logits(query, summaries["kmin"], summaries["kmax"]) * (scaling * self.power)
        votes = torch.softmax(mask_invalid_logits(bounds, valid), dim=-1)  # [B, H, G, N]
        if self.head_weight:
            votes = votes * votes.amax(dim=-1, keepdim=True).pow(self.head_weight)
        return votes.sum(dim=(1, 2))[:, None, :]
