"""The next layer's decode query, predicted from this layer's input: what layer-ahead lookahead plans with.

Layer-ahead lookahead plans the next offloaded layer's blocks before that layer runs, so that their recall can
start behind this layer's compute. It needs a query for the next layer. The query of this layer itself is a poor
stand-in: the next layer projects with other weights, so the two queries are unrelated vectors. InfiniGen
(Lee et al., OSDI 2024) observed that the inputs of consecutive decoder layers are close (the residual stream
changes little per layer), so applying the *next* layer's own input norm, query projection and rotary embedding
to *this* layer's input predicts the next layer's query far better (``benchmarks/lookahead_accuracy.py`` measures
how much of what it prefetches is attended).

:func:`speculative_query` computes that prediction for decoder layers of the common form (``input_layernorm``,
``self_attn.q_proj``, an optional per-head ``self_attn.q_norm``, rotary embeddings over the whole head): the Llama,
Mistral, Qwen2 and Qwen3 families. For any other layer it returns ``None`` and lookahead plans with this layer's
query as before.
"""

from __future__ import annotations

import torch

from ..patches.projections import ProjectionForward


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def speculative_query(decoder_layer: torch.nn.Module, hidden: torch.Tensor, position_embeddings) -> torch.Tensor | None:
    """The query ``decoder_layer`` would compute if its input were ``hidden``: its input norm, query projection,
    query norm (where it has one) and rotary embedding, as transformers' Llama-family attention computes them.

    Args:
        decoder_layer: the next decoder layer (its ``input_layernorm`` and ``self_attn`` are read, nothing is
            changed).
        hidden: this layer's input hidden states, ``[batch, q_len, hidden_size]``, the model dtype, compute device.
        position_embeddings: the ``(cos, sin)`` pair transformers passes to the decoder layers, each ``[batch,
            q_len, head_dim]``; the next layer must use the same (same layer type).

    Returns:
        ``[batch, q_heads, q_len, head_dim]``, the model dtype, or ``None`` where the layer is not of that form
        (no ``q_proj``, a fused projection, partial rotary embeddings, no position embeddings).
    """
    norm = getattr(decoder_layer, "input_layernorm", None)
    attn = getattr(decoder_layer, "self_attn", None)
    q_proj = getattr(attn, "q_proj", None)
    head_dim = getattr(attn, "head_dim", None)
    if norm is None or not isinstance(q_proj, torch.nn.Linear) or not isinstance(head_dim, int):
        return None
    if not (isinstance(position_embeddings, (tuple, list)) and len(position_embeddings) == 2):
        return None
    cos, sin = position_embeddings
    if not isinstance(cos, torch.Tensor) or cos.shape[-1] != head_dim or hidden.dim() != 3:
        return None
    if q_proj.out_features % head_dim:
        return None
    batch, q_len, _ = hidden.shape
    x = norm(hidden)
    if isinstance(q_proj.__dict__.get("forward"), ProjectionForward):  # only the query's rows of its fused product
        q = torch.nn.functional.linear(x, q_proj.weight, q_proj.bias)
    else:
        q = q_proj(x)
    q = q.view(batch, q_len, -1, head_dim)
    q_norm = getattr(attn, "q_norm", None)
    if q_norm is not None:
        q = q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (_rotate_half(q) * sin)
