"""Decode steps that reuse the previous step's selection (``OffloadConfig.reselect_every``), on the CPU: which steps
choose, what the others attend, the same tokens op by op and through (stand-in) layer graphs, and the settings'
errors. ``tests/cache/test_layer_graphs.py`` runs the same comparison with real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from hf_offload import OffloadCache, OffloadConfig
from hf_offload.cache import DecodePlanner, Recaller
from hf_offload.config import DEFAULT_SELECTOR

from ..helpers import TINY_SPARSE as SMALL
from ..helpers import build_model, left_padded
from .test_layer_graphs_cpu import seal_capture_fails, stand_in_graphs  # noqa: F401  (fixtures)


def _generate(model, steps, seed=3, **options):
    ids, mask = left_padded([70, 53, 31], seed=seed)
    cache = OffloadCache(model, **{**SMALL, **options})
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)  # fmt: skip
    return out, cache


@pytest.fixture
def attended(monkeypatch):
    """Per offloaded layer index, the ``(position, blocks sealed before the step, blocks, keep, chosen)`` of every
    decode step that reached ``resident_rounds`` (``chosen``: the selector ran in that step; op by op, the step's
    update has appended its token, and sealed the block it filled, by then)."""
    log: dict[int, list] = {}
    chosen: dict[int, bool] = {}
    plan, rounds = DecodePlanner.plan_decode, Recaller.resident_rounds

    def spy_plan(self, query, scaling, n, k, inputs, reuse=False):
        chosen[self.blocks.layer_idx] = not reuse
        return plan(self, query, scaling, n, k, inputs, reuse)

    def spy_rounds(self, selection, decode, *args, **kwargs):
        store = self.blocks
        if decode and store.layer_idx in chosen:
            log.setdefault(store.layer_idx, []).append((
                store.n_tokens - 1, (store.n_tokens - 1) // store.block_tokens, selection.blocks.clone(),
                selection.keep.clone(),
                chosen.pop(store.layer_idx),
            ))  # fmt: skip
        return rounds(self, selection, decode, *args, **kwargs)

    monkeypatch.setattr(DecodePlanner, "plan_decode", spy_plan)
    monkeypatch.setattr(Recaller, "resident_rounds", spy_rounds)
    return log


@pytest.mark.parametrize("every, selector", [(2, "quantkey"), (3, "quantkey"), (2, "headwise")])
def test_steps_between_choices_attend_the_last_choice(every, selector, attended):
    model = build_model("llama")
    steps = 40  # five seals of 8-token blocks; 4 of 5-9 sealed blocks selected (sink, window and 2 chosen)
    _, cache = _generate(model, steps, selector=selector, reselect_every=every, cuda_graphs=False)
    reused = 0
    for idx, log in attended.items():
        assert len(log) == steps - 1  # every decode step after the prefill's token
        since = None  # steps since the last choice at the same sealed block count
        for j, (_, n_blocks, blocks, keep, chosen) in enumerate(log):
            prev = log[j - 1] if j else None
            same_n = prev is not None and prev[1] == n_blocks
            if prev is not None and not same_n:
                assert chosen, "a step after a seal chooses anew"
            expect_reuse = same_n and since is not None and since + 1 < every
            assert chosen == (not expect_reuse), (idx, j, since)
            if not chosen:
                assert torch.equal(blocks, prev[2]) and torch.equal(keep, prev[3])
                reused += 1
                since += 1
            else:
                since = 0
    assert reused > 0
    stats = cache.stats()
    assert stats["reused_selections"] == reused
    assert sum(layer["reused_selections"] for layer in stats["layers"].values()) == reused


def test_reused_steps_are_counted_and_choices_match_reselect_every_one(attended):
    """Each step that chooses chooses what a cache choosing every step would (same summaries, same query) until the
    tokens part: the first choice of every layer is the same."""
    model = build_model("llama")
    _generate(model, 6, selector="quantkey", reselect_every=1, cuda_graphs=False)
    fresh = {idx: [entry for entry in log] for idx, log in attended.items()}
    attended.clear()
    _generate(model, 6, selector="quantkey", reselect_every=4, cuda_graphs=False)
    for idx, log in attended.items():
        assert torch.equal(log[0][2], fresh[idx][0][2])
        assert all(entry[4] for entry in fresh[idx])  # reselect_every=1: every step chose


def test_a_query_independent_selection_gives_the_same_tokens():
    """``streaming`` attends the sink and window whatever the query: reusing its selection changes nothing."""
    model = build_model("llama")
    expected, _ = _generate(model, 40, selector="streaming", cuda_graphs=False)
    got, cache = _generate(model, 40, selector="streaming", reselect_every=3, cuda_graphs=False)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.scores, expected.scores):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert cache.stats()["reused_selections"] > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_layer_graphs_with_reuse_give_the_tokens_of_op_by_op(arch, stand_in_graphs):  # noqa: F811
    model = build_model(arch)
    options = dict(selector="quantkey", reselect_every=2, decode_capacity_blocks=64)
    expected, eager = _generate(model, 40, cuda_graphs=False, **options)
    got, graphed = _generate(model, 40, cuda_graphs=None, **options)
    assert torch.equal(got.sequences, expected.sequences)
    a, b = eager.stats(), graphed.stats()
    for name in ("reused_selections", "decode_steps", "hit_rate", "recalled_blocks", "decode_recalled_blocks"):
        assert a[name] == b[name], name
    assert b["reused_selections"] > 0
    for layer in graphed.offload_layers:
        # The choosing and the reusing step alternate: both layer graphs are kept and replayed.
        layer_keys = [key for key in layer.graphs.graphs if key[1:2] == ("layer",)]
        assert sorted(key[2][-1] for key in layer_keys) == [False, True]
        assert int(layer.stats.layer_graph_replays) >= 20


def test_set_options_switches_reuse_on_a_filled_cache():
    model = build_model("llama")
    ids, mask = left_padded([70, 53, 31], seed=3)
    cache = OffloadCache(model, **SMALL, selector="quantkey", cuda_graphs=False)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=10,
                             min_new_tokens=10, do_sample=False)  # fmt: skip
        assert cache.stats()["reused_selections"] == 0
        cache.set_options(reselect_every=2)
        more = torch.cat([out, torch.full((3, 1), 5)], 1)
        model.generate(input_ids=more, attention_mask=torch.cat([mask, torch.ones(3, 11, dtype=mask.dtype)], 1),
                       past_key_values=cache, max_new_tokens=10, min_new_tokens=10, do_sample=False)  # fmt: skip
    assert cache.config.reselect_every == 2
    assert cache.stats()["reused_selections"] > 0


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_reselect_every_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="reselect_every must be a positive integer"):
        OffloadConfig(reselect_every=value)


def test_reuse_with_an_estimate_of_the_unselected_blocks_is_refused():
    model = build_model("llama")
    with pytest.raises(ValueError, match="tail_bits"):
        OffloadCache(model, **SMALL, selector=DEFAULT_SELECTOR, reselect_every=2)
    cache = OffloadCache(model, **SMALL, selector=DEFAULT_SELECTOR)
    with pytest.raises(ValueError, match="reselect_every=1"):
        cache.set_options(reselect_every=3)
    assert cache.config.reselect_every == 1  # nothing changed
