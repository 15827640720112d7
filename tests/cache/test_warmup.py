"""``warm_up``: one short generate() with the settings and batch of the calls to come, whose decode selects; bad
arguments get a clear error; with CUDA graphs (stand-ins on the CPU) the next cache takes its parked layers."""

from __future__ import annotations

import pytest
import torch

from hf_offload import OffloadCache, warm_up

from ..helpers import TINY_BLOCKS, build_model, left_padded
from .test_layer_graphs_cpu import SMALL
from .test_parking_cpu import graphs  # noqa: F401 (the fixture: stand-in graphs that hold no cache)


def test_warm_up_runs_a_selecting_decode():
    model = build_model("llama")
    out = warm_up(model, batch_size=2, prompt_tokens=160, new_tokens=5, **TINY_BLOCKS, budget_tokens=48)
    assert out["batch_size"] == 2 and out["prompt_tokens"] == 160
    assert out["decode_steps"] > 0
    # The decode selected: fewer sealed blocks attended per step than the prompt holds.
    assert 0 < out["attended_blocks"] < 160 // TINY_BLOCKS["block_tokens"]


def test_warm_up_decodes_past_its_first_seal_by_default():
    """By default the warm-up generates a block and three tokens more, so that its decode seals a block whatever the
    prompt's alignment (and parks the graphs of the capacity after that seal); fewer where the positions end."""
    model = build_model("llama")
    block = TINY_BLOCKS["block_tokens"]
    for prompt in (160, 163):  # whole blocks, and three tokens into the open block
        out = warm_up(model, prompt_tokens=prompt, **TINY_BLOCKS, budget_tokens=48)
        assert out["new_tokens"] == block + 3 and out["decode_steps"] == block + 2
    limit = model.config.max_position_embeddings
    assert warm_up(model, prompt_tokens=limit - 5, **TINY_BLOCKS, budget_tokens=48)["new_tokens"] == 5
    assert warm_up(model, prompt_tokens=160, new_tokens=5, **TINY_BLOCKS, budget_tokens=48)["new_tokens"] == 5


def test_warm_up_default_prompt_is_twice_the_budget_and_checked_against_the_positions():
    model = build_model("llama")
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceed the model's .* positions: pass a smaller prompt_tokens"):
        warm_up(model, budget_tokens=limit)  # twice the budget: past the positions
    out = warm_up(model, **TINY_BLOCKS, budget_tokens=48, prompt_tokens=limit - 8)
    assert out["prompt_tokens"] == limit - 8
    model.config.max_position_embeddings = 2048  # room for the default prompt (RoPE is computed per position)
    assert warm_up(model, **TINY_BLOCKS, budget_tokens=48)["prompt_tokens"] == 1024  # at least 1,024
    assert warm_up(model, **TINY_BLOCKS, budget_tokens=640)["prompt_tokens"] == 1280  # twice the budget


def test_warm_up_ids_avoid_the_token_ids_the_config_names():
    from hf_offload.cache.warmup import _ordinary_ids

    model = build_model("llama")
    model.config.image_token_id = 7
    model.config.eos_token_id = [2, 9]
    ids = _ordinary_ids(model, 12, (4, 500))
    named = {7, 2, 9, model.config.bos_token_id, model.config.pad_token_id}
    assert set(ids.unique().tolist()) == set(range(12)) - named
    assert torch.equal(ids, _ordinary_ids(model, 12, (4, 500)))  # seeded


def test_warm_up_passes_generate_arguments(monkeypatch):
    model = build_model("llama")
    seen = []
    generate = model.generate

    def spy(*args, **kwargs):
        seen.append(kwargs.get("prefill_chunk_size"))
        return generate(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    out = warm_up(model, prompt_tokens=160, generate_kwargs={"prefill_chunk_size": 64}, **TINY_BLOCKS,
                  budget_tokens=48)  # fmt: skip
    assert seen == [64] and out["decode_steps"] > 0


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"batch_size": 0}, "batch_size must be a positive integer"),
    ({"batch_size": True}, "batch_size must be a positive integer"),
    ({"new_tokens": 2}, "new_tokens must be an integer of at least 3"),
    ({"prompt_tokens": 0}, "prompt_tokens must be a positive integer"),
    ({"budget_tokens": -5}, "budget_tokens"),
])  # fmt: skip
def test_warm_up_refuses_what_cannot_run(kwargs, match):
    model = build_model("llama")
    with pytest.raises(ValueError, match=match):
        warm_up(model, **{"prompt_tokens": 100, **kwargs})


def test_next_cache_of_the_same_settings_and_batch_takes_the_warm_up_s_layers(graphs):  # noqa: F811
    model = build_model("llama")
    settings = {**SMALL, "budget_tokens": 48}
    ids, mask = left_padded([150, 120, 90], seed=4)

    def generate(cache):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                                  min_new_tokens=12, do_sample=False)  # fmt: skip

    eager = OffloadCache(model, **settings, cuda_graphs=False)
    expected = generate(eager)
    assert warm_up(model, batch_size=3, prompt_tokens=160, **settings)["graph_captures"] > 0
    cache = OffloadCache(model, **settings)
    assert torch.equal(generate(cache), expected)  # the taken layers, emptied, give the tokens of a cache of its own
    stats = cache.stats()
    assert stats["parking"] == "took a parked state" and int(stats["graph_replays"]) > 0
