"""A switched model behaves exactly as before whenever the cache is not an OffloadCache."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache, disable_offload_attention

from ..helpers import build_model, left_padded


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_switched_model_with_dynamic_cache_or_no_cache_is_unchanged(arch, implementation):
    model = build_model(arch, attn_implementation=implementation)
    plain = copy.deepcopy(model)
    OffloadCache(model, budget_tokens=256)
    assert model.config._attn_implementation == f"hf_offload_{implementation}"
    ids, mask = left_padded([30, 17], seed=7)
    with torch.no_grad():
        for make_kwargs in (lambda: {"past_key_values": DynamicCache(config=model.config)}, lambda: {"use_cache": False}):
            got = model(input_ids=ids, attention_mask=mask, **make_kwargs()).logits
            expected = plain(input_ids=ids, attention_mask=mask, **make_kwargs()).logits
            assert torch.equal(got, expected)
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        expected = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, expected)


def test_switch_is_idempotent_and_reversible():
    model = build_model("qwen2")
    first = OffloadCache(model)
    second = OffloadCache(model)
    assert first.original_attn_implementation == second.original_attn_implementation == "sdpa"
    disable_offload_attention(model)
    assert model.config._attn_implementation == "sdpa"
