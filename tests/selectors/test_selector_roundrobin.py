"""RoundRobinSelector: every head's best block is in the shared selection; planted mass, full budget."""

from __future__ import annotations

import pytest
import torch

from hf_offload.selectors.base import key_bound_logits
from hf_offload.selectors.roundrobin import RoundRobinSelector
from hf_offload.selectors.solohead import SoloHeadSelector

from ._selector_checks import check_full_budget_token_identical, check_planted


def test_each_heads_first_choice_comes_first():
    """Three heads agree on blocks 1, 2, 3 (high votes); head 3 alone wants block 8. At k=2, SoloHead takes two of the
    agreed blocks, the round robin takes the agreed favourite and head 3's block."""
    n, dim = 10, 4
    kmin = torch.zeros(1, n, 1, dim)
    kmax = torch.zeros(1, n, 1, dim)
    kmax[0, 1, 0, 0], kmax[0, 2, 0, 0], kmax[0, 3, 0, 0] = 3.0, 2.9, 2.8
    kmax[0, 8, 0, 1] = 3.0
    query = torch.tensor([[[[1.0, 0, 0, 0]] * 3 + [[0, 1.0, 0, 0]]]])  # [1, 1, 4, 4]
    summaries = {"kmin": kmin, "kmax": kmax}
    solo = SoloHeadSelector().score(query, summaries, 1.0)[0, 0]
    assert set(solo.topk(2).indices.tolist()) == {1, 2}
    for unit in ("query", "kv"):
        rr = RoundRobinSelector(unit=unit).score(query, summaries, 1.0)
        assert rr.shape == (1, 1, n) and rr.dtype == torch.float32
    rr = RoundRobinSelector(unit="query").score(query, summaries, 1.0)[0, 0]
    assert set(rr.topk(2).indices.tolist()) == {1, 8}


def test_order_is_best_rank_then_votes():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 30, 2, 4, 8, generator=g)
    query = torch.randn(2, 2, 3, 8, generator=g)
    summaries = SoloHeadSelector().summarize(keys)
    score = RoundRobinSelector().score(query, summaries, 0.35)
    bounds = key_bound_logits(query, summaries["kmin"], summaries["kmax"]).flatten(1, 2)  # [B, 6, N]
    firsts = bounds.argmax(-1)  # each head's first choice
    for b in range(2):
        top = set(score[b, 0].topk(len(set(firsts[b].tolist()))).indices.tolist())
        assert top == set(firsts[b].tolist())


def test_bad_unit():
    with pytest.raises(ValueError, match="unit"):
        RoundRobinSelector(unit="block").score(torch.zeros(1, 1, 1, 2), {"kmin": torch.zeros(1, 3, 1, 2),
                                                                         "kmax": torch.zeros(1, 3, 1, 2)}, 1.0)


@pytest.mark.parametrize("unit", ["query", "kv"])
def test_planted_blocks_found(unit):
    check_planted(RoundRobinSelector(unit=unit))


def test_full_budget_token_identical():
    check_full_budget_token_identical(RoundRobinSelector())
