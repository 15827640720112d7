"""Decode replay (benchmarks/selection_replay.py) reproduces generate() with an OffloadCache, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from benchmarks.selection_replay import (
    cache_settings,
    capture_dense,
    fill_from_kv,
    make_selector,
    replay,
    replay_batch,
)
from eval_harness.runner import _generate
from hf_offload import OffloadCache, disable_offload_attention

PROMPT_TOKENS = 600
NEW_TOKENS = 24


class _Tokenizer:
    """What the runner's ``_generate`` asks of a tokenizer (no stop-at-newline samples here)."""

    pad_token_id = 0


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # random weights: decode every new token, no early stop
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, 256, (PROMPT_TOKENS,)).tolist()
    sample = {"input_ids": ids, "max_new_tokens": NEW_TOKENS}
    cap = capture_dense(model, _Tokenizer(), sample)
    return model, sample, cap


def _one_shot(model, sample, **settings):
    """The tokens of ``generate()`` with a fresh OffloadCache over the whole prompt (one-shot prefill)."""
    cache = OffloadCache(model, **settings)
    (ids,), _ = _generate(model, _Tokenizer(), [sample], cache, sample["max_new_tokens"], None)
    return ids, cache


def test_capture_is_the_dense_run(tiny):
    model, sample, cap = tiny
    disable_offload_attention(model)
    out = model.generate(torch.tensor([sample["input_ids"]]), past_key_values=DynamicCache(config=model.config),
                         max_new_tokens=NEW_TOKENS, do_sample=False)  # fmt: skip
    assert cap["dense_ids"] == out[0, PROMPT_TOKENS:].tolist()
    assert len(cap["dense_ids"]) == NEW_TOKENS and cap["first_token"] == cap["dense_ids"][0]
    assert len(cap["kv"]) == 2 and cap["kv"][0].shape == (2, 2, PROMPT_TOKENS, 32)


