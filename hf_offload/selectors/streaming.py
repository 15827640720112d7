"""Streaming: attention sinks plus the recent window only (StreamingLLM, Xiao et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selection, Selector


@dataclass
class StreamingSelector(Selector):
    """Attends only to the forced sink and window blocks; needs no summaries and no scoring."""

    name = "streaming"
    per_head = False
    masks_invalid = True  # the forced blocks alone: no score depends on other blocks

    def summarize(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """No summaries are needed."""
        return {}

    def select(self, query, summaries, scaling, k, forced, valid) -> Selection:
        """Sink and window blocks only (see :meth:`Selector.select` for the arguments)."""
        scores = torch.zeros(forced.shape, device=forced.device).masked_fill(~(forced & valid), float("-inf"))
        top = scores[:, None, :].topk(k, dim=-1)
        return Selection(blocks=top.indices, keep=top.values > float("-inf"), scores=scores[:, None, :])
