"""MeanBoundSelector: SoloHead at shrink 0, mean-key scoring at shrink 1; planted mass, full budget."""

from __future__ import annotations

import pytest
import torch

from hf_offload.selectors.meanbound import MeanBoundSelector
from hf_offload.selectors.solohead import SoloHeadSelector

from ._selector_checks import check_full_budget_token_identical, check_planted


def test_summaries_and_shrink_limits():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 12, 2, 4, 8, generator=g)
    query = torch.randn(2, 2, 3, 8, generator=g)
    summaries = MeanBoundSelector().summarize(keys)
    assert set(summaries) == {"kmin", "kmax", "kmean"}
    assert summaries["kmean"].shape == (2, 12, 2, 8)
    assert torch.allclose(summaries["kmean"], keys.mean(3))
    solo = SoloHeadSelector().score(query, summaries, 0.35)
    assert torch.allclose(MeanBoundSelector(shrink=0.0).score(query, summaries, 0.35), solo, atol=1e-6)
    mean_only = MeanBoundSelector(shrink=1.0).score(query, summaries, 0.35)
    logits = torch.einsum("bhgd,bnhd->bhgn", query, keys.mean(3)) * 0.35
    assert torch.allclose(mean_only, torch.softmax(logits, -1).sum((1, 2))[:, None], atol=1e-5)


def test_one_matching_key_against_scattered_keys():
    """Block 0: one key matching the query among weak keys; block 1: scattered keys with a larger bound but no
    matching key. The Quest bound prefers block 1; shrinking toward the mean prefers block 0."""
    dim = 4
    q = torch.tensor([1.0, 1.0, 0.0, 0.0])
    block0 = torch.tensor([[2.0, 2.0, 0, 0]] + [[0.5, 0.5, 0, 0]] * 3)  # best logit 4, bound 4, mean logit 1.75
    block1 = torch.tensor([[2.5, -2.5, 0, 0], [-2.5, 2.5, 0, 0], [0.5, 0.5, 0, 0], [0.5, 0.5, 0, 0]])  # 1, 5, 0.5
    keys = torch.stack([block0, block1])[None, :, None]  # [1, 2, 1, 4, 4]
    summaries = MeanBoundSelector().summarize(keys)
    query = q.view(1, 1, 1, dim)
    assert SoloHeadSelector().score(query, summaries, 1.0)[0, 0].argmax().item() == 1
    assert MeanBoundSelector(shrink=0.5).score(query, summaries, 1.0)[0, 0].argmax().item() == 0


@pytest.mark.parametrize("shrink", [0.25, 0.5])
def test_planted_blocks_found(shrink):
    check_planted(MeanBoundSelector(shrink=shrink))


def test_full_budget_token_identical():
    check_full_budget_token_identical(MeanBoundSelector())
