"""The bounded estimate of the unselected blocks (``QuantKeySelector(tail_near=R)``): only the ``R * k`` best
unselected blocks token by token, the others by the mass the scoring computed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_offload.kernels.tail import merge_attention
from hf_offload.selectors import QuantKeySelector, get_selector
from hf_offload.kernels.quant import take_blocks

B, N, H, G, T, D = 2, 40, 2, 3, 16, 64


def _setup(near, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(B, N, H, T, D, generator=g)
    keys[:, 7] += 1.5  # a few blocks with most of the mass
    values = torch.randn(B, N, H, T, D, generator=g)
    query = torch.randn(B, H, G, D, generator=g)
    selector = QuantKeySelector(bits=4, tail_bits=2, tail_near=near)
    summaries = {**selector.summarize(keys), **selector.summarize_values(values)}
    forced = torch.zeros(B, N, dtype=torch.bool)
    forced[:, :2] = forced[:, -3:] = True
    valid = torch.ones(B, N, dtype=torch.bool)
    selection = selector.select(query, summaries, 0.125, 8, forced, valid)
    chosen = torch.zeros(B, N, dtype=torch.bool).scatter(1, selection.blocks[:, 0], True)
    tokens_ok = ~chosen[:, :, None].expand(B, N, T)
    return selector, summaries, query, selection, tokens_ok, keys, values


def test_selection_carries_the_block_lse_the_scores_came_from():
    selector, summaries, query, selection, *_ = _setup(3)
    assert selection.block_lse.shape == (B, H, G, N)
    torch.testing.assert_close(selection.block_lse, selector.block_lse(query, summaries, 0.125))
    plain = QuantKeySelector(bits=4, tail_bits=2).select(query, summaries, 0.125, 8, torch.zeros(B, N, dtype=torch.bool),
                                                         torch.ones(B, N, dtype=torch.bool))  # fmt: skip
    assert plain.block_lse is None  # only the bounded estimate needs them


def test_near_covering_every_unselected_block_is_the_full_estimate():
    selector, summaries, query, selection, tokens_ok, *_ = _setup(10)  # 10 * 8 >= 40 blocks
    full = QuantKeySelector(bits=4, tail_bits=2)
    got = selector.tail_attention(query, summaries, 0.125, tokens_ok, selection=selection)
    want = full.tail_attention(query, summaries, 0.125, tokens_ok)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_bounded_estimate_is_the_near_blocks_plus_the_far_mass():
    """Checked against its definition: the estimate over the 16 best unselected blocks by score, and the lse of
    the others added from the selection's block log-sum-exps (the output stays the near blocks')."""
    selector, summaries, query, selection, tokens_ok, *_ = _setup(2)  # 2 * 8 = 16 of the 32 unselected blocks
    out, lse = selector.tail_attention(query, summaries, 0.125, tokens_ok, selection=selection)
    full = QuantKeySelector(bits=4, tail_bits=2)
    scores = selection.scores[:, 0].masked_fill(~tokens_ok.any(-1), float("-inf"))
    near = torch.zeros(B, N, dtype=torch.bool).scatter(1, scores.topk(16, dim=-1).indices, True)
    near_out, near_lse = full.tail_attention(query, summaries, 0.125, tokens_ok & near[:, :, None])
    far = tokens_ok.any(-1) & ~near
    assert int(far.sum()) == B * 16
    far_lse = selection.block_lse.masked_fill(~far[:, None, None, :], float("-inf")).logsumexp(-1)
    torch.testing.assert_close(out, near_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logaddexp(near_lse, far_lse), atol=1e-5, rtol=1e-5)


def test_bounded_estimate_lands_between_none_and_the_full_one():
    """Against exact attention over all tokens: selection alone > bounded estimate > full estimate (error)."""
    selector, summaries, query, selection, tokens_ok, keys, values = _setup(1, seed=3)
    chosen = ~tokens_ok[:, :, 0]
    q = query * 0.125
    logits = torch.einsum("bhgd,bnhtd->bhgnt", q, keys)
    dense = torch.einsum("bhgnt,bnhtd->bhgd", logits.flatten(-2).softmax(-1).view_as(logits), values)
    sel_logits = logits.masked_fill(~chosen[:, None, None, :, None], float("-inf"))
    sel_lse = sel_logits.flatten(-2).logsumexp(-1)
    sel_out = torch.einsum("bhgnt,bnhtd->bhgd", sel_logits.flatten(-2).softmax(-1).view_as(logits), values)
    errors = {}
    for name, sel in {"bounded": selector, "full": QuantKeySelector(bits=4, tail_bits=2)}.items():
        t_out, t_lse = sel.tail_attention(query, summaries, 0.125, tokens_ok, selection=selection)
        out, _ = merge_attention(sel_out, sel_lse, t_out, t_lse)
        errors[name] = float(((out - dense).norm(dim=-1) / dense.norm(dim=-1)).mean())
    errors["none"] = float(((sel_out - dense).norm(dim=-1) / dense.norm(dim=-1)).mean())
    assert errors["full"] < errors["bounded"] < errors["none"], errors


def test_tail_near_is_checked_and_parsed():
    assert get_selector("quantkey[bits=4,tail_bits=2,tail_near=3]").tail_near == 3
    assert get_selector("quantkey[tail_bits=2,tail_near=1.5]").tail_near == 1.5
    with pytest.raises(ValueError, match="set tail_bits too"):
        QuantKeySelector(tail_near=3)
    with pytest.raises(ValueError, match="tail_near must be a number >= 0"):
        QuantKeySelector(tail_bits=2, tail_near=-1)


def test_far_blocks_at_their_midpoints_are_a_softmax_part_of_their_own():
    """``tail_far="mid"``: the near blocks token by token, and each far block as one more softmax part of mass
    ``exp(block_lse)`` valued at its value range's midpoint; merged, the same as the selector's merged path."""
    selector, summaries, query, selection, tokens_ok, *_ = _setup(2)
    mid = dataclasses.replace(selector, tail_far="mid")
    out, lse = mid.tail_attention(query, summaries, 0.125, tokens_ok, selection=selection)
    near_out, near_lse = selector.tail_attention(query, summaries, 0.125, tokens_ok, selection=selection)
    scores = selection.scores[:, 0].masked_fill(~tokens_ok.any(-1), float("-inf"))
    near = torch.zeros(B, N, dtype=torch.bool).scatter(1, scores.topk(16, dim=-1).indices, True)
    far = tokens_ok.all(-1) & ~near
    blse = selection.block_lse.masked_fill(~far[:, None, None, :], float("-inf"))
    midpoints = summaries["vmin"].float() + 1.5 * summaries["vstep"].float()  # [B, N, H, D]
    far_out = torch.einsum("bhgn,bnhd->bhgd", blse.softmax(-1), midpoints)
    # Same total mass as the near-valued estimate; the output moves toward the far blocks' own values.
    torch.testing.assert_close(lse, near_lse, atol=1e-5, rtol=1e-5)
    share = torch.exp(blse.logsumexp(-1) - lse)[..., None]
    assert float(share.min()) > 0
    torch.testing.assert_close(out, (1 - share) * _near_only(selector, query, summaries, tokens_ok, near)[0]
                               + share * far_out, atol=1e-5, rtol=1e-5)  # fmt: skip
    assert not torch.allclose(out, near_out)
    # The merged path (the decode step's) gives the same as the estimate merged with a selection by hand.
    sel_out, sel_lse = torch.randn(B, H, G, D), torch.randn(B, H, G)
    want, _ = merge_attention(sel_out, sel_lse, out, lse)
    got, got_lse = mid.tail_attention_merged(query, summaries, 0.125, tokens_ok, sel_out, sel_lse, selection=selection)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_lse, lse, atol=1e-5, rtol=1e-5)


def _near_only(selector, query, summaries, tokens_ok, near):
    return QuantKeySelector(bits=4, tail_bits=2).tail_attention(query, summaries, 0.125, tokens_ok & near[:, :, None])


def test_tail_far_is_checked_and_parsed():
    assert get_selector("quantkey[bits=4,tail_bits=2,tail_near=3,tail_far=mid]").tail_far == "mid"
    assert QuantKeySelector(bits=4, tail_bits=2, tail_near=3).tail_far == "near"
    with pytest.raises(ValueError, match="'near' .* or 'mid'"):
        QuantKeySelector(bits=4, tail_bits=2, tail_near=3, tail_far="mean")
    with pytest.raises(ValueError, match="set tail_near too"):
        QuantKeySelector(bits=4, tail_bits=2, tail_far="mid")


@pytest.mark.parametrize(
    "dtype,inner", [(torch.uint8, (2, 4, 16)), (torch.bfloat16, (2, 8)), (torch.bool, (16,)), (torch.uint8, (3, 5))]
)
def test_take_blocks_equals_indexing_for_slices_of_capacity_buffers(dtype, inner):
    g = torch.Generator().manual_seed(11)
    buffer = torch.randint(0, 255, (3, 40, *inner), generator=g).to(dtype)  # bool: nonzero is True
    t = buffer[:, :33]  # the first blocks of a buffer with capacity, as the cache holds summaries
    index = torch.randint(0, 33, (3, 7), generator=g)
    taken = take_blocks(t, index)
    assert taken.dtype == t.dtype and taken.is_contiguous()
    assert torch.equal(taken, t[torch.arange(3)[:, None], index])
    assert torch.equal(take_blocks(t[:, :, :1], index), t[:, :, :1][torch.arange(3)[:, None], index])  # strided


@pytest.mark.parametrize("near", [1, 3])
def test_one_ranking_serves_the_selection_and_the_near_blocks(near):
    """With ``tail_near`` the selection comes from one top-k of ``k + near`` blocks: its first ``k`` are the plain
    top-k choice, and the near blocks taken from the rest are those a second top-k over the unselected ones picks;
    the estimate is the same either way."""
    selector, summaries, query, selection, tokens_ok, *_ = _setup(near, seed=2)
    k = selection.blocks.shape[-1]
    assert selection.ranked.shape == (B, 1, k + near * k)
    assert torch.equal(selection.ranked[..., :k], selection.blocks)
    forced = torch.zeros(B, N, dtype=torch.bool)
    forced[:, :2] = forced[:, -3:] = True
    plain = selector.choose(selector.score(query, summaries, 0.125), k, forced, torch.ones(B, N, dtype=torch.bool))
    assert torch.equal(selection.blocks.sort(-1).values, plain.blocks.sort(-1).values)
    # The same scores: where Triton runs, the selection's come from the block-scores kernel (kernels/mass.py), whose
    # sums run in another order than torch's.
    for inf in (float("inf"), float("-inf")):
        assert torch.equal(selection.scores == inf, plain.scores == inf)
    finite = torch.isfinite(plain.scores)
    torch.testing.assert_close(selection.scores[finite], plain.scores[finite], rtol=1e-5, atol=1e-7)
    index = selector.near_index(tokens_ok, selection)[1]
    unranked = dataclasses.replace(selection, ranked=None)  # the second top-k
    index_b = selector.near_index(tokens_ok, unranked)[1]
    assert torch.equal(index.sort(-1).values, index_b.sort(-1).values)
    got = selector.tail_attention(query, summaries, 0.125, tokens_ok, selection=selection)
    want = selector.tail_attention(query, summaries, 0.125, tokens_ok, selection=unranked)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_a_changed_selection_ranks_again():
    """A selection without the ranking (e.g. after the transfer cap) takes its near blocks by a second top-k, which
    never returns a selected block."""
    selector, summaries, query, selection, tokens_ok, *_ = _setup(3, seed=4)
    swapped = dataclasses.replace(selection, blocks=selection.blocks.flip(-1), ranked=None)
    chosen = torch.zeros(B, N, dtype=torch.bool).scatter(1, swapped.blocks[:, 0], True)
    near_ok, index = selector.near_index(tokens_ok & ~chosen[:, :, None], swapped)
    assert not chosen.gather(1, index)[near_ok.any(-1)].any()


def test_estimate_coverage_is_the_share_of_unselected_blocks_taken_token_by_token():
    near16 = QuantKeySelector(bits=4, tail_bits=2, tail_near=16)
    assert near16.estimate_coverage(512, 32) == 1.0  # 1/16: 512 near blocks reach the 480 unselected
    assert near16.estimate_coverage(1024, 32) == 512 / 992
    assert near16.estimate_coverage(8192, 128) == 2048 / 8064
    assert QuantKeySelector(bits=4, tail_bits=2).estimate_coverage(8192, 128) == 1.0  # every unselected block
    assert QuantKeySelector(bits=4).estimate_coverage(8192, 128) is None  # no estimate

