"""benchmarks/selection_reuse.py: recall of a selection reused over later decode steps, on a synthetic capture."""

import torch

from benchmarks.selection_reuse import reuse_recall
from hf_offload.config import OffloadConfig
from hf_offload.selectors import get_selector


def _capture(steps=6, heads=2, group=2, dim=16, prompt=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_tokens = prompt + steps - 1
    return {
        "queries": torch.randn(steps, 2, heads, group, dim, generator=g) * 2,
        "keys": torch.randn(2, heads, n_tokens, dim, generator=g),
        "positions": torch.arange(prompt - 1, prompt - 1 + steps),
        "scaling": dim**-0.5,
    }


def test_oracle_every_step_is_near_exact_and_reuse_loses():
    config = OffloadConfig(budget_tokens=96, block_tokens=16, sink_tokens=16, window_tokens=16)
    cap = _capture()
    out = reuse_recall(cap, get_selector("oracle"), config, [1, 2, 5])
    assert len(out[1]) == 2 * 5  # layers x decode steps
    # The oracle ranks blocks by its per-head mass over the sealed keys alone, the recall's reference by the mass
    # over all keys: the two agree on all but near-tied blocks.
    assert sum(out[1]) / len(out[1]) > 0.99 and min(out[1]) > 0.95
    # Reused choices are the made ones at the step that made them and lose mass later (random queries: they do).
    assert sum(out[5]) < sum(out[1]) - 1e-3
    assert out[5][0] == out[1][0] and out[5][5] == out[1][5]  # first decode step of each layer
