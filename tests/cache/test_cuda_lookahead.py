"""The asynchronous recall engine on a CUDA device: copy kernels on side streams with lookahead give exactly the
tokens of the synchronous portable path, leave no stale slot, and never synchronise with the host while decoding.
Skipped without CUDA (and Triton)."""

from __future__ import annotations

import pytest
import torch

from hf_offload import OffloadCache
from hf_offload.attention import OffloadMask, offload_attention_forward, take_handoff

from ..helpers import TINY_BLOCKS as SMALL
from ..helpers import left_padded
from .test_lookahead import _llama

pytestmark = [pytest.mark.cuda, pytest.mark.triton]

STEPS = 200


@pytest.mark.parametrize("selector", ["solohead", "headwise"])
@pytest.mark.parametrize("correlated", [False, True])
@pytest.mark.parametrize("attention", ["pool", "paged"])
def test_async_lookahead_matches_synchronous_path_over_200_steps(selector, correlated, attention):
    """The synchronous portable path attends through the slot pool (SDPA); the asynchronous one through the pool
    too, or through the paged kernel, whose float32 sums differ from SDPA's at rounding level (hence the looser
    tolerance on the KV of later layers; the tokens must still be identical)."""
    model = _llama(4, correlated=correlated).cuda()
    ids, mask = left_padded([300, 260, 190], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    outs, caches = {}, {}
    # Every block in host memory: the recall and lookahead paths are what is compared.
    runs = {"sync": dict(transfer="torch", lookahead=False, admission="always"),
            "async": dict(transfer="kernel", lookahead=None, decode_attention=attention, admission="always")}  # fmt: skip
    for name, options in runs.items():
        cache = OffloadCache(model, budget_tokens=64, selector=selector, **options, **SMALL)
        with torch.no_grad():
            outs[name] = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                                        max_new_tokens=STEPS, min_new_tokens=STEPS)  # fmt: skip
        caches[name] = cache
    assert outs["sync"].shape[1] == ids.shape[1] + STEPS
    assert torch.equal(outs["async"], outs["sync"])
    sync, cache = caches["sync"], caches["async"]
    # The asynchronous run really used side streams and lookahead (lookahead=None: on with the kernels on CUDA).
    assert all(layer.execution.streams is not None and layer.execution.lookahead for layer in cache.offload_layers)
    assert not any(layer.execution.lookahead for layer in sync.offload_layers)
    stats = cache.stats()
    assert stats["prefetched_blocks"] > 0 and stats["prefetch_used_blocks"] > 0
    assert stats["decode_steps"] == sync.stats()["decode_steps"] == STEPS - 1
    torch.cuda.synchronize()
    for layer, reference in zip(cache.offload_layers, sync.offload_layers):
        dense_k, dense_v = layer.dense_kv()
        ref_k, ref_v = reference.dense_kv()
        # The host pool got every write. Lookahead places blocks in other slots, and attention sums over the slot
        # pool in slot order, so the KV of later layers may differ at rounding level (the tokens do not).
        tol = 1e-5 if attention == "pool" else 1e-4
        torch.testing.assert_close(dense_k, ref_k, rtol=tol, atol=tol)
        torch.testing.assert_close(dense_v, ref_v, rtol=tol, atol=tol)
        pool, T = layer.blocks.pool, layer.block_tokens
        for b, h, s in (pool.block >= 0).nonzero().tolist():  # and no slot serves stale data
            j = pool.block[b, h, s].item()
            assert torch.equal(pool.data[0, b, h, s], dense_k[b, h, j * T : (j + 1) * T])
            assert torch.equal(pool.data[1, b, h, s], dense_v[b, h, j * T : (j + 1) * T])


@pytest.mark.parametrize("admission", ["always", "auto"])
@pytest.mark.parametrize("selector", ["solohead", "headwise"])
def test_decode_loop_never_synchronises_with_the_host(selector, admission):
    """Decode steps through two layers (seals, recalls, lookahead, a padding mask) under CUDA's sync debug mode,
    which raises on any host synchronisation (``.item()``, ``.cpu()``, blocking copies, ``nonzero``...)."""
    from transformers.masking_utils import causal_mask_function

    cache = OffloadCache(_llama(2), budget_tokens=48, selector=selector, transfer="kernel", lookahead=True,
                         admission=admission, **SMALL)  # fmt: skip
    first, second = cache.layers[0], cache.layers[1]
    B, H, HQ, D = 2, 2, 4, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    prompt = 90
    steps = 24  # crosses block boundaries: blocks are sealed (and written to the host) during the loop
    padding = torch.ones(B, prompt + steps, dtype=torch.bool, device="cuda")
    padding[1, :13] = False
    kv = [torch.randn(2, B, H, prompt + steps, D, device="cuda", generator=g) for _ in range(2)]
    queries = torch.randn(steps, 2, B, HQ, 1, D, device="cuda", generator=g)
    for layer, (k, v) in zip((first, second), kv):
        layer.update(k[:, :, :prompt], v[:, :, :prompt])
        offload_attention_forward(take_handoff(), torch.randn(B, HQ, prompt, D, device="cuda", generator=g), None)
    assert first.execution.lookahead and first.execution.streams is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(steps):
            pos = prompt + step
            mask = OffloadMask("sdpa", dict(batch_size=B, kv_length=pos + 1, kv_offset=0,
                                            mask_function=causal_mask_function, attention_mask=padding))  # fmt: skip
            for idx, (layer, (k, v)) in enumerate(zip((first, second), kv)):
                layer.update(k[:, :, pos : pos + 1], v[:, :, pos : pos + 1])
                offload_attention_forward(take_handoff(), queries[step, idx], mask)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    # With admission "auto" every block stays on the device here: nothing to prefetch, and still no synchronisation.
    assert second.n_blocks > prompt // 8 and (admission == "auto" or int(second.stats.prefetched_blocks) > 0)


