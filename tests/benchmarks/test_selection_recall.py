"""The selection-quality metric (benchmarks.selection_quality): definitions, a hand-computed case, the oracle's
ceiling, monotonicity in the budget, and agreement of its plan with OffloadLayer.select."""

from __future__ import annotations

import math

import pytest
import torch

from hf_offload import OffloadCache
from hf_offload.attention import take_handoff
from hf_offload.selectors import SELECTORS, get_selector
from hf_offload.selectors.base import Selection
from benchmarks.selection_quality import (
    block_keys,
    block_mass,
    evaluate_selector,
    plan_blocks,
    selection_recall,
)

from ..helpers import build_model

B, HQ, H, D, T = 2, 4, 2, 16, 8
PLANTED = {0: [5, 11, 17], 1: [3, 14, 20]}


def _planted(seed: int = 0):
    """Keys ``[B, H, 24 * T + 5, D]`` whose planted blocks hold >= 99% of the decode query's mass; query
    ``[B, H, group, D]``."""
    g = torch.Generator().manual_seed(seed)
    n_tokens = 24 * T + 5
    keys = torch.randn(B, H, n_tokens, D, generator=g) * 0.3
    group = HQ // H
    base = torch.randn(B, H, 1, D, generator=g)
    query = base + 0.3 * torch.randn(B, H, group, D, generator=g)
    for b, blocks in PLANTED.items():
        for block in blocks:
            for h in range(H):
                direction = query[b, h].mean(0)
                keys[b, h, block * T : (block + 1) * T] = direction / direction.norm() * 12.0
    return query, keys


def _evaluate(selector, query, keys, budget_tokens, sink_blocks=1, window_blocks=1):
    return evaluate_selector(
        get_selector(selector), query, keys, D**-0.5, budget_tokens=budget_tokens, block_tokens=T,
        sink_blocks=sink_blocks, window_blocks=window_blocks,
    )


def test_hand_computed_case():
    """One head, two-dimensional keys, blocks of 2 tokens: every number by hand."""
    # Tokens 0-7 are four sealed blocks, token 8 is the decode token (recent = 1 token).
    query = torch.tensor([[[[1.0, 0.0]]]])  # [1, 1, 1, 2]
    logits = [0.0, 0.0, math.log(4), math.log(4), math.log(2), 0.0, 0.0, 0.0, 0.0]
    keys = torch.tensor([[l, 0.0] for l in logits])[None, None]  # q . k = logit (scaling 1)
    weights = torch.tensor([math.exp(l) for l in logits])
    weights = weights / weights.sum()  # Z = 1+1+4+4+2+1+1+1+1 = 16
    plan = plan_blocks(9, batch=1, budget_tokens=5, block_tokens=2, sink_blocks=1, window_blocks=1)
    assert (plan.n_blocks, plan.recent, plan.k) == (4, 1, 2)  # (5 - 1) // 2 blocks
    assert plan.forced.tolist() == [[True, False, False, True]]
    mass, recent = block_mass(query, keys, 1.0, plan.n_blocks, 2)
    assert torch.allclose(mass[0, 0], torch.tensor([2, 8, 3, 2]) / 16.0)
    assert torch.allclose(recent, torch.tensor([[1 / 16]]))
    # k_free = 2 - 2 forced = 0 ... so widen the budget: k = 3, one free block out of {1, 2}.
    plan = plan_blocks(9, batch=1, budget_tokens=7, block_tokens=2, sink_blocks=1, window_blocks=1)
    assert plan.k == 3
    for block, captured in ((1, 8 / 16), (2, 3 / 16)):
        selection = Selection(blocks=torch.tensor([[[0, 3, block]]]), keep=torch.ones(1, 1, 3, dtype=torch.bool))
        out = selection_recall(selection, mass, recent, plan)
        assert out["captured"].item() == pytest.approx(captured)
        assert out["best"].item() == pytest.approx(8 / 16)
        assert out["recall"].item() == pytest.approx(captured / (8 / 16))
        assert out["coverage"].item() == pytest.approx(captured / (11 / 16))
        assert out["attended"].item() == pytest.approx(captured + 4 / 16 + 1 / 16)
    # An entry that is not kept counts for nothing, wherever it points.
    selection = Selection(blocks=torch.tensor([[[0, 3, 1]]]), keep=torch.tensor([[[True, True, False]]]))
    assert selection_recall(selection, mass, recent, plan)["captured"].item() == 0.0


def test_per_head_selection_counts_each_heads_own_mass():
    """A per-head selection captures, per KV head, that head's mass on its own blocks."""
    mass = torch.tensor([[[0.1, 0.3, 0.0], [0.0, 0.1, 0.4]]])  # [1, 2 heads, 3 blocks]
    recent = torch.tensor([[0.05, 0.05]])
    plan = plan_blocks(3 * 4 + 1, batch=1, budget_tokens=5, block_tokens=4, sink_blocks=0, window_blocks=0)
    assert plan.k == 1
    selection = Selection(blocks=torch.tensor([[[1], [2]]]), keep=torch.ones(1, 2, 1, dtype=torch.bool))
    out = selection_recall(selection, mass, recent, plan)
    assert out["captured"].item() == pytest.approx(0.7)
    assert out["best"].item() == pytest.approx(0.4)  # the best shared block: 1 or 2, 0.4 each
    assert out["recall"].item() == pytest.approx(0.7 / 0.4)  # per-head selections may exceed the shared oracle


