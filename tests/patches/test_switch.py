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



def _user_attention(module, query, key, value, attention_mask, **kwargs):
    """A user's own attention function: transformers' sdpa under another name."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_other_implementations_switch_and_generate_exactly():
    """A model loaded with another registered attention implementation (a user's own function with its mask function,
    as flash attention and Hub kernels register) switches: with an OffloadCache at a budget covering the context it
    generates DynamicCache's tokens, and with DynamicCache it is unchanged. (Flex attention is covered by the
    switch's rule too; on the CPU its padded masks fail to compile in torch itself.)"""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("user_sdpa", _user_attention)
    AttentionMaskInterface.register("user_sdpa", sdpa_mask)
    model = build_model("llama")
    model.set_attn_implementation("user_sdpa")
    plain = copy.deepcopy(model)
    ids, mask = left_padded([37, 22], seed=5)
    with torch.no_grad():
        expected = plain.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=plain.config),
                                  max_new_tokens=8, do_sample=False)  # fmt: skip
        cache = OffloadCache(model, budget_tokens=4096, block_tokens=8, sink_tokens=8, window_tokens=8)
        assert model.config._attn_implementation == "hf_offload_user_sdpa"
        got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8,
                             do_sample=False)  # fmt: skip
        assert torch.equal(got, expected)
        assert cache.stats()["decode_steps"] == 7
        again = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                               max_new_tokens=8, do_sample=False)  # fmt: skip
    assert torch.equal(again, expected)
    disable_offload_attention(model)
    assert model.config._attn_implementation == "user_sdpa"


def test_mask_of_an_implementation_without_a_mask_function_is_the_padding_as_given():
    """transformers gives an implementation without a mask function the 2D padding mask; so does the offload mask to
    the calls it hands over."""
    from hf_offload.attention import OffloadMask

    padding = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    mask = OffloadMask("no_mask_function_here", {"attention_mask": padding, "kv_length": 3, "batch_size": 2})
    assert mask.materialize() is padding


def test_a_first_prefill_runs_the_models_own_fast_kernel_and_later_calls_the_librarys():
    """Under an implementation other than eager / sdpa / flex (flash attention, a Hub kernel, here a user's function
    standing for one) a prompt's first forward is the model's own function with the mask it would get; later
    prefill chunks and decode steps attend through the library. Tokens are DynamicCache's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    calls = []

    def counting(module, query, key, value, attention_mask, **kwargs):
        calls.append((query.shape[-2], key.shape[-2]))
        return _user_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("user_fast", counting)
    AttentionMaskInterface.register("user_fast", sdpa_mask)
    model = build_model("llama")
    model.set_attn_implementation("user_fast")
    layers = model.config.num_hidden_layers
    ids, mask = left_padded([37, 22], seed=5)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                                  max_new_tokens=6, do_sample=False)  # fmt: skip
        calls.clear()
        cache = OffloadCache(model, budget_tokens=4096, block_tokens=8, sink_tokens=8, window_tokens=8)
        got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6,
                             do_sample=False)  # fmt: skip
        assert torch.equal(got, expected)
        assert calls == [(37, 37)] * layers  # the first prefill only, once per layer
        calls.clear()
        # A second turn on the same cache is a later prefill chunk: the library's attention (earlier blocks recalled).
        follow = torch.cat([got, torch.tensor([[3, 4, 5], [6, 7, 8]])], dim=1)
        follow_mask = torch.cat([mask, torch.ones((2, follow.shape[1] - mask.shape[1]), dtype=mask.dtype)], dim=1)
        model(input_ids=follow[:, got.shape[1] - 1 :], attention_mask=follow_mask, past_key_values=cache)
        assert calls == []
    disable_offload_attention(model)
