"""Union of heads: every KV head first places a quota of its own best blocks, a shared vote fills the rest.

A shared selection (SoloHead, PulseInfer) sums the heads' votes, so a block that one head needs and the others do
not can be outvoted; per-head selection (Quest, Tang et al., 2024) keeps it but fragments recall into per-head
pieces. This policy stays one shared set of whole blocks per layer and sequence (``per_head=False``) and reserves
part of it for the heads' own choices: after the forced sink and window blocks, each KV head adds its ``quota`` best
blocks by its own score (a block two heads want counts once), and :class:`MeanVarSelector`'s shared vote fills the
rest of the budget. ``quota = floor(share * free) // kv_heads`` where ``free`` is the budget left after the forced
blocks, per sequence, computed on the device (no host synchronisation).

A head's own score (``head_score``): ``"quest"``, the largest Quest bound over the head's query heads (headwise's
score; keeps ``kmin``/``kmax`` besides meanvar's summaries: ``parts + 3`` key-sized vectors per block and KV head,
2.5x SoloHead's bytes at ``parts=2``), or ``"meanvar"``, the head's own meanvar votes summed over its query heads
(no extra bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selection, key_bound_logits
from .meanvar import MeanVarSelector


@dataclass
class UnionSelector(MeanVarSelector):
    """Each KV head's quota of its own best blocks, then meanvar's shared vote; one shared set of whole blocks.

    Attributes:
        share: share of the free blocks (budget minus forced ones) split between the KV heads' quotas, in [0, 1].
        head_score: ``"quest"`` (largest Quest bound over the head's query heads) or ``"meanvar"`` (the head's own
            meanvar votes).
    """

    name = "union"
    share: float = 0.5
    head_score: str = "quest"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"UnionSelector.share must be in [0, 1], got {self.share!r}.")
        if self.head_score not in ("quest", "meanvar"):
            raise ValueError(f"UnionSelector.head_score must be 'quest' or 'meanvar', got {self.head_score!r}.")

    def summarize(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """meanvar's ``kmeans`` and ``kstd``, plus ``kmin``/``kmax`` (``[batch, n_new, kv_heads, head_dim]``) for
        ``head_score="quest"``.

        Args:
            keys: ``[batch, n_new, kv_heads, block_tokens, head_dim]``, the cache dtype.
        """
        out = super().summarize(keys)
        if self.head_score == "quest":
            out.update(kmin=keys.amin(dim=3), kmax=keys.amax(dim=3))
        return out

    def head_scores(
        self,
        query: torch.Tensor,
        summaries: dict[str, torch.Tensor],
        scaling: float,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each KV head's own block scores, ``[batch, kv_heads, n_blocks]``, float32.

        Args:
            query: ``[batch, kv_heads, group, head_dim]``.
            summaries: this selector's summaries over ``n_blocks`` blocks.
            scaling: softmax scale.
            valid: blocks that may be attended, ``[batch, n_blocks]``, ``torch.bool``; ``None``: every block (they
                take no share of a ``meanvar`` head's softmax).
        """
        if self.head_score == "quest":
            return key_bound_logits(query, summaries["kmin"], summaries["kmax"]).amax(dim=2)
        return self.head_votes(query, summaries, scaling, valid).sum(dim=2)

    def select(
        self,
        query: torch.Tensor,
        summaries: dict[str, torch.Tensor],
        scaling: float,
        k: int,
        forced: torch.Tensor,
        valid: torch.Tensor,
    ) -> Selection:
        """Forced blocks, then each head's quota, then the shared vote; see :meth:`Selector.select` for the
        arguments (``forced`` and ``valid``: ``[batch, n_blocks]`` bool)."""
        # Blocks that may not be attended take no share of any head's vote (valid blocks' scores do not depend on
        # their summaries).
        shared = self.masked_score(query, summaries, scaling, valid).float()  # [B, 1, N]
        own = self.head_scores(query, summaries, scaling, valid).float()  # [B, H, N]
        heads, n = own.shape[1], own.shape[2]
        chosen = forced & valid  # [B, N]
        free = (k - chosen.sum(-1)).clamp(min=0)  # [B]
        quota = torch.floor(self.share * free.float()).long() // heads  # [B]
        own = own.masked_fill(~valid[:, None, :] | chosen[:, None, :], float("-inf"))
        order = own.argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(n, device=own.device).expand_as(order))
        picked = (rank < quota[:, None, None]) & (own > float("-inf"))
        return self.choose(shared, k, chosen | picked.any(dim=1), valid)
