"""The next layer's query predicted from a layer's input (``hf_offload.cache.lookahead``, ``lookahead_query="next"``): it
is exactly the query that layer computes when given that input; lookahead with it never changes the tokens, plans
before the layer runs, and falls back to the layer's own query where the prediction is not available."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, DynamicCache

from hf_offload import OffloadCache
from hf_offload.patches.layers import decoder_layers
from hf_offload.cache.lookahead import speculative_query
from ..helpers import build_model


def _capture(model, ids):
    """Each decoder layer's input hidden states and position embeddings, and each attention's query, of a dense
    forward over ``ids``."""
    inputs, queries = {}, {}

    def capture_attention(module, query, key, value, attention_mask, **kwargs):
        queries[module.layer_idx] = query.detach().clone()
        return AttentionInterface()["sdpa"](module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("hfo_test_query_capture", capture_attention)
    hooks = []
    for module, idx in decoder_layers(model):
        def pre(mod, args, kwargs, idx=idx):
            hidden = args[0] if args else kwargs["hidden_states"]
            inputs[idx] = (hidden.detach().clone(), kwargs.get("position_embeddings"))
        hooks.append(module.register_forward_pre_hook(pre, with_kwargs=True))
    before = model.config._attn_implementation
    model.set_attn_implementation("hfo_test_query_capture")
    try:
        with torch.no_grad():
            model(ids, past_key_values=DynamicCache(config=model.config))
    finally:
        model.set_attn_implementation(before)
        for h in hooks:
            h.remove()
    return inputs, queries


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_predicted_query_is_the_layers_own_query_of_that_input(arch):
    """Given a layer's true input, the prediction is the query its attention computed (same operations); given the
    previous layer's input, it is the prediction lookahead plans with."""
    model = build_model(arch)
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(0))
    inputs, queries = _capture(model, ids)
    modules = dict((idx, m) for m, idx in decoder_layers(model))
    for idx, module in modules.items():
        hidden, position = inputs[idx]
        with torch.no_grad():
            got = speculative_query(module, hidden, position)
        assert got is not None and got.shape == queries[idx].shape
        torch.testing.assert_close(got, queries[idx], rtol=1e-6, atol=1e-6)


def test_no_prediction_for_other_layer_forms():
    """A fused query projection (phi3's qkv_proj) or missing position embeddings give no prediction."""
    model = build_model("phi3")
    module = decoder_layers(model)[0][0]
    hidden = torch.randn(1, 1, model.config.hidden_size)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    cos = torch.ones(1, 1, head_dim)
    assert speculative_query(module, hidden, (cos, cos)) is None
    llama = decoder_layers(build_model("llama"))[0][0]
    assert speculative_query(llama, torch.randn(1, 1, 64), None) is None


def _deep_llama(layers=6):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=1024)  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("query", ["next", "same"])
def test_lookahead_never_changes_the_tokens(query, monkeypatch):
    """Tokens with lookahead (either query) are those without; with "next" every offloaded layer but the last
    plans its successor before it runs (the speculative plans' count), with "same" after its own plan."""
    from hf_offload.cache import Recaller

    model = _deep_llama()
    ids = torch.randint(3, 90, (2, 300), generator=torch.Generator().manual_seed(1))
    ahead = []
    original = Recaller.lookahead_from_input

    def counted(recaller, args, kwargs):
        did = original(recaller, args, kwargs)
        ahead.append(did)
        return did

    monkeypatch.setattr(Recaller, "lookahead_from_input", counted)
    outs = {}
    for lookahead in (False, True):
        cache = OffloadCache(model, budget_tokens=96, block_tokens=8, lookahead=lookahead, lookahead_query=query)
        outs[lookahead] = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
        stats = cache.stats()
        if lookahead:
            assert stats["prefetched_blocks"] > 0
    assert torch.equal(outs[True], outs[False])
    decode_calls = [did for did in ahead[-6 * 11:]]  # the lookahead run's 11 decode steps of 6 layers
    planned = sum(decode_calls)
    assert planned == (5 * 11 if query == "next" else 0)


def test_the_predicted_query_prefetches_what_the_next_layer_attends():
    """On a 6-layer random Llama, the prefetch planned with the next layer's predicted query is attended by that
    layer's exact plan more often than the one planned with the layer's own query (the two queries come from
    unrelated projections)."""
    model = _deep_llama()
    ids = torch.randint(3, 90, (2, 400), generator=torch.Generator().manual_seed(2))
    used = {}
    for query in ("next", "same"):
        cache = OffloadCache(model, budget_tokens=96, block_tokens=8, lookahead=True, lookahead_query=query,
                             lookahead_blocks=4)  # fmt: skip
        model.generate(ids, past_key_values=cache, max_new_tokens=16, do_sample=False)
        stats = cache.stats()
        used[query] = stats["prefetch_used_blocks"] / max(stats["prefetched_blocks"], 1)
    assert used["next"] > used["same"]


def test_an_unknown_query_source_is_refused():
    from hf_offload.config import OffloadConfig

    with pytest.raises(ValueError, match="lookahead_query must be 'next'"):
        OffloadConfig(budget_tokens=64, lookahead_query="previous")


def test_interleaved_sliding_layers_plan_with_the_layers_own_query():
    """Gemma 3's offloaded layers are not adjacent (sliding layers between them): no predicted query, so lookahead
    plans with the layer's own query after its plan, and the tokens stay those without lookahead."""
    model = build_model("gemma3")
    ids = torch.randint(3, 90, (1, 200), generator=torch.Generator().manual_seed(3))
    outs, caches = {}, {}
    for lookahead in (False, True):
        cache = OffloadCache(model, budget_tokens=64, block_tokens=8, lookahead=lookahead)
        outs[lookahead] = model.generate(ids, past_key_values=cache, max_new_tokens=10, do_sample=False)
        caches[lookahead] = cache
    layers = caches[True].offload_layers
    assert len(layers) == 2 and all(layer.recaller.next_decoder is None for layer in layers)
    assert caches[True].stats()["prefetched_blocks"] > 0  # planned with the layer's own query
    assert torch.equal(outs[True], outs[False])
