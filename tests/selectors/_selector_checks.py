"""Checks every new selector's tests run: planted attention mass is found within the budget and the output matches
dense attention (the style of tests/attention/test_sparse.py), and at a budget covering the context OffloadCache
generates exactly what DynamicCache does on a tiny Llama."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from hf_offload import OffloadCache
from hf_offload.attention import offload_attention_forward, take_handoff

from ..helpers import build_model, left_padded

# The planted-mass inputs of tests/attention/test_sparse.py: a few blocks hold >= 99% of the decode query's attention
# mass.
from ..attention.test_sparse import B, D, H, HQ, PLANTED, T  # noqa: F401
from ..attention.test_sparse import _planted_inputs as planted_inputs


def check_planted(selector) -> None:
    """The planted blocks are selected at a budget of 6 blocks and the output is within 1% of dense attention."""
    keys, values, query = planted_inputs()
    scaling = D**-0.5
    k = keys.repeat_interleave(HQ // H, dim=1)
    v = values.repeat_interleave(HQ // H, dim=1)
    weights = torch.softmax(query @ k.transpose(-1, -2) * scaling, dim=-1)
    expected = weights @ v
    model = build_model("llama")
    cache = OffloadCache(model, budget_tokens=6 * T, block_tokens=T, sink_tokens=T, window_tokens=T, selector=selector)
    layer = cache.layers[0]
    layer.update(keys[:, :, :-1], values[:, :, :-1])
    take_handoff()
    layer.update(keys[:, :, -1:], values[:, :, -1:])
    handoff = take_handoff()
    selection = layer.planner.select(query.view(B, H, HQ // H, D), None, scaling, handoff)
    assert selection.blocks.shape[1] == 1  # one shared selection per layer
    for b, blocks in PLANTED.items():
        chosen = set(selection.blocks[b, 0][selection.keep[b, 0]].tolist())
        assert set(blocks) <= chosen, (b, chosen)
    got = offload_attention_forward(handoff, query, None, scaling=scaling).transpose(1, 2)
    for b in range(B):
        assert (got[b] - expected[b]).norm() / expected[b].norm() <= 1e-2
    assert selection.keep.sum(-1).max().item() * T + handoff.key.shape[-2] <= 6 * T


def check_full_budget_token_identical(selector) -> None:
    """Greedy tokens of a tiny Llama through OffloadCache at a covering budget equal DynamicCache's."""
    model = build_model("llama")
    ids, mask = left_padded([37, 29], seed=1)
    small = dict(block_tokens=8, sink_tokens=8, window_tokens=8, pool_tokens=16, prefill_chunk_tokens=16)

    def generate(cache):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=10,
                                  do_sample=False)

    expected = generate(DynamicCache(config=model.config))
    cache = OffloadCache(model, budget_tokens=4096, selector=selector, **small)
    assert torch.equal(generate(cache), expected)
    assert cache.stats()["recalled_blocks"] > 0
