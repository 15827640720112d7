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
        cache = OffloadCache(model, budget_tokens=4096, selector=selector, admission="always", **SMALL)
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


@pytest.mark.parametrize("extra_chunks", [0.5, 3.5])
def test_cuda_admitted_chunks_go_back_to_the_host_as_summaries_grow(extra_chunks):
    """admission="auto" within a device bound that the growing summaries squeeze: admitted chunks move to pinned
    host memory (same block ids, device tables rewritten in place) and the tokens stay those of "always"."""
    model = build_model("qwen2").cuda()
    ids, mask = left_padded([45, 33, 20], seed=6)
    ids, mask = ids.cuda(), mask.cuda()
    tiny = dict(SMALL, host_chunk_mib=0.01)

    def run(cache):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                                  do_sample=False)  # fmt: skip

    always = OffloadCache(model, budget_tokens=40, admission="always", **tiny)
    expected = run(always)
    host = always.offload_layers[0].blocks.host
    buffers = sum(layer.blocks.device_buffer_bytes() for layer in always.offload_layers)
    gib = (buffers + extra_chunks * host.chunk_blocks * host.block_bytes) / 2**30
    cache = OffloadCache(model, budget_tokens=40, admission="auto", device_memory_gib=gib, **tiny)
    assert torch.equal(run(cache), expected)
    admission = cache._shared.admissions[ids.device]
    assert admission.demoted_chunks > 0 and admission.cache_bytes() <= admission.limit_bytes
    for layer in cache.offload_layers:
        pool = layer.blocks.host
        for chunk, admitted in zip(pool.chunks, pool.chunk_admitted):
            assert chunk.is_cuda == admitted and (admitted or chunk.is_pinned())
        assert torch.equal(layer.dense_kv()[0], always.layers[layer.layer_idx].dense_kv()[0])