@pytest.mark.parametrize("selector", ["meanbound", "meanvar", "solohead", "headwise", "oracle", "union"])
def test_replay_equals_generate_with_offload_cache(tiny, selector):
    model, sample, cap = tiny
    settings = dict(budget_tokens=192, selector=make_selector(selector))
    expected, real = _one_shot(model, sample, **settings)
    got, _ = replay(model, _Tokenizer(), sample, cap, make_selector(selector), 192)
    assert got == expected
    # The fill leaves the cache as the real prefill does: the same KV (up to the prefill's float rounding) and the
    # same block summaries.
    filled = OffloadCache(model, **settings)
    fill_from_kv(filled, cap["kv"])
    for layer_idx, layer_kv in enumerate(cap["kv"]):
        keys, values = real.dense_kv(layer_idx)
        torch.testing.assert_close(keys[0, :, :PROMPT_TOKENS], layer_kv[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(values[0, :, :PROMPT_TOKENS], layer_kv[1], rtol=1e-4, atol=1e-4)
        got_layer, real_layer = filled.layers[layer_idx], real.layers[layer_idx]
        assert got_layer.n_tokens == PROMPT_TOKENS and got_layer.n_blocks == PROMPT_TOKENS // 16
        for name, summary in got_layer.blocks.summaries.items():
            torch.testing.assert_close(summary, real_layer.blocks.summaries[name][:, : got_layer.n_blocks], rtol=1e-4,
                                       atol=1e-4)  # fmt: skip


def test_sparse_budget_changes_tokens(tiny):
    """The comparison above is not vacuous: a sparse budget decodes other tokens than dense for some selector."""
    model, sample, cap = tiny
    answers = {name: replay(model, _Tokenizer(), sample, cap, name, 64)[0] for name in ("streaming", "solohead")}
    assert any(ids != cap["dense_ids"] for ids in answers.values())


@pytest.mark.parametrize("chunk", [None, 256])
def test_full_budget_replay_equals_dense(tiny, chunk):
    model, sample, cap = tiny
    got, _ = replay(model, _Tokenizer(), sample, cap, "meanbound", PROMPT_TOKENS + NEW_TOKENS + 64, fill_chunk=chunk)
    assert got == cap["dense_ids"]


@pytest.mark.parametrize("selector", ["meanvar", "headwise"])
def test_batched_replay_equals_one_at_a_time(tiny, selector):
    model, sample, cap = tiny
    torch.manual_seed(5)
    other = {"input_ids": torch.randint(1, 256, (PROMPT_TOKENS,)).tolist(), "max_new_tokens": NEW_TOKENS}
    other_cap = capture_dense(model, _Tokenizer(), other)
    batched, _ = replay_batch(model, _Tokenizer(), [sample, other], [cap, other_cap], selector, 192)
    assert batched == [replay(model, _Tokenizer(), s, c, selector, 192)[0] for s, c in ((sample, cap), (other, other_cap))]


def test_a_method_name_carries_cache_settings_after_an_at_sign(tiny):
    name = "quantkey[bits=4,tail_bits=2,tail_near=3]@max_budget_tokens=192,missed_mass_target=0.05"
    assert cache_settings(name) == {"max_budget_tokens": 192, "missed_mass_target": 0.05}
    assert cache_settings("quantkey[bits=4]") == {}
    assert make_selector(name) == make_selector("quantkey[bits=4,tail_bits=2,tail_near=3]")
    with pytest.raises(ValueError, match="field=value"):
        cache_settings("quantkey@max_budget_tokens")
    # The settings reach the cache: an adaptive budget that takes more blocks than the fixed one answers otherwise
    # or the same, and at a cap covering the context it is the dense answer.
    model, sample, cap = tiny
    wide, _ = replay(model, _Tokenizer(), sample, cap, make_selector(name), 64,
                     **cache_settings(f"x@max_budget_tokens={PROMPT_TOKENS + NEW_TOKENS + 64},missed_mass_target=0.000001"))
    assert wide == cap["dense_ids"]
    assert cache_settings("streaming@budget_tokens=512") == {"budget_tokens": 512}  # main() takes it as the budget


def test_one_sample_per_cache_records_its_certificate(tiny):
    from benchmarks.selection_replay import certificate_summary

    model, sample, cap = tiny
    stats: dict = {}
    ids, _ = replay(model, _Tokenizer(), sample, cap, make_selector("quantkey[bits=4,tail_bits=2,tail_near=3]"), 64,
                    stats_out=stats)  # fmt: skip
    assert stats["missed_mass"]["mean"] > 0 and stats["missed_mass"]["steps"] > 0
    rows = [{"scores": {"dense": 100.0, "m": 100.0 - 50 * i}, "missed_mass": {"m": {"mean": 0.1 * i}}}
            for i in range(3)]  # fmt: skip
    summary = certificate_summary(rows, ["dense", "m"])
    assert set(summary) == {"m"} and summary["m"]["samples"] == 3 and summary["m"]["spearman"] == pytest.approx(1.0)
    assert certificate_summary([{"scores": {"dense": 1.0, "m": 0.0}}], ["dense", "m"]) == {}  # batched: none


def test_table_pools_files_and_prints_paired_differences(tmp_path, capsys):
    import json

    from benchmarks.selection_replay import main

    def payload(scores):
        rows = [{"task": "fwe", "sample_id": f"0-{i}", "scores": {"dense": d, "a": a, "b": b},
                 "ids": {"dense": [1], "a": [1], "b": [2]}} for i, (d, a, b) in enumerate(scores)]  # fmt: skip
        return {"samples": rows, "setting": {"length": 8, "seed": 1, "budget": "1/16", "budget_min_tokens": 1},
                "means": {"fwe": {n: 0.0 for n in ("dense", "a", "b")}}, "average": {n: 0.0 for n in ("dense", "a", "b")}}

    paths = []
    for i, scores in enumerate([[(100, 0, 100)] * 4, [(100, 0, 100)] * 4]):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(payload(scores)))
    main(["--table", *map(str, paths)])
    out = capsys.readouterr().out
    assert "pooled over 2 file(s)" in out
    assert "a minus dense: -100.0 [-100.0, -100.0] 0/8" in out and "b minus a: +100.0 [+100.0, +100.0] 8/0" in out
