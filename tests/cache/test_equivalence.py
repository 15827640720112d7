"""Reference equivalence: at a budget covering the context, OffloadCache generates exactly what DynamicCache does."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache
from hf_offload.selectors import SELECTORS

# Small blocks and a slot pool of 2 blocks, far smaller than the context: every decode step recalls from the host.
from ..helpers import TINY_PREFILL as SMALL
from ..helpers import build_model, left_padded

NEW_TOKENS = 10


def _generate(model, ids, mask, cache, new_tokens=NEW_TOKENS):
    with torch.no_grad():
        return model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False
        )


def _assert_offloaded(cache: OffloadCache):
    stats = cache.stats()
    assert stats["host_kv_bytes"] > 0
    assert stats["recalled_blocks"] > 0 and stats["recalled_bytes"] > 0
    assert stats["decode_steps"] == NEW_TOKENS - 1
    for layer in cache.offload_layers:
        assert layer.n_blocks > layer.blocks.pool.slots  # the pool is smaller than the context


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_batch1_token_identical(arch, selector):
    model = build_model(arch)
    ids, mask = left_padded([37])  # not a multiple of the block size
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    cache = OffloadCache(model, budget_tokens=4096, selector=selector, **SMALL)
    got = _generate(model, ids, mask, cache)
    assert torch.equal(got, expected)
    _assert_offloaded(cache)


def test_batch3_left_padding_token_identical(arch):
    model = build_model(arch)
    ids, mask = left_padded([37, 29, 18], seed=1)
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    got = _generate(model, ids, mask, cache)
    assert torch.equal(got, expected)
    _assert_offloaded(cache)


def test_two_generate_calls_on_one_cache(arch):
    model = build_model(arch)
    ids, mask = left_padded([33, 21], seed=2)
    follow_up, _ = left_padded([11, 11], seed=3)

    def two_turns(cache):
        first = _generate(model, ids, mask, cache)
        ids2 = torch.cat([first, follow_up], dim=1)
        mask2 = torch.cat([mask, torch.ones_like(first[:, ids.shape[1] :]), torch.ones_like(follow_up)], dim=1)
        return first, _generate(model, ids2, mask2, cache)

    expected = two_turns(DynamicCache(config=model.config))
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    got = two_turns(cache)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert cache.stats()["host_kv_bytes"] > 0


def test_chunked_prefill_matches(arch):
    """generate(prefill_chunk_size=...) prefills in several forwards; later chunks read earlier ones from the host."""
    model = build_model(arch)
    ids, mask = left_padded([45])
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    with torch.no_grad():
        got = model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW_TOKENS, do_sample=False,
            prefill_chunk_size=16,
        )
    assert torch.equal(got, expected)


def test_eager_model_token_identical():
    model = build_model("llama", attn_implementation="eager")
    ids, mask = left_padded([30, 19], seed=4)
    expected = _generate(model, ids, mask, DynamicCache(config=model.config))
    got = _generate(model, ids, mask, OffloadCache(model, budget_tokens=4096, **SMALL))
    assert torch.equal(got, expected)


def _buffer_bytes(cache) -> int:
    """Device bytes of a cache's buffers besides admitted blocks (slot pools, summaries, block tables)."""
    return sum(layer.blocks.device_buffer_bytes() for layer in cache.offload_layers)


