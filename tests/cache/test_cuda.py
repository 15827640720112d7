"""The same guarantees on a CUDA device: pinned host pool, exact at full budget, nothing lost. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache
from hf_offload.attention import offload_attention_forward, take_handoff

from ..helpers import TINY_PREFILL as SMALL
from ..helpers import build_model, left_padded

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "phi3"])
@pytest.mark.parametrize("selector", ["solohead", "meanbound", "quantkey", "headwise"])
def test_cuda_full_budget_token_identical_and_pinned(arch, selector):
    model = build_model(arch).cuda()
    ids, mask = left_padded([37, 29, 18], seed=1)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        expected = model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config), max_new_tokens=10,
            do_sample=False,
        )
        cache = OffloadCache(model, budget_tokens=4096, selector=selector, **SMALL)
        got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, expected)
    stats = cache.stats()
    assert stats["host_kv_bytes"] > 0 and stats["recalled_blocks"] > 0
    for layer in cache.offload_layers:
        assert layer.blocks.host.pin_memory and all(chunk.is_pinned() for chunk in layer.blocks.host.chunks)
        assert layer.blocks.pool.data.is_cuda


def test_cuda_bf16_full_budget_logits_close():
    model = build_model("llama").to("cuda", torch.bfloat16)
    ids, mask = left_padded([45, 30], seed=2)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        dense = model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config)).logits
        cache = OffloadCache(model, budget_tokens=4096, **SMALL)
        offl = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
    valid = mask.bool()
    err = (offl.float() - dense.float())[valid].norm() / dense.float()[valid].norm()
    assert err < 2e-2, float(err)


def test_cuda_tiers_reassemble_bit_for_bit():
    model = build_model("llama").cuda()
    cache = OffloadCache(model, budget_tokens=32, block_tokens=8, sink_tokens=8, window_tokens=8, pool_tokens=16)
    layer = cache.layers[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    all_k, all_v = [], []
    for q_len in [21, 1, 1, 17, 1, 1, 1, 1, 1, 1, 1, 1]:
        k = torch.randn(2, 2, q_len, 16, device="cuda", generator=g)
        v = torch.randn(2, 2, q_len, 16, device="cuda", generator=g)
        all_k.append(k)
        all_v.append(v)
        layer.update(k, v)
        offload_attention_forward(take_handoff(), torch.randn(2, 4, q_len, 16, device="cuda", generator=g), None)
    dense_k, dense_v = layer.dense_kv()
    assert torch.equal(dense_k, torch.cat(all_k, -2)) and torch.equal(dense_v, torch.cat(all_v, -2))
    assert layer.stats.recalled_blocks > 0
