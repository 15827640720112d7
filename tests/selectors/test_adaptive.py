"""The share a selection leaves out (``missed_share``) and the adaptive budget's keep (``keep_to_target``), on random
tensors, against direct computations."""

from __future__ import annotations

import pytest
import torch

from hf_offload.selectors import OracleSelector, QuantKeySelector, get_selector
from hf_offload.selectors.adaptive import keep_to_target
from hf_offload.selectors.base import Selection, missed_share

B, N, H, G, T, D = 3, 24, 2, 3, 8, 16


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, N, H, T, D, generator=g)
    keys[:, 5] += 1.0  # a block with more of the mass
    query = torch.randn(B, H, G, D, generator=g)
    forced = torch.zeros(B, N, dtype=torch.bool)
    forced[:, :1] = forced[:, -2:] = True
    valid = torch.ones(B, N, dtype=torch.bool)
    valid[0, 3:6] = False  # blocks that may not be attended take no mass
    return keys, query, forced, valid


@pytest.mark.parametrize("k", [3, 8, N])
def test_missed_share_of_the_oracle_is_the_exact_mass_outside_the_selection(k):
    keys, query, forced, valid = _inputs(k)
    selector = OracleSelector()
    selection = selector.select(query, selector.summarize(keys), 0.25, k, forced, valid)
    logits = torch.einsum("bhgd,bnhtd->bhgnt", query, keys) * 0.25
    logits = logits.masked_fill(~valid[:, None, None, :, None], float("-inf"))
    mass = torch.softmax(logits.flatten(-2), dim=-1).view_as(logits).sum(-1)  # [B, H, G, N]
    chosen = torch.zeros(B, N, dtype=torch.bool).scatter(1, selection.blocks[:, 0], selection.keep[:, 0])
    want = mass.masked_fill(chosen[:, None, None, :], 0).sum(-1).mean(dim=(1, 2))
    torch.testing.assert_close(missed_share(selection, H * G), want)
    if k == N:
        assert torch.all(missed_share(selection, H * G) < 1e-6)


@pytest.mark.parametrize("selector", ["quantkey[bits=4]", "solohead", "meanbound", "meanvar"])
def test_every_mass_selector_s_scores_sum_to_its_query_heads(selector):
    selector = get_selector(selector)
    keys, query, forced, valid = _inputs(1)
    nothing_forced = torch.zeros_like(forced)
    selection = selector.select(query, selector.summarize(keys), 0.25, 1, nothing_forced, valid)
    assert selector.mass_scores
    scores = selection.scores.masked_fill(~valid[:, None, :], 0)
    torch.testing.assert_close(scores.sum(-1), torch.full((B, 1), float(H * G)))


def _hand_selection():
    """Two forced blocks and four others of masses 0.4, 0.3, 0.2, 0.1 (one query head), all six selected, entries
    in block order (not by score)."""
    inf = float("inf")
    scores = torch.tensor([[[inf, 0.2, 0.4, 0.1, 0.3, inf]]])
    blocks = torch.arange(6).view(1, 1, 6)
    return Selection(blocks=blocks, keep=torch.ones(1, 1, 6, dtype=torch.bool), scores=scores)


@pytest.mark.parametrize(
    "base,target,kept",
    [
        # base 3 (both forced, 0.4): 0.6 left out > 0.25, so 0.3 joins (0.3 > 0.25), then 0.2 (0.1 <= 0.25): stop.
        (3, 0.25, [0, 1, 2, 4, 5]),
        (3, 0.65, [0, 2, 5]),  # 0.6 left out <= 0.65: the base alone
        (3, 0.05, [0, 1, 2, 3, 4, 5]),  # never below 0.05 before the cap: every entry
        (5, 0.5, [0, 1, 2, 4, 5]),  # the base's five, whatever the target
    ],
)
def test_keep_to_target_takes_the_next_best_while_too_much_is_left_out(base, target, kept):
    selection = keep_to_target(_hand_selection(), base, target, query_heads=1)
    assert selection.keep[0, 0].nonzero().flatten().tolist() == kept
    assert selection.blocks is not None and selection.scores is not None


def test_keep_to_target_never_keeps_an_entry_the_selection_did_not():
    selection = _hand_selection()
    selection.keep[0, 0, 4] = False  # the 0.3 block: e.g. padding only
    out = keep_to_target(selection, 3, 0.01, query_heads=1)
    assert out.keep[0, 0].nonzero().flatten().tolist() == [0, 1, 2, 3, 5]


@pytest.mark.parametrize("target", [0.02, 0.1, 0.3])
def test_keep_to_target_on_quantkey_is_the_smallest_keep_under_the_target(target):
    """Against a direct definition: the base entries, then the fewest next-best entries that bring the estimate to
    the target, or all of them."""
    keys, query, forced, valid = _inputs(7)
    selector = QuantKeySelector(bits=4)
    summaries = selector.summarize(keys)
    k, base = 12, 4
    selection = selector.select(query, summaries, 0.25, k, forced, valid)
    out = keep_to_target(selection, base, target, H * G)
    order = _ranking(selection)
    for b in range(B):
        ranked = order[b, 0]
        kept = out.keep[b, 0, ranked]
        count = int(kept.sum())
        assert kept[:count].all() and not kept[count:].any()  # a prefix of the ranking
        assert base <= count <= k
        assert count == k or _missed_with_best(selection, b, count, H * G) <= target
        assert count == base or _missed_with_best(selection, b, count - 1, H * G) > target


def _ranking(selection: Selection) -> torch.Tensor:
    """The entries of a selection by score, best first (sink and window first, entries not kept last)."""
    entry = selection.scores.gather(-1, selection.blocks).masked_fill(~selection.keep, float("-inf"))
    return entry.sort(dim=-1, descending=True, stable=True).indices


def _missed_with_best(selection: Selection, b: int, m: int, heads: int) -> float:
    """The share sequence ``b`` leaves out with only its ``m`` best entries kept (:func:`_ranking`)."""
    one = Selection(selection.blocks[b : b + 1], selection.keep[b : b + 1], selection.scores[b : b + 1])
    best = torch.zeros_like(one.keep).scatter(-1, _ranking(one)[:, :, :m], True) & one.keep
    return float(missed_share(Selection(one.blocks, best, one.scores), heads))
