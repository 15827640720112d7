"""Sub-block means and key spread: SoloHead's per-head votes from an estimate of each block's attention mass.

A block's attention mass for one query head is ``sum_t exp(s * q . k_t)`` over its keys. Quest's key bound (Tang et
al., 2024) over-estimates its logarithm by an amount set by the spread of the keys, and a single mean key (a
centroid, like ShadowKV's chunk landmarks, Sun et al., 2024) under-estimates it: the mean of the exponentials is
larger than the exponential of the mean. This policy keeps two things per block and KV head instead:

* the mean key of each of ``parts`` consecutive sub-blocks (a few representative keys per block, as InfLLM, Xiao et
  al., 2024, keeps; here plain sub-block means), so that a block with one matching stretch of keys is not averaged
  away;
* the per-dimension standard deviation of the keys around their sub-block mean (pooled over the sub-blocks), for
  the mass the means miss. If the keys of a sub-block were Gaussian with mean ``m`` and diagonal variance ``v``,
  the mean of ``exp(s * q . k)`` would be ``exp(s * q . m + s^2 / 2 * (q^2) . v)`` (the Gaussian moment-generating
  function); the policy adds ``variance`` times that second term.

A block's log-mass estimate, per query head, is the log-sum-exp over its sub-blocks of ``s * q . m_p`` plus
``variance * s^2 / 2 * (q^2) . v``; each head votes with a softmax of these over the blocks and the votes are summed
over heads, as in SoloHead (PulseInfer), so one selection is shared by all KV heads. The defaults (``parts=2``,
``variance=0.5``) were tuned on held-out RULER seeds.

Summaries: ``kmeans`` (``[batch, n_blocks, parts, kv_heads, head_dim]``) and ``kstd`` (``[batch, n_blocks,
kv_heads, head_dim]``), ``parts + 1`` key-sized vectors per KV head: with ``parts=2`` as many bytes as
``meanbound`` (1.5x SoloHead's). The spread is kept as a standard deviation, not a variance, so that it stays in the
keys' range in float16. Scoring: two matrix products (one over all ``n_blocks * parts`` sub-block means) and a
softmax over ``n_blocks * parts`` logits per query head, about meanbound's cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selector, mask_invalid_logits


@dataclass
class MeanVarSelector(Selector):
    """Per-head votes over a log-mass estimate from sub-block mean keys and the keys' spread around them.

    Attributes:
        parts: sub-blocks with a mean key each; must divide ``block_tokens``. ``1``: one mean key per block.
        variance: weight of the spread term, ``0`` (sub-block means only) to ``1`` (the full Gaussian correction).
    """

    name = "meanvar"
    per_head = False
    mass_scores = True
    parts: int = 2
    variance: float = 0.5

    def __post_init__(self):
        if not (isinstance(self.parts, int) and self.parts >= 1):
            raise ValueError(f"MeanVarSelector.parts must be an int >= 1, got {self.parts!r}.")

    def summarize(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """``kmeans`` ``[batch, n_new, parts, kv_heads, head_dim]`` and ``kstd`` ``[batch, n_new, kv_heads,
        head_dim]``, both in the cache dtype.

        Args:
            keys: ``[batch, n_new, kv_heads, block_tokens, head_dim]``, the cache dtype (after RoPE).
        """
        batch, n_new, heads, block_tokens, dim = keys.shape
        if block_tokens % self.parts:
            raise ValueError(
                f"MeanVarSelector(parts={self.parts}) needs block_tokens divisible by parts, got block_tokens="
                f"{block_tokens}; pick parts among the divisors of block_tokens."
            )
        sub = keys.float().reshape(batch, n_new, heads, self.parts, block_tokens // self.parts, dim)
        means = sub.mean(dim=4)  # [B, n, H, P, D]
        spread = (sub - means[:, :, :, :, None]).square().mean(dim=(3, 4))  # [B, n, H, D]
        # Parts before heads: the scoring then sees [B, n * parts, H, D], one matrix product over all sub-blocks.
        return {"kmeans": means.transpose(2, 3).contiguous().to(keys.dtype), "kstd": spread.sqrt().to(keys.dtype)}

    def _logits(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Per query head, the sub-block logits plus the spread term, ``[batch, kv_heads, group, n_blocks * parts]``."""
        q = query.float()
        batch, n_blocks, parts, heads, dim = summaries["kmeans"].shape
        means = summaries["kmeans"].float().reshape(batch, n_blocks * parts, heads, dim).permute(0, 2, 3, 1)
        logits = (q @ means) * scaling  # [B, H, G, N * P]
        if self.variance:
            spread = q.square() @ summaries["kstd"].float().square().permute(0, 2, 3, 1)  # [B, H, G, N]
            logits = logits.view(*spread.shape, parts) + ((0.5 * self.variance * scaling**2) * spread)[..., None]
            logits = logits.flatten(-2)
        return logits

    def score(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Summed per-head softmax of the estimated block log-masses, shape ``[batch, 1, n_blocks]``, float32.

        Args:
            query: ``[batch, kv_heads, group, head_dim]``, the model dtype.
            summaries: ``kmeans`` ``[batch, n_blocks, parts, kv_heads, head_dim]`` and ``kstd`` ``[batch, n_blocks,
                kv_heads, head_dim]``.
            scaling: softmax scale.
        """
        return self.masked_score(query, summaries, scaling, None)

    def masked_score(self, query, summaries, scaling, valid) -> torch.Tensor:
        """:meth:`score` with each head's softmax over the valid blocks only (``valid``: ``[batch, n_blocks]``,
        bool, or ``None``)."""
        # A softmax over blocks of log-sum-exp(sub-block logits) equals a softmax over all sub-blocks, summed within
        # each block; the latter skips the log and exp.
        return self.head_votes(query, summaries, scaling, valid).sum(dim=(1, 2))[:, None, :]

    def head_votes(
        self,
        query: torch.Tensor,
        summaries: dict[str, torch.Tensor],
        scaling: float,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each query head's vote per block (its softmax over the blocks), ``[batch, kv_heads, group, n_blocks]``,
        float32; :meth:`score` is their sum over heads. Arguments as for :meth:`masked_score`."""
        batch, n_blocks, parts = summaries["kmeans"].shape[:3]
        logits = mask_invalid_logits(self._logits(query, summaries, scaling), valid)
        votes = torch.softmax(logits, dim=-1)  # [B, H, G, N * P]
        return votes.view(*votes.shape[:3], n_blocks, parts).sum(-1)
