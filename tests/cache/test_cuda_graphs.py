"""Decode steps replayed from CUDA graphs give the tokens and counters of the steps run op by op. Skipped without
CUDA (and Triton: graphs need the kernel transfer path)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_offload.attention.decode as attention_module
import hf_offload.cache.shared as cache_module
from hf_offload import OffloadCache
from hf_offload.cache import GRAPH_CAPACITY_BLOCKS, GraphRunner, OffloadLayer
from hf_offload.config import DEFAULT_SELECTOR
from hf_offload.selectors import SoloHeadSelector, get_selector

from ..helpers import TINY_SPARSE as SMALL
from ..helpers import build_model, left_padded

pytestmark = [pytest.mark.cuda, pytest.mark.triton]

COUNTERS = ("recalled_blocks", "recalled_bytes", "decode_recalled_blocks", "offloaded_bytes", "decode_steps",
            "hit_rate", "host_kv_bytes", "device_kv_bytes", "tail_share")  # fmt: skip


def _generate(model, ids, mask, steps, **options):
    if options.get("cuda_graphs") is False and "decode_capacity_blocks" not in options:
        # Op by op, the steps score the block capacity a graphed run scores, so that both do the same arithmetic.
        masks = get_selector(options.get("selector", DEFAULT_SELECTOR)).masks_invalid
        options["decode_capacity_blocks"] = GRAPH_CAPACITY_BLOCKS if masks else 1
    options.setdefault("graph_scope", "attention")  # the graphs of the attention alone (whole layers: test_layer_graphs)
    cache = OffloadCache(model, **SMALL, **options)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False)  # fmt: skip
    torch.cuda.synchronize()
    return out, cache


@pytest.mark.parametrize("capacity", [1, None])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "selector", ["quantkey", "quantkey[tail_bits=2]", "quantkey[bits=4,tail_bits=2,tail_near=2]", "solohead", "headwise"]
)
def test_graphs_same_tokens_and_counters(arch, selector, capacity, monkeypatch):
    """Capacity 1: one capture per layer and seal (graphs of an earlier kind captured without an op-by-op run);
    ``None`` (64 blocks): one capture per layer for the whole run."""
    model = build_model(arch).cuda()
    ids, mask = left_padded([70, 53, 31], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    steps = 60  # several seals of 8-token blocks
    eager_capacity = capacity or GRAPH_CAPACITY_BLOCKS
    expected, eager = _generate(model, ids, mask, steps, selector=selector, cuda_graphs=False,
                                decode_capacity_blocks=eager_capacity)  # fmt: skip
    captures, replays, op_by_op = [], [], []
    capture, replay, body = cache_module.capture, GraphRunner.replay, attention_module.decode_body

    def counted_body(*args, **kwargs):
        if not (len(args) > 8 and args[8] is False):  # a step run op by op (not the body a capture records)
            op_by_op.append(1)
        return body(*args, **kwargs)

    monkeypatch.setattr(cache_module, "capture", lambda *a, **k: captures.append(1) or capture(*a, **k))
    monkeypatch.setattr(GraphRunner, "replay", lambda self, *a: replays.append(1) or replay(self, *a))
    monkeypatch.setattr(attention_module, "decode_body", counted_body)
    got, graphed = _generate(model, ids, mask, steps, selector=selector, cuda_graphs=True,
                             decode_capacity_blocks=capacity)  # fmt: skip
    assert torch.equal(got, expected)
    layers = len(graphed.offload_layers)
    assert all(layer.execution.capacity_blocks == eager_capacity for layer in graphed.offload_layers)
    decode_calls = (steps - 1) * layers
    assert replays and captures
    assert len(replays) + len(op_by_op) == decode_calls  # every step either replays (maybe just captured) or not
    assert len(replays) >= decode_calls * 3 // 4  # at most one capture per layer and seal (every 8 steps)
    if capacity == 1:
        # A geometry of a kind the layer has run op by op is captured without running op by op first.
        assert len(op_by_op) < len(captures)
    else:
        assert len(captures) == layers and len(op_by_op) == layers  # 9 to 16 sealed blocks: one capacity
        assert len(replays) == decode_calls - layers
    assert graphed.stats()["graph_capture_retries"] == 0
    a, b = eager.stats(), graphed.stats()
    for name in COUNTERS:
        assert a[name] == b[name], name
    for idx in a["layers"]:
        assert a["layers"][idx]["lookups"] == b["layers"][idx]["lookups"]


def test_graphs_bf16_long_decode_matches_op_by_op():
    """500 decode steps of a bf16 model: graphs replayed across ~60 seals give the same tokens."""
    model = build_model("llama").to("cuda", torch.bfloat16)
    ids, mask = left_padded([200, 150], seed=4)
    ids, mask = ids.cuda(), mask.cuda()
    expected, _ = _generate(model, ids, mask, 500, cuda_graphs=False)
    got, cache = _generate(model, ids, mask, 500, cuda_graphs=True)
    assert torch.equal(got, expected)
    assert all(layer.execution.graphs for layer in cache.offload_layers)


def test_graphs_survive_reset_and_a_new_batch():
    model = build_model("llama").cuda()
    cache = OffloadCache(model, **SMALL, cuda_graphs=True)
    for lengths, seed in (([40, 33], 5), ([61, 20, 44], 6)):
        ids, mask = left_padded(lengths, seed=seed)
        ids, mask = ids.cuda(), mask.cuda()
        expected, _ = _generate(model, ids, mask, 30, cuda_graphs=False)
        cache.reset()
        with torch.no_grad():
            got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=30,
                                 min_new_tokens=30, do_sample=False)  # fmt: skip
        assert torch.equal(got, expected)


class _SyncingSelector(SoloHeadSelector):
    """Reads a score on the host: cannot be captured."""

    name = "syncing"

    def score(self, query, summaries, scaling):
        scores = super().score(query, summaries, scaling)
        if float(scores.max()) > 1e9:  # a host synchronisation
            raise AssertionError("unreachable")
        return scores


def test_capture_failure_falls_back_or_raises():
    model = build_model("llama").cuda()
    ids, mask = left_padded([40, 33], seed=7)
    ids, mask = ids.cuda(), mask.cuda()
    expected, _ = _generate(model, ids, mask, 20, selector=_SyncingSelector(), cuda_graphs=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, cache = _generate(model, ids, mask, 20, selector=_SyncingSelector(), cuda_graphs=None)
    assert torch.equal(got, expected)
    assert any("runs op by op" in str(w.message) for w in caught)
    assert not any(layer.execution.graphs for layer in cache.offload_layers)
    with pytest.raises(RuntimeError, match="capturing the decode step failed"):
        _generate(model, ids, mask, 20, selector=_SyncingSelector(), cuda_graphs=True)
    # A failed capture leaves nothing behind: the device's random generator draws, and sampling runs.
    assert torch.randn(4, device="cuda").isfinite().all()
    sampled = model.generate(input_ids=ids, attention_mask=mask, past_key_values=OffloadCache(model, **SMALL),
                             do_sample=True, max_new_tokens=4, min_new_tokens=4)  # fmt: skip
    assert sampled.shape[1] == ids.shape[1] + 4


@pytest.mark.parametrize("attention", ["pool", "paged"])
def test_graphs_count_host_reads_with_admission_auto(attention):
    """Admission "auto" with a limit of a few chunks and a pool that grows while decoding: graphs give the tokens and
    the recall counters (host reads included) of the op-by-op steps; a graph replayed on the step that grew the pool
    reads the chunk tables it was captured with, which it holds. The paged attention reads admitted blocks in place:
    only host blocks are recalled."""
    model = build_model("llama").cuda()
    ids, mask = left_padded([70, 53, 31], seed=8)
    ids, mask = ids.cuda(), mask.cuda()
    options = dict(selector="quantkey", host_chunk_mib=0.01, decode_attention=attention)
    _, always = _generate(model, ids, mask, 60, cuda_graphs=False, admission="always", **options)
    host = always.offload_layers[0].blocks.host
    buffers = sum(layer.blocks.device_buffer_bytes() for layer in always.offload_layers)
    # The bound holds the cache's buffers and three chunks (device_memory_gib bounds the whole cache).
    options.update(admission="auto", device_memory_gib=(buffers + 3 * host.chunk_blocks * host.block_bytes) / 2**30)
    expected, eager = _generate(model, ids, mask, 60, cuda_graphs=False, **options)
    got, graphed = _generate(model, ids, mask, 60, cuda_graphs=True, **options)
    assert torch.equal(got, expected)
    a, b = eager.stats(), graphed.stats()
    assert b["graph_replays"] > 0
    assert a["graph_captures"] == 0 and a["graph_capture_ms"] == 0  # op by op: nothing captured, no capture time
    assert b["graph_captures"] > 0 and b["graph_capture_ms"] > 0
    for name in COUNTERS + ("decode_host_bytes", "decode_recalled_bytes"):
        assert a[name] == b[name], name
    if attention == "pool":
        assert 0 < a["decode_host_bytes"] < a["decode_recalled_bytes"]  # some recalls stayed on the device
    else:
        assert 0 < a["decode_host_bytes"] == a["decode_recalled_bytes"]  # admitted blocks are not copied
