"""UnionSelector: each KV head's quota of its own best blocks inside one shared selection, computed on the device;
planted mass; full budget."""

from __future__ import annotations

import pytest
import torch

from hf_offload.selectors import SELECTORS
from hf_offload.selectors.meanvar import MeanVarSelector
from hf_offload.selectors.union import UnionSelector

from ._selector_checks import check_full_budget_token_identical, check_planted


def _inputs(seed=1, batch=1, n=12):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, n, 2, 16, 8, generator=g)  # [batch, blocks, kv_heads, block_tokens, head_dim]
    query = torch.randn(batch, 2, 2, 8, generator=g)  # [batch, kv_heads, group, head_dim]
    return keys, query


def test_registered_and_validated():
    assert SELECTORS["union"] is UnionSelector and not UnionSelector.per_head
    with pytest.raises(ValueError, match="share"):
        UnionSelector(share=1.5)
    with pytest.raises(ValueError, match="head_score"):
        UnionSelector(head_score="max")


@pytest.mark.parametrize("head_score", ["quest", "meanvar"])
def test_each_head_keeps_its_quota(head_score):
    sel = UnionSelector(share=1.0, head_score=head_score)
    keys, query = _inputs()
    summaries = sel.summarize(keys)
    assert ("kmin" in summaries) == (head_score == "quest")
    forced = torch.zeros(1, 12, dtype=torch.bool)
    forced[0, 0] = forced[0, -1] = True
    valid = torch.ones(1, 12, dtype=torch.bool)
    selection = sel.select(query, summaries, 0.35, 6, forced, valid)
    chosen = set(selection.blocks[0, 0].tolist())
    assert selection.blocks.shape == (1, 1, 6) and bool(selection.keep.all()) and {0, 11} <= chosen
    own = sel.head_scores(query, summaries, 0.35)[0].masked_fill(forced[0], float("-inf"))
    for head in range(2):  # quota = (6 - 2 forced) // 2 heads = 2 own blocks per head
        assert set(own[head].topk(2).indices.tolist()) <= chosen


def test_share_zero_is_meanvar_and_quota_is_per_sequence():
    keys, query = _inputs(seed=2, batch=2)
    forced = torch.zeros(2, 12, dtype=torch.bool)
    forced[:, -1] = True
    forced[1, :3] = True  # sequence 1 forces more blocks: a smaller quota, from its own count
    valid = torch.ones(2, 12, dtype=torch.bool)
    base = MeanVarSelector()
    plain = base.select(query, base.summarize(keys), 0.35, 7, forced, valid)
    zero = UnionSelector(share=0.0)
    none = zero.select(query, zero.summarize(keys), 0.35, 7, forced, valid)
    assert torch.equal(plain.blocks.sort(-1).values, none.blocks.sort(-1).values)
    sel = UnionSelector(share=1.0)
    summaries = sel.summarize(keys)
    selection = sel.select(query, summaries, 0.35, 7, forced, valid)
    own = sel.head_scores(query, summaries, 0.35).masked_fill(forced[:, None, :], float("-inf"))
    for b, quota in ((0, (7 - 1) // 2), (1, (7 - 4) // 2)):
        chosen = set(selection.blocks[b, 0].tolist())
        for head in range(2):
            assert set(own[b, head].topk(quota).indices.tolist()) <= chosen


def test_head_votes_sum_to_the_shared_score():
    keys, query = _inputs(seed=3)
    sel = MeanVarSelector()
    summaries = sel.summarize(keys)
    votes = sel.head_votes(query, summaries, 0.35)
    assert votes.shape == (1, 2, 2, 12)
    assert torch.allclose(votes.sum(dim=(1, 2))[:, None, :], sel.score(query, summaries, 0.35), atol=1e-5)


def test_planted():
    check_planted(UnionSelector())


def test_full_budget_token_identical():
    check_full_budget_token_identical(UnionSelector())
