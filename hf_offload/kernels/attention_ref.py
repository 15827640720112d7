"""Exact attention over KV segments with an online softmax (pure torch; the reference for fused kernels).

Keys arrive in segments (rounds of recalled blocks, the resident window, tiles of a prefill chunk); each segment
updates a running maximum, denominator and weighted sum, so the result equals one softmax over the union without
ever concatenating the segments.
"""

from __future__ import annotations

import torch


class OnlineSoftmax:
    """Running softmax-weighted sum for grouped queries.

    Args:
        query: shape ``[batch, kv_heads, group, q_len, head_dim]``, any float dtype, compute device.
        scaling: softmax scale applied to ``q . k``.
        softcap: if set, logits become ``softcap * tanh(logits / softcap)`` (Gemma 2 style) before masking.
    """

    def __init__(self, query: torch.Tensor, scaling: float, softcap: float | None = None):
        self.query = query
        self.scaling = scaling
        self.softcap = softcap
        shape = query.shape[:-1]
        self.m = torch.full(shape, float("-inf"), dtype=torch.float32, device=query.device)
        self.l = torch.zeros(shape, dtype=torch.float32, device=query.device)
        self.o = torch.zeros(query.shape, dtype=torch.float32, device=query.device)

    def add(self, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, q: slice = slice(None)) -> None:
        """Fold one KV segment into the rows ``q`` of the queries.

        Args:
            keys: shape ``[batch, kv_heads, n, head_dim]``, compute device.
            values: same shape as ``keys``.
            allowed: which (query, key) pairs may attend, broadcastable to ``[batch, kv_heads, 1, q_rows, n]``,
                ``torch.bool``.
            q: the query rows (dim 3 of ``query``) this segment is folded into.
        """
        query = self.query[:, :, :, q]
        logits = torch.einsum("bhgqd,bhnd->bhgqn", query.float(), keys.float()) * self.scaling
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        logits = logits.masked_fill(~allowed, float("-inf"))
        m_old = self.m[:, :, :, q]
        m_new = torch.maximum(m_old, logits.amax(-1))
        # Rows with nothing allowed so far keep m = -inf; shift by 0 there to avoid inf - inf.
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(logits - shift[..., None])
        rescale = torch.exp(m_old - shift)
        self.l[:, :, :, q] = self.l[:, :, :, q] * rescale + p.sum(-1)
        self.o[:, :, :, q] = self.o[:, :, :, q] * rescale[..., None] + torch.einsum(
            "bhgqn,bhnd->bhgqd", p, values.float()
        )
        self.m[:, :, :, q] = m_new

    def add_partial(self, out: torch.Tensor, lse: torch.Tensor, q: slice = slice(None)) -> None:
        """Fold in the attention over another, disjoint set of keys, given as its output and log-sum-exp.

        Args:
            out: ``[batch, kv_heads, group, q_rows, head_dim]``, float32, that set's attention output.
            lse: ``[batch, kv_heads, group, q_rows]``, float32, the log-sum-exp of its logits (``-inf``: empty).
            q: the query rows (dim 3 of ``query``) these belong to.
        """
        m_old = self.m[:, :, :, q]
        m_new = torch.maximum(m_old, lse)
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        rescale, weight = torch.exp(m_old - shift), torch.exp(lse - shift)
        self.l[:, :, :, q] = self.l[:, :, :, q] * rescale + weight
        self.o[:, :, :, q] = self.o[:, :, :, q] * rescale[..., None] + out * weight[..., None]
        self.m[:, :, :, q] = m_new

    def result(self, sink_logits: torch.Tensor | None = None) -> torch.Tensor:
        """The attention output, shape ``[batch, kv_heads, group, q_len, head_dim]``, float32.

        Args:
            sink_logits: optional learned per-query-head sink logit that joins the softmax denominator with a zero
                value (gpt-oss style), shape ``[kv_heads * group]``.
        """
        l = self.l
        if sink_logits is not None:
            heads, group = self.query.shape[1:3]
            sink = sink_logits.float().view(1, heads, group, 1)
            m = torch.maximum(self.m, sink)
            l = l * torch.exp(self.m - m) + torch.exp(sink - m)
            out = self.o * torch.exp(self.m - m)[..., None]
        else:
            out = self.o
        # Rows that attended to nothing (queries at padding positions) give 0, not NaN.
        return torch.where(l[..., None] > 0, out / l.clamp(min=1e-30)[..., None], torch.zeros_like(out))
