"""Round-robin union: every head gets its own best blocks into one shared selection.

A shared selection (SoloHead, after PulseInfer) ranks blocks by a sum of per-head votes, so a few heads that agree
can fill the budget with their blocks while another head's single important block is left out. Per-head selection
(Quest, Tang et al., 2024) serves every head but fragments recall into per-head pieces. This policy keeps one
selection of whole blocks and fills it as a union of per-head choices: each head ranks the blocks by its Quest key
bounds, and blocks enter in order of their best rank over heads (every head's first choice, then every head's second,
...), ties broken by SoloHead's summed vote. Heads are the query heads (``unit="query"``) or the KV heads, each the
largest bound over its group as in Quest (``unit="kv"``).

Summaries are SoloHead's (``kmin``/``kmax``); scoring adds one sort of ``n_blocks`` per head.

Not registered (the round robin lowered the selection recall of SoloHead on RULER decode queries;
``results/selection/qwen05_4k_tune_A.json``): build it directly or register it with
:func:`hf_offload.selectors.register_selector` to try it in an evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selector, key_bound_logits, mask_invalid_logits


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