@pytest.mark.parametrize("admitted_chunks", [None, 2.5])  # everything admitted / about two chunks admitted
def test_admission_auto_and_always_give_identical_tokens(admitted_chunks):
    model = build_model("qwen2")
    ids, mask = left_padded([45, 33, 20], seed=6)
    tiny_chunks = dict(SMALL, host_chunk_mib=0.01)  # ~5 blocks per chunk, so placement varies chunk by chunk
    caches = {"always": OffloadCache(model, budget_tokens=40, admission="always", **tiny_chunks)}
    outs = {"always": _generate(model, ids, mask, caches["always"])}
    # The bound holds the cache's buffers and a number of chunks (CPU: nothing is admitted without a bound).
    host = caches["always"].offload_layers[0].blocks.host
    chunk_bytes = host.chunk_blocks * host.block_bytes
    extra = 1 << 30 if admitted_chunks is None else int(admitted_chunks * chunk_bytes)
    gib = (_buffer_bytes(caches["always"]) + extra) / (1 << 30)
    caches["auto"] = OffloadCache(model, budget_tokens=40, admission="auto", device_memory_gib=gib, **tiny_chunks)
    outs["auto"] = _generate(model, ids, mask, caches["auto"])
    assert torch.equal(outs["auto"], outs["always"])
    always, auto = caches["always"].stats(), caches["auto"].stats()
    total_kv = always["host_kv_bytes"]
    assert total_kv > 0
    # Admitted blocks move from the host column to the device column; nothing is lost or counted twice.
    assert auto["host_kv_bytes"] + (auto["device_kv_bytes"] - always["device_kv_bytes"]) == total_kv
    if admitted_chunks is None:
        assert auto["host_kv_bytes"] == 0
    else:
        assert 0 < auto["host_kv_bytes"] < total_kv
    # Same recalls either way; with "auto" only those of blocks left in host memory cross from the host.
    assert auto["decode_recalled_bytes"] == always["decode_recalled_bytes"] > 0
    assert always["decode_host_bytes"] == always["decode_recalled_bytes"]
    if admitted_chunks is None:
        assert auto["decode_host_bytes"] == 0
    else:
        assert 0 <= auto["decode_host_bytes"] < auto["decode_recalled_bytes"]
    admission = caches["auto"]._shared.admissions[torch.device("cpu")]
    assert admission.cache_bytes() <= admission.limit_bytes
    if admitted_chunks is not None:
        # Chunks admitted while the summaries were small went back to the host as they grew.
        assert admission.demoted_chunks > 0
    for layer in caches["auto"].offload_layers:
        assert torch.equal(layer.dense_kv()[0], caches["always"].layers[layer.layer_idx].dense_kv()[0])


def test_reset_frees_and_serves_a_new_batch():
    model = build_model("llama")
    cache = OffloadCache(model, budget_tokens=4096, **SMALL)
    ids, mask = left_padded([30, 22], seed=9)
    _generate(model, ids, mask, cache)
    assert cache.host_budget.reserved_bytes > 0
    cache.reset()
    assert cache.host_budget.reserved_bytes == 0 and cache.get_seq_length() == 0
    ids3, mask3 = left_padded([26, 19, 33], seed=10)
    expected = _generate(model, ids3, mask3, DynamicCache(config=model.config))
    assert torch.equal(_generate(model, ids3, mask3, cache), expected)


def test_reserve_allocates_summaries_once_and_keeps_outputs():
    """reserve(tokens) before the first seal: summary buffers of that capacity from the start (no growth while the
    cache fills), same tokens; after: the buffers grow at once and keep every held summary; bad input is refused."""
    from hf_offload.cache import SUMMARY_CHUNK_BLOCKS

    model = build_model("llama")
    ids, mask = left_padded([45, 30], seed=3)
    expected = _generate(model, ids, mask, OffloadCache(model, budget_tokens=40, **SMALL))
    tokens = SMALL["block_tokens"] * (SUMMARY_CHUNK_BLOCKS + 10)  # more than one chunk of summary blocks
    cache = OffloadCache(model, budget_tokens=40, **SMALL)
    cache.reserve(tokens)
    assert torch.equal(_generate(model, ids, mask, cache), expected)
    for layer in cache.offload_layers:
        assert {s.shape[1] for s in layer.blocks.summary_store.values()} == {2 * SUMMARY_CHUNK_BLOCKS}
        assert all(view.shape[1] == layer.n_blocks for view in layer.blocks.summaries.values())
    per_block = sum(s[0, 0].numel() * s.element_size() for s in cache.offload_layers[0].blocks.summary_store.values())
    assert cache.stats()["device_summary_bytes"] == per_block * 2 * 2 * SUMMARY_CHUNK_BLOCKS * len(cache.offload_layers)

    later = OffloadCache(model, budget_tokens=40, **SMALL)
    _generate(model, ids, mask, later)
    before = {i: {k: v.clone() for k, v in layer.blocks.summaries.items()} for i, layer in enumerate(later.offload_layers)}
    assert {s.shape[1] for s in later.offload_layers[0].blocks.summary_store.values()} == {SUMMARY_CHUNK_BLOCKS}
    later.reserve(tokens)
    for i, layer in enumerate(later.offload_layers):
        assert {s.shape[1] for s in layer.blocks.summary_store.values()} == {2 * SUMMARY_CHUNK_BLOCKS}
        assert all(torch.equal(layer.blocks.summaries[k], v) for k, v in before[i].items())
    with pytest.raises(ValueError, match="tokens"):
        later.reserve(-1)


def test_device_bound_too_small_for_the_summaries_says_what_to_change():
    model = build_model("qwen2")
    ids, mask = left_padded([45, 33], seed=6)
    cache = OffloadCache(model, budget_tokens=40, device_memory_gib=1e-7, **SMALL)
    with pytest.raises(MemoryError, match=r"device_memory_gib=.*cannot hold the cache's device buffers.*Raise"):
        _generate(model, ids, mask, cache)
