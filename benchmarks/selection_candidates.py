"""Selector candidates that lost to SoloHead in selection recall on RULER decode queries, kept here so that
``selection_recall.py`` can still measure them by name (``results/selection/qwen05_4k.json``,
``results/selection/qwen05_4k_tune_A.json``). They are not part of the library.

``tempered``: SoloHead's per-head block votes, sharpened, with peaked heads weighing more.

SoloHead (PulseInfer's shared selection) lets every query head vote with a softmax over its Quest key bounds (Tang
et al., 2024) and sums the votes. Two things blunt those votes: Quest bounds are loose (a block's bound sits above
its best key by an amount that grows with the spread of its keys), so each head's distribution over blocks is
flatter than its true attention; and a head whose bounds are flat (no block stands out) votes with the same total
weight as a head that points at one block. This policy sharpens each head's distribution (a softmax of the bounds
at ``power`` times the attention's scale) and weighs each head by how peaked its distribution is (its largest
vote, raised to ``head_weight``). ``power=1, head_weight=0`` is SoloHead.

Summaries are SoloHead's (``kmin``/``kmax``); scoring costs the same two matrix products plus one max per head.

``roundrobin``: every head gets its own best blocks into one shared selection.

A shared selection (SoloHead, after PulseInfer) ranks blocks by a sum of per-head votes, so a few heads that agree
can fill the budget with their blocks while another head's single important block is left out. Per-head selection
(Quest, Tang et al., 2024) serves every head but fragments recall into per-head pieces. This policy keeps one
selection of whole blocks and fills it as a union of per-head choices: each head ranks the blocks by its Quest key
bounds, and blocks enter in order of their best rank over heads (every head's first choice, then every head's second,
...), ties broken by SoloHead's summed vote. Heads are the query heads (``unit="query"``) or the KV heads, each the
largest bound over its group as in Quest (``unit="kv"``).

Summaries are SoloHead's (``kmin``/``kmax``); scoring adds one sort of ``n_blocks`` per head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_offload.selectors.base import Selector, key_bound_logits, mask_invalid_logits


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


@dataclass
class RoundRobinSelector(Selector):
    """Shared selection filled as a round robin over the heads' own rankings.

    Attributes:
        unit: ``"query"`` (each query head ranks) or ``"kv"`` (each KV head ranks by its group's largest bound).
    """

    name = "roundrobin"
    per_head = False
    unit: str = "query"

    def score(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """``-(best rank over heads) + tie-break in [0, 1)``, shape ``[batch, 1, n_blocks]``, float32.

        Args:
            query: ``[batch, kv_heads, group, head_dim]``.
            summaries: ``kmin``/``kmax``, ``[batch, n_blocks, kv_heads, head_dim]`` each.
            scaling: softmax scale.
        """
        return self.masked_score(query, summaries, scaling, None)

    def masked_score(self, query, summaries, scaling, valid) -> torch.Tensor:
        """:meth:`score` with the blocks that ``valid`` leaves out (``[batch, n_blocks]``, bool, or ``None``) out
        of the votes and ranked after every valid block."""
        if self.unit not in ("query", "kv"):
            raise ValueError(f"RoundRobinSelector.unit must be 'query' or 'kv', got {self.unit!r}")
        bounds = key_bound_logits(query, summaries["kmin"], summaries["kmax"]) * scaling  # [B, H, G, N]
        bounds = mask_invalid_logits(bounds, valid)
        n = bounds.shape[-1]
        votes = torch.softmax(bounds, dim=-1).sum(dim=(1, 2))  # SoloHead's score, in [0, heads]
        ranked = bounds.amax(dim=2) if self.unit == "kv" else bounds.flatten(1, 2)  # [B, heads, N]
        order = ranked.argsort(dim=-1, descending=True, stable=True)  # ties: the earlier block first
        rank = torch.empty_like(order).scatter_(
            -1, order, torch.arange(n, device=order.device).expand_as(order)
        )
        best = rank.amin(dim=1).float()  # [B, N]
        tie = votes / (votes.amax(dim=-1, keepdim=True) * 2 + 1e-30)  # in [0, 0.5]
        return (tie - best)[:, None, :]
