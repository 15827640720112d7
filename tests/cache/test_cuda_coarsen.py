"""Summaries coarsened on CUDA in the middle of a decode with CUDA graphs (``coarsen_summaries``): the graphs that
read the old buffers are dropped and captured again, and the output at a full budget does not change. Skipped
without CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_offload import OffloadCache

from ..helpers import build_model, left_padded

pytestmark = pytest.mark.cuda

BLOCKS = dict(block_tokens=8, sink_tokens=8, window_tokens=8)


def _run(model, ids, mask, cache, new_tokens):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        # min_new_tokens: a random model's end-of-sequence token would otherwise stop the decode before the
        # summaries grow (sparse budgets choose other tokens than dense ones, and CUDA's numerics other than the CPU's).
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False)  # fmt: skip


@pytest.mark.parametrize("budget", [4096, 64])
def test_cuda_summaries_coarsened_during_a_graph_decode(budget):
    model = build_model("llama").to("cuda", torch.bfloat16)
    # 2,036 tokens: 254 sealed 8-token blocks, so the summaries (256 blocks at a time) grow during the decode.
    ids, mask = left_padded([2036, 2030], seed=8)
    ids, mask = ids.cuda(), mask.cuda()
    settings = dict(budget_tokens=budget, admission="auto", **BLOCKS)
    probe = OffloadCache(model, **settings)
    _run(model, ids, mask, probe, 1)
    layers = probe.offload_layers
    summaries = sum(layer.blocks.device_summary_bytes() for layer in layers)
    buffers = sum(layer.blocks.device_buffer_bytes() for layer in layers)
    # Room for the default's first 256 blocks and a half, not for its next 256: only plain quantkey's fit then.
    gib = (buffers - summaries + 1.5 * summaries) / 2**30
    reference = _run(model, ids, mask, OffloadCache(model, **settings), 24)
    cache = OffloadCache(model, device_memory_gib=gib, **settings)
    got = _run(model, ids, mask, cache, 24)
    stats = cache.stats()
    levels = stats["summary_levels"]
    assert [e["to"] for e in levels] == ["quantkey[tail_bits=2,tail_near=16.0]", "quantkey"]
    assert levels[0]["tokens"] > ids.shape[1]  # during the decode, with the graphs captured
    assert stats["graph_replays"] > 0 and stats["graph_captures"] > len(cache.offload_layers)
    if budget == 4096:
        assert torch.equal(got, reference)
    else:
        assert got.shape == reference.shape
    admission = cache._shared.admissions[ids.device]
    assert admission.cache_bytes() <= admission.limit_bytes
