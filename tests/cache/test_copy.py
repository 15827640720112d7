"""copy.deepcopy of a filled OffloadCache: an independent cache on the same model; pickling is refused with the ways
to keep a cache (save / load, fork, deepcopy)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache

from ..helpers import TINY_PREFILL as SMALL
from ..helpers import build_model, left_padded


def _continue(model, cache, ids, mask, suffix):
    full = torch.cat([ids, suffix], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(suffix)], dim=1)
    with torch.no_grad():
        return model.generate(input_ids=full, attention_mask=full_mask, past_key_values=cache, max_new_tokens=8,
                              do_sample=False)  # fmt: skip


def test_a_prefilled_prompt_continued_two_ways(arch):
    model = build_model(arch)
    ids, mask = left_padded([37, 22], seed=0)
    prompt, reference = OffloadCache(model, budget_tokens=4096, **SMALL), DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=prompt)
        model(input_ids=ids, attention_mask=mask, past_key_values=reference)
    kv_before = [prompt.dense_kv(layer.layer_idx) for layer in prompt.offload_layers]
    copies = [copy.deepcopy(prompt), copy.deepcopy(prompt)]
    for seed, cache in zip((1, 2), copies):
        suffix, _ = left_padded([5, 5], seed=seed)
        expected = _continue(model, copy.deepcopy(reference), ids, mask, suffix)
        assert torch.equal(_continue(model, cache, ids, mask, suffix), expected)
    # The prompt's cache did not move, and still continues like the reference.
    for layer, (keys, values) in zip(prompt.offload_layers, kv_before):
        now = prompt.dense_kv(layer.layer_idx)
        assert torch.equal(now[0], keys) and torch.equal(now[1], values)
    suffix, _ = left_padded([5, 5], seed=3)
    assert torch.equal(_continue(model, prompt, ids, mask, suffix), _continue(model, reference, ids, mask, suffix))


def test_a_copy_shares_the_model_not_its_parts():
    model = build_model("llama")
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    ids, mask = left_padded([20])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    clone = copy.deepcopy(cache)
    assert clone.model_config is cache.model_config and clone.patches is cache.patches
    for mine, theirs in zip(cache.offload_layers, clone.offload_layers):
        assert theirs.blocks.host is not mine.blocks.host
        assert theirs.blocks.pool.data.data_ptr() != mine.blocks.pool.data.data_ptr()
        assert theirs.blocks.host.used_blocks == mine.blocks.host.used_blocks == mine.n_blocks
    assert clone.host_budget.reserved_bytes == cache.host_budget.reserved_bytes


def test_an_empty_cache_copies():
    model = build_model("llama")
    clone = copy.deepcopy(OffloadCache(model, budget_tokens=4096, **SMALL))
    ids, mask = left_padded([12])
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                                  max_new_tokens=4, do_sample=False)  # fmt: skip
        got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=clone, max_new_tokens=4,
                             do_sample=False)  # fmt: skip
    assert torch.equal(got, expected)


def test_pickling_is_refused_with_the_ways_to_keep_a_prompt():
    cache = OffloadCache(build_model("llama"), budget_tokens=4096, **SMALL)
    with pytest.raises(TypeError, match=r"cannot be pickled.*cache\.save\(path\).*OffloadCache\.load\(path, model\)"
                                        r".*copy\.deepcopy"):  # fmt: skip
        pickle.dumps(cache)