def test_async_default_path_matches_synchronous_over_500_steps_of_a_real_shape():
    """The recall engine's must-show: a Llama-3.2-1B-shaped model (random bf16 weights; 16 layers, 32 query / 8 KV
    heads of 64), batch 2, 2,048-token prompts, budget 512, 500 decode steps: the default CUDA path (copy kernels,
    writes on the offload stream, no host synchronisation) gives the tokens of the synchronous portable path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=4096,
                         rope_theta=500000.0, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, config.vocab_size, (2, 2048), generator=g).cuda()
    mask = torch.ones_like(ids)
    steps, outs, stats = 500, {}, {}
    # Both attend through the slot pool: the comparison is of the recall engine, synchronous or not (the paged
    # kernel's bfloat16 rounding differs from SDPA's, which over 500 steps can flip a near-tie token; it is compared
    # with the pool path in tests/test_kernel_paged.py).
    runs = {"sync": dict(transfer="torch"), "async": dict(transfer="kernel", decode_attention="pool")}
    for name, options in runs.items():
        cache = OffloadCache(model, budget_tokens=512, **options)
        with torch.no_grad():
            outs[name] = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                                        max_new_tokens=steps, min_new_tokens=steps)  # fmt: skip
        stats[name] = cache.stats()
        assert all((layer.execution.streams is not None) == (name == "async") for layer in cache.offload_layers)
    assert outs["async"].shape[1] == ids.shape[1] + steps
    assert torch.equal(outs["async"], outs["sync"])
    assert stats["async"]["decode_recalled_bytes"] == stats["sync"]["decode_recalled_bytes"] > 0
    assert stats["async"]["hit_rate"] == stats["sync"]["hit_rate"]


@pytest.mark.parametrize("query", ["next", "same"])
def test_lookahead_inside_whole_layer_graphs_gives_the_tokens_and_counts_of_op_by_op(query):
    """With graphs on (the default) lookahead runs inside each whole decoder layer's graph: the next layer's
    prefetch forked on the prefetch stream and joined before the graph ends. Tokens, KV and the prefetch counters
    equal those of lookahead run op by op on the same copy kernels; the graphs replay."""
    model = _llama(4, correlated=True).cuda()
    ids, mask = left_padded([300, 260, 190], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    steps, outs, caches = 120, {}, {}
    base = dict(budget_tokens=64, selector="solohead", transfer="kernel", lookahead=True, lookahead_query=query,
                admission="always", decode_attention="pool", **SMALL)  # fmt: skip
    for name, graphs in (("op_by_op", False), ("graphs", None)):
        cache = OffloadCache(model, cuda_graphs=graphs, **base)
        with torch.no_grad():
            outs[name] = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                                        max_new_tokens=steps, min_new_tokens=steps)  # fmt: skip
        caches[name] = cache
    assert torch.equal(outs["graphs"], outs["op_by_op"])
    graphed = caches["graphs"]
    assert all(layer.execution.graphs and layer.execution.lookahead for layer in graphed.offload_layers)
    assert all(int(layer.stats.layer_graph_replays) > steps // 2 for layer in graphed.offload_layers)
    a, b = graphed.stats(), caches["op_by_op"].stats()
    assert a["prefetched_blocks"] > 0 and a["prefetch_used_blocks"] > 0
    for name in ("prefetched_blocks", "prefetch_used_blocks", "decode_recalled_blocks", "hit_rate"):
        assert a[name] == b[name], (name, a[name], b[name])
    torch.cuda.synchronize()
    for layer, reference in zip(graphed.offload_layers, caches["op_by_op"].offload_layers):
        torch.testing.assert_close(layer.dense_kv()[0], reference.dense_kv()[0], rtol=1e-5, atol=1e-5)
