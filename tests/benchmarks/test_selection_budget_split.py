"""benchmarks/selection_budget_split.py: attended curves from a capture, and the greedy split of a fixed total."""

from __future__ import annotations

import torch

from benchmarks import selection_budget_split as bs
from hf_offload.config import OffloadConfig


def _capture(layers=3, heads=2, group=2, dim=16, n_tokens=700, steps=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "queries": torch.randn(steps, layers, heads, group, dim, generator=g),
        "keys": torch.randn(layers, heads, n_tokens, dim, generator=g) * 2,
        "positions": torch.tensor([n_tokens - steps + i for i in range(steps)]),
        "scaling": dim**-0.5,
    }


def test_curves_start_at_the_forced_mass_and_reach_one():
    config = OffloadConfig(budget_tokens=256, block_tokens=16)
    curves, k_free = bs.attended_curves(_capture(), config, max_extra=100)
    assert k_free > 0 and curves.shape[:2] == (2, 3)
    assert torch.all(curves[..., 1:] >= curves[..., :-1] - 1e-12)  # more blocks never attend to less
    assert torch.all(curves[..., 0] > 0) and torch.all(curves[..., 0] < 1)  # recent + sink + window only
    assert torch.allclose(curves[..., -1], torch.ones_like(curves[..., -1]), atol=1e-5)  # every block: all of it


def test_greedy_split_keeps_the_total_and_favours_steep_layers():
    flat = torch.linspace(0.5, 0.6, 11)
    steep = torch.tensor([0.1 * min(j, 8) for j in range(11)]) + 0.2
    split = bs.greedy_split(torch.stack([flat, steep]), total=10, floor=1)
    assert sum(split) == 10 and split[1] == 8 and split[0] == 2
    curves = [torch.stack([flat, steep])[None]]
    uniform = bs.evaluate(curves, lambda c: [5, 5])
    best = bs.evaluate(curves, lambda c: split)
    assert best["attended"] > uniform["attended"]
    assert uniform["per_layer"] == [round(float(flat[5]), 5), round(float(steep[5]), 5)]
