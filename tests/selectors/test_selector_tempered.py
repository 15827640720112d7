"""TemperedVoteSelector: SoloHead at power 1 without head weights, sharper votes otherwise; planted mass, full
budget."""

from __future__ import annotations

import pytest
import torch

from hf_offload.selectors.solohead import SoloHeadSelector
from hf_offload.selectors.tempered import TemperedVoteSelector

from ._selector_checks import check_full_budget_token_identical, check_planted


def _inputs(seed=0, batch=2, heads=2, group=3, n=20, dim=8):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, n, heads, 4, dim, generator=g)
    query = torch.randn(batch, heads, group, dim, generator=g)
    return query, SoloHeadSelector().summarize(keys)


def test_power_one_is_solohead():
    query, summaries = _inputs()
    expected = SoloHeadSelector().score(query, summaries, 0.3)
    got = TemperedVoteSelector(power=1.0, head_weight=0.0).score(query, summaries, 0.3)
    assert got.shape == (2, 1, 20) and got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=1e-6)


def test_peaked_head_outweighs_flat_heads():
    """Head 0 points at block 7 alone; heads 1-2 spread nearly evenly with a slight preference for block 3. Head
    weights and sharper votes both raise the peaked head's block against the flat heads' block."""
    n, dim = 10, 4
    kmin = torch.zeros(1, n, 1, dim)
    kmax = torch.zeros(1, n, 1, dim)
    kmax[0, 7, 0, 0] = 4.0  # only head 0's query uses dimension 0
    kmax[0, 3, 0, 1] = 0.2  # heads 1-2 use dimension 1: a small edge for block 3
    query = torch.tensor([[[[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 1.0, 0, 0]]]])  # [1, 1, 3, 4]
    summaries = {"kmin": kmin, "kmax": kmax}
    solo = SoloHeadSelector().score(query, summaries, 1.0)[0, 0]
    weighted = TemperedVoteSelector(power=1.0, head_weight=1.0).score(query, summaries, 1.0)[0, 0]
    assert weighted.argmax().item() == 7
    assert weighted[7] / weighted[3] > 2 * solo[7] / solo[3]
    sharp = TemperedVoteSelector(power=4.0).score(query, summaries, 1.0)
    assert sharp[0, 0, 7] > sharp[0, 0, 0] and sharp[0, 0, 3] > sharp[0, 0, 0]


@pytest.mark.parametrize("selector", [TemperedVoteSelector(), TemperedVoteSelector(power=3.0, head_weight=1.0)])
def test_planted_blocks_found(selector):
    check_planted(selector)


def test_full_budget_token_identical():
    check_full_budget_token_identical(TemperedVoteSelector())
