"""The accuracy certificate (``stats()["missed_mass"]``) and the adaptive budget (``max_budget_tokens`` with
``missed_mass_target``) end to end on tiny models."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_offload.cache.planner as planner_module
from hf_offload import OffloadCache, OffloadConfig

from ..helpers import TINY_BLOCKS, build_model, left_padded
from ..selectors.test_adaptive import _missed_with_best

ADAPTIVE = {"budget_tokens": 48, "max_budget_tokens": 112, "missed_mass_target": 0.2}
"""Six blocks of base budget (five sealed beside the open block) up to fourteen (thirteen sealed)."""
TARGET = 0.55
"""A target between the small and the large shares that the base budget leaves out on the tiny model below."""


def _generate(model, cache, ids, mask, new=12):
    return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                          do_sample=False, min_new_tokens=new)  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("selector", ["quantkey[bits=4,tail_bits=2,tail_near=3]", "solohead"])
def test_budget_covering_the_context_is_token_identical(arch, selector):
    model = build_model(arch)
    ids, mask = left_padded([90, 70], seed=3)
    dense = _generate(model, DynamicCache(config=model.config), ids, mask)
    cache = OffloadCache(model, selector=selector, **TINY_BLOCKS, budget_tokens=128, max_budget_tokens=256,
                         missed_mass_target=0.05)  # fmt: skip
    assert torch.equal(_generate(model, cache, ids, mask), dense)
    certificate = cache.stats()["missed_mass"]
    assert certificate["source"] == "exact" and certificate["mean"] == certificate["max"] == 0


@pytest.mark.parametrize("selector", ["quantkey[bits=4,tail_bits=2,tail_near=3]", "quantkey", "solohead"])
def test_adaptive_budget_widens_exactly_when_the_estimate_exceeds_the_target(monkeypatch, selector):
    """Each sparse step: the base budget's blocks alone where they leave out at most the target (by the selector's
    block masses), more blocks where they leave out more, the fewest that bring it under the target or the cap."""
    model = build_model("llama")
    ids, mask = left_padded([150, 120], seed=9)
    steps = []
    original = planner_module.keep_to_target

    def recording(selection, base, target, heads):
        out = original(selection, base, target, heads)
        steps.append((selection, base, target, heads, out))
        return out

    monkeypatch.setattr(planner_module, "keep_to_target", recording)
    # A target between the small and the large shares the base budget leaves out here, so that both kinds occur.
    cache = OffloadCache(model, selector=selector, **TINY_BLOCKS, **{**ADAPTIVE, "missed_mass_target": TARGET})
    _generate(model, cache, ids, mask)
    assert steps
    widened = narrow = 0
    for selection, base, target, heads, out in steps:
        k = selection.blocks.shape[-1]
        assert base == 48 // 8 - 1 and k <= 112 // 8 - 1 and target == TARGET
        for b in range(selection.blocks.shape[0]):
            possible, count = int(selection.keep[b].sum()), int(out.keep[b].sum())
            assert count <= possible <= k  # never more than the cap
            if _missed_with_best(selection, b, base, heads) > target and possible > base:
                widened += 1
                assert count > base
                assert count == possible or _missed_with_best(selection, b, count, heads) <= target
                assert _missed_with_best(selection, b, count - 1, heads) > target
            else:
                narrow += 1
                assert count == min(base, possible)
    assert widened and narrow  # the target splits the steps of this tiny model
    stats = cache.stats()
    assert 48 // 8 - 1 <= stats["attended_blocks"] <= 112 // 8 - 1


def test_adaptive_budget_leaves_out_less_than_its_base_budget_and_more_than_its_cap():
    model = build_model("llama")
    ids, mask = left_padded([150, 120], seed=9)
    results = {}
    for name, budget in {"base": {"budget_tokens": 48}, "adaptive": ADAPTIVE, "cap": {"budget_tokens": 112}}.items():
        cache = OffloadCache(model, selector="quantkey", **TINY_BLOCKS, **budget)
        _generate(model, cache, ids, mask)
        results[name] = cache.stats()
    mean = {name: stats["missed_mass"]["mean"] for name, stats in results.items()}
    blocks = {name: stats["attended_blocks"] for name, stats in results.items()}
    assert mean["cap"] <= mean["adaptive"] < mean["base"]
    assert blocks["base"] < blocks["adaptive"] <= blocks["cap"]


def test_certificate_per_layer_and_overall():
    model = build_model("llama")
    ids, mask = left_padded([150, 120], seed=9)
    cache = OffloadCache(model, **TINY_BLOCKS, budget_tokens=48)  # the default selector: the tail estimate
    _generate(model, cache, ids, mask)
    stats = cache.stats()
    overall, layers = stats["missed_mass"], stats["layers"]
    assert overall["source"] == "tail"
    # With the estimate of the unselected blocks the certificate is that estimate's share.
    assert overall["mean"] == pytest.approx(stats["tail_share"])
    for layer in layers.values():
        m = layer["missed_mass"]
        assert 0 < m["mean"] <= m["max"] < 1 and 0 < m["last"] <= m["max"]
        assert m["steps"] == stats["decode_steps"]
    assert overall["max"] == max(layer["missed_mass"]["max"] for layer in layers.values())
    assert overall["steps"] == sum(layer["missed_mass"]["steps"] for layer in layers.values())
    assert overall["last"] == pytest.approx(sum(lr["missed_mass"]["last"] for lr in layers.values()) / len(layers))
    cache.reset_stats()
    assert cache.stats()["missed_mass"] is None and cache.stats()["attended_blocks"] is None


@pytest.mark.parametrize("selector", ["quantkey[bits=4,tail_bits=2,tail_near=3]", "quantkey"])
def test_certificate_per_sequence_is_each_sequence_s_own(selector):
    """Per sequence of a batch: the share its own steps left out, the same as when it runs alone; the pooled
    certificate is their mean (every sequence steps as often)."""
    model = build_model("llama")
    ids, mask = left_padded([150, 150], seed=9)  # equal lengths: no padding, each row as it runs alone
    ids[1] = torch.flip(ids[1], dims=[0])  # another sequence
    settings = {"selector": selector, **TINY_BLOCKS, "budget_tokens": 48}
    cache = OffloadCache(model, **settings)
    _generate(model, cache, ids, mask)
    stats = cache.stats()
    rows = stats["missed_mass"]["per_sequence"]
    assert len(rows["mean"]) == len(rows["max"]) == 2 and rows["mean"][0] != rows["mean"][1]
    assert stats["missed_mass"]["mean"] == pytest.approx(sum(rows["mean"]) / 2)
    assert stats["missed_mass"]["max"] <= max(rows["max"])  # the largest step mean of the batch: at most its max
    for layer in stats["layers"].values():
        assert len(layer["missed_mass"]["per_sequence"]["mean"]) == 2
    for row in range(2):
        alone = OffloadCache(model, **settings)
        _generate(model, alone, ids[row : row + 1], mask[row : row + 1])
        mine = alone.stats()["missed_mass"]
        assert mine["per_sequence"]["mean"] == pytest.approx([mine["mean"]])
        assert rows["mean"][row] == pytest.approx(mine["mean"], rel=1e-3)
        assert rows["max"][row] == pytest.approx(mine["per_sequence"]["max"][0], rel=1e-3)
    cache.reset_stats()
    assert cache.stats()["missed_mass"] is None


def test_certificate_per_sequence_follows_batch_edits():
    """Beam search's reorder and a selection of sequences take each sequence's certificate with it; its mean is
    over the steps it recorded."""
    from hf_offload.cache.stats import LayerStats, _missed_mass

    stats = LayerStats()
    keep = torch.ones((2, 1, 3), dtype=torch.bool)

    def steps(shares, times):
        for _ in range(times):
            stats.record_step(keep[: len(shares)], torch.tensor(shares, dtype=torch.float64), "tail")

    steps([0.1, 0.3], 3)
    stats.take_rows(torch.tensor([1, 0]))  # reorder: sequence 0 is the old sequence 1
    steps([0.5, 0.1], 1)
    out = _missed_mass([stats.step_summary()])["per_sequence"]
    assert out["mean"] == pytest.approx([(0.9 + 0.5) / 4, (0.3 + 0.1) / 4]) and out["max"] == pytest.approx([0.5, 0.1])
    stats.take_rows(torch.tensor([0]))  # keep the first sequence only
    steps([0.5], 2)
    out = _missed_mass([stats.step_summary()])["per_sequence"]
    assert out["mean"] == pytest.approx([(0.9 + 0.5 + 1.0) / 6]) and out["max"] == pytest.approx([0.5])
    stats.take_rows(torch.tensor([0, 0]))  # repeated: both copies carry its record; new steps their own
    steps([0.2, 0.4], 1)
    out = _missed_mass([stats.step_summary()])["per_sequence"]
    assert out["mean"] == pytest.approx([(2.4 + 0.2) / 7, (2.4 + 0.4) / 7])
    stats.reset()
    assert _missed_mass([stats.step_summary()]) is None


def test_selector_without_block_masses_has_no_certificate_and_refuses_the_adaptive_budget():
    model = build_model("llama")
    ids, mask = left_padded([150, 120], seed=9)
    cache = OffloadCache(model, selector="headwise", **TINY_BLOCKS, budget_tokens=48)
    _generate(model, cache, ids, mask)
    assert cache.stats()["missed_mass"] is None and cache.stats()["attended_blocks"] > 0
    with pytest.raises(ValueError, match="selector 'headwise' does not give"):
        OffloadCache(model, selector="headwise", **TINY_BLOCKS, **ADAPTIVE)


def test_blocks_a_step_selects_stay_the_same_over_the_seals_of_one_capacity():
    """What lets one captured graph serve the steps of a capacity: the selected entries and the entries always
    kept depend on neither the sealed blocks within the capacity nor the open block's fill."""
    model = build_model("llama")
    ids, mask = left_padded([40], seed=1)
    cache = OffloadCache(model, **TINY_BLOCKS, **ADAPTIVE, decode_capacity_blocks=16)
    _generate(model, cache, ids, mask, new=2)  # the layers settle how they run at their first forward
    planner = cache.offload_layers[0].planner
    assert planner.execution.capacity_blocks == 16
    for capacity in (16, 32):
        seen = set()
        for n in range(capacity - 15, capacity + 1):
            if n <= 48 // 8 - 1:  # the base budget holds every block: exact
                assert planner.decode_blocks(n, 1) == n and not planner.leaves_out(n, n)
                continue
            for recent in range(1, 9):
                k = planner.decode_blocks(n, recent)
                seen.add((planner.decode_capacity(n, k), k, planner.keeps_at_least(k)))
        assert seen == {(capacity, min(capacity, 112 // 8 - 1), 48 // 8 - 1)}


def test_adaptive_settings_are_validated_with_what_to_change():
    with pytest.raises(ValueError, match="set missed_mass_target too"):
        OffloadConfig(max_budget_tokens=4096)
    with pytest.raises(ValueError, match="e.g. max_budget_tokens=4096"):
        OffloadConfig(missed_mass_target=0.05)
    for bad in (0, 1, 1.5, -0.1, True, "0.05"):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            OffloadConfig(missed_mass_target=bad, max_budget_tokens=4096)
    with pytest.raises(ValueError, match=r"at least budget_tokens \+ block_tokens = 2048 \+ 16 = 2064"):
        OffloadConfig(missed_mass_target=0.05, max_budget_tokens=2048)
    with pytest.raises(ValueError, match="max_budget_tokens must be a multiple of block_tokens=16, got 4100; use "
                                         "4096 or 4112"):  # fmt: skip
        OffloadConfig(missed_mass_target=0.05, max_budget_tokens=4100)
    with pytest.raises(ValueError, match="budget_tokens must be a multiple of block_tokens=16, got 2050"):
        OffloadConfig(budget_tokens=2050, missed_mass_target=0.05, max_budget_tokens=4096)
    config = OffloadConfig(missed_mass_target=0.05, max_budget_tokens=4096)
    assert config.adaptive and config.pool_tokens == 4096 * 5 // 4  # the pool holds the cap's blocks
    assert not OffloadConfig().adaptive
