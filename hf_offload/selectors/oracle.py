"""Oracle: exact top-k blocks by true attention mass, computed from every key (an evaluation ceiling).

It keeps a full copy of the keys on the compute device as its "summary", so it saves no device memory; use it to
measure how much attention mass other selectors capture, not to serve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selector, mask_invalid_logits


@dataclass
class OracleSelector(Selector):
    """Attention mass per block, summed over query heads (shared selection, like SoloHead)."""

    name = "oracle"
    per_head = False
    mass_scores = True

    def summarize(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """All keys of the block, shape ``[batch, n_new, kv_heads, block_tokens, head_dim]``."""
        return {"keys": keys}

    def score(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Exact attention mass per block, shape ``[batch, 1, n_blocks]``.

        Padding tokens of padding-only blocks are excluded by the base class; partial padding inside a block adds
        a little mass to that block, which only affects the ranking among blocks.
        """
        return self.masked_score(query, summaries, scaling, None)

    def masked_score(self, query, summaries, scaling, valid) -> torch.Tensor:
        """:meth:`score` with the softmax over the tokens of valid blocks only (``valid``: ``[batch, n_blocks]``,
        bool, or ``None``)."""
        keys = summaries["keys"].float()  # [B, N, H, T, D]
        logits = torch.einsum("bhgd,bnhtd->bhgnt", query.float(), keys) * scaling
        batch, heads, group, n_blocks, block = logits.shape
        flat = mask_invalid_logits(logits.reshape(batch, heads, group, -1), valid)
        mass = torch.softmax(flat, dim=-1).view_as(logits)
        return mass.sum(dim=(1, 2, 4))[:, None, :]