@pytest.mark.parametrize("budget_blocks", [6, 8, 12, 20])
def test_oracle_recall_is_one_when_the_planted_blocks_fit(budget_blocks):
    query, keys = _planted()
    out = _evaluate("oracle", query, keys, budget_blocks * T)
    assert torch.allclose(out["recall"], torch.ones(B), atol=1e-4)
    assert (out["coverage"] >= 0.99).all()  # the planted blocks hold >= 99% of the free mass


@pytest.mark.parametrize("selector", sorted(set(SELECTORS) - {"streaming"}))
def test_captured_mass_is_monotone_in_the_budget(selector):
    query, keys = _planted(seed=3)
    keys = keys + 0.5 * torch.randn(keys.shape, generator=torch.Generator().manual_seed(4))  # less peaked mass
    last = None
    for budget_blocks in range(3, 26):
        out = _evaluate(selector, query, keys, budget_blocks * T)
        assert (out["recall"] <= 1 + 1e-5).all() or get_selector(selector).per_head
        if last is not None:
            assert (out["coverage"] >= last["coverage"] - 1e-6).all(), (selector, budget_blocks)
            assert (out["attended"] >= last["attended"] - 1e-6).all(), (selector, budget_blocks)
        last = out
    assert torch.allclose(last["attended"], torch.ones(B), atol=1e-5)  # the budget covers every block: exact


def test_plan_and_selection_match_offload_layer():
    """plan_blocks + selector.select on the blocked keys pick what OffloadLayer.select picks."""
    query, keys = _planted(seed=5)
    values = torch.randn_like(keys)
    model = build_model("llama")
    for selector in ("solohead", "headwise", "oracle"):
        for budget in (6 * T, 9 * T + 3):
            cache = OffloadCache(model, budget_tokens=budget, block_tokens=T, sink_tokens=T, window_tokens=2 * T,
                                 selector=selector)
            layer = cache.layers[0]
            layer.update(keys[:, :, :-1], values[:, :, :-1])
            take_handoff()
            layer.update(keys[:, :, -1:], values[:, :, -1:])
            expected = layer.planner.select(query, None, D**-0.5, take_handoff())
            plan = plan_blocks(keys.shape[2], batch=B, budget_tokens=budget, block_tokens=T, sink_blocks=1,
                               window_blocks=2)
            sel = get_selector(selector)
            got = sel.select(query, sel.summarize(block_keys(keys, plan.n_blocks, T)), D**-0.5, plan.k, plan.forced,
                             plan.valid)
            assert torch.equal(got.blocks, expected.blocks), (selector, budget)
            assert torch.equal(got.keep, expected.keep), (selector, budget)


@pytest.mark.parametrize("bits", [2, 4])
def test_benchmark_candidates_for_the_tensor_core_rounding_select_the_planted_blocks(bits):
    """benchmarks/selection_recall.py's quantkey-bf16 (bfloat16 summaries) and quantkey-mma (scored as the tensor-core
    kernel rounds, emulated) capture the planted blocks as plain quantkey does (head_dim 16 here: the emulation takes
    any head_dim, the kernel 64, 128 or 256)."""
    from benchmarks.selection_recall import BF16QuantKeySelector, MmaQuantKeySelector
    from hf_offload.selectors.quantkey import QuantKeySelector

    query, keys = _planted(seed=6)
    outs = []
    for cls in (QuantKeySelector, BF16QuantKeySelector, MmaQuantKeySelector):
        outs.append(evaluate_selector(cls(bits=bits), query, keys, D**-0.5, budget_tokens=6 * T, block_tokens=T,
                                      sink_blocks=1, window_blocks=1))  # fmt: skip
    for out in outs:
        assert torch.allclose(out["recall"], torch.ones(B), atol=1e-4)
    assert torch.allclose(outs[1]["coverage"], outs[2]["coverage"], atol=1e-3)
    with pytest.raises(ValueError, match="2- or 4-bit codes"):
        MmaQuantKeySelector(bits=1).block_lse(query, {"codes": None, "kmin": None, "kstep": None}, 1.0)


def test_fp8_grid_covers_each_range_with_8_bit_float_parameters():
    """The quantkey-fp8 candidate's grid: minimum and step are exact e4m3 values, the minimum at or below each
    range's, the top of the grid at or above its maximum, so every key is within half a step of its code."""
    from benchmarks.selection_recall import Fp8QuantKeySelector, fp8_covering
    from hf_offload.kernels.quant import dequantize_keys

    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([1e-3, 0.05, 1.0, 30.0])[torch.randint(0, 4, (2, 6, 2, 32), generator=g)]
    kmin = torch.randn(2, 6, 2, 32, generator=g) * scale
    kmax = kmin + torch.rand(2, 6, 2, 32, generator=g) * scale
    kmin[0, 0, 0, :4] = kmax[0, 0, 0, :4] = 0.0  # a channel of zeros
    for levels in (3, 15):
        kmin8, step8 = fp8_covering(kmin, kmax, levels)
        for t in (kmin8, step8):
            assert torch.equal(t.to(torch.float8_e4m3fn).float(), t)
        assert bool((kmin8 <= kmin).all()) and bool((kmin8 + levels * step8 >= kmax).all()) and bool((step8 >= 0).all())
    keys = torch.randn(2, 5, 2, 16, 32, generator=g) * torch.tensor([0.1, 1.0, 20.0]).repeat(11)[:32]
    for bits in (2, 4):
        q = Fp8QuantKeySelector(bits=bits).summarize(keys)
        back = dequantize_keys(q["codes"], q["kmin"], q["kstep"], bits)
        exact = keys.to(torch.bfloat16).float()
        assert bool(((back - exact).abs() <= q["kstep"][:, :, :, None] / 2 + 1e-6).all())
