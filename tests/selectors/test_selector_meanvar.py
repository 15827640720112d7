"""MeanVarSelector: summaries, its limits (mean-key votes), sub-block means and the spread term; planted mass, full
budget."""

from __future__ import annotations

import pytest
import torch

from hf_offload.selectors import SELECTORS
from hf_offload.selectors.meanbound import MeanBoundSelector
from hf_offload.selectors.meanvar import MeanVarSelector

from ._selector_checks import check_full_budget_token_identical, check_planted


def test_registered_not_default():
    import hf_offload
    from hf_offload.config import DEFAULT_SELECTOR, OffloadConfig

    assert SELECTORS["meanvar"] is MeanVarSelector
    assert hf_offload.MeanVarSelector is MeanVarSelector and "MeanVarSelector" in hf_offload.__all__
    assert OffloadConfig(budget_tokens=512).selector == DEFAULT_SELECTOR and not DEFAULT_SELECTOR.startswith("meanvar")


def test_summaries():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 12, 3, 8, 16, generator=g)  # [batch, blocks, kv_heads, block_tokens, head_dim]
    summaries = MeanVarSelector(parts=2).summarize(keys)
    assert set(summaries) == {"kmeans", "kstd"}
    assert summaries["kmeans"].shape == (2, 12, 2, 3, 16)  # [batch, blocks, parts, kv_heads, head_dim]
    assert summaries["kstd"].shape == (2, 12, 3, 16)
    first, second = keys[:, :, :, :4], keys[:, :, :, 4:]
    assert torch.allclose(summaries["kmeans"][:, :, 0], first.mean(3))
    assert torch.allclose(summaries["kmeans"][:, :, 1], second.mean(3))
    pooled = (first.var(3, unbiased=False) + second.var(3, unbiased=False)) / 2
    assert torch.allclose(summaries["kstd"].square(), pooled, atol=1e-5)
    half = MeanVarSelector().summarize(keys.half())
    assert half["kmeans"].dtype == half["kstd"].dtype == torch.float16
    with pytest.raises(ValueError, match="divisible"):
        MeanVarSelector(parts=3).summarize(keys)
    with pytest.raises(ValueError, match="parts"):
        MeanVarSelector(parts=0)


def test_one_part_no_spread_is_mean_key_votes():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 12, 2, 4, 8, generator=g)
    query = torch.randn(2, 2, 3, 8, generator=g)
    mean_only = MeanBoundSelector(shrink=1.0)
    expected = mean_only.score(query, mean_only.summarize(keys), 0.35)
    selector = MeanVarSelector(parts=1, variance=0.0)
    assert torch.allclose(selector.score(query, selector.summarize(keys), 0.35), expected, atol=1e-5)


def test_matching_half_block_is_not_averaged_away():
    """Block 0: its first half matches the query, its second half points away (block mean logit 0); block 1: every
    key weakly matching (logit 1). One mean key prefers block 1; two sub-block means find block 0."""
    q = torch.tensor([1.0, 0.0, 0.0, 0.0])
    block0 = torch.tensor([[3.0, 0, 0, 0]] * 2 + [[-3.0, 0, 0, 0]] * 2)
    block1 = torch.tensor([[1.0, 0, 0, 0]] * 4)
    keys = torch.stack([block0, block1])[None, :, None]  # [1, 2, 1, 4, 4]
    query = q.view(1, 1, 1, 4)
    one = MeanVarSelector(parts=1, variance=0.0)
    two = MeanVarSelector(parts=2, variance=0.0)
    assert one.score(query, one.summarize(keys), 1.0)[0, 0].argmax().item() == 1
    assert two.score(query, two.summarize(keys), 1.0)[0, 0].argmax().item() == 0


def test_spread_keys_outweigh_a_slightly_higher_mean():
    """Block 0: keys alternating between logits 0 and 2 (mean 1, mean exp 4.19); block 1: every key at logit 1.2
    (mean exp 3.32). Means alone prefer block 1; the spread term prefers block 0, as the true attention does."""
    q = torch.tensor([1.0, 0.0, 0.0, 0.0])
    block0 = torch.tensor([[0.0, 0, 0, 0], [2.0, 0, 0, 0]] * 2)
    block1 = torch.tensor([[1.2, 0, 0, 0]] * 4)
    keys = torch.stack([block0, block1])[None, :, None]
    query = q.view(1, 1, 1, 4)
    assert torch.exp(block0 @ q).mean() > torch.exp(block1 @ q).mean()
    means_only = MeanVarSelector(variance=0.0)
    assert means_only.score(query, means_only.summarize(keys), 1.0)[0, 0].argmax().item() == 1
    selector = MeanVarSelector()
    assert selector.score(query, selector.summarize(keys), 1.0)[0, 0].argmax().item() == 0


@pytest.mark.parametrize("parts,variance", [(2, 0.5), (4, 1.0), (1, 0.0)])
def test_planted_blocks_found(parts, variance):
    check_planted(MeanVarSelector(parts=parts, variance=variance))


def test_full_budget_token_identical():
    check_full_budget_token_identical(MeanVarSelector())
