"""Decode steps whose whole decoder layers replay from CUDA graphs (``graph_scope="layer"``) give the tokens and
counters of the steps run op by op and of the graphs of the attention alone. Skipped without CUDA and Triton."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_offload import OffloadCache
from hf_offload.cache import GRAPH_CAPACITY_BLOCKS
from hf_offload.patches.layers import DecoderLayerCall

from ..helpers import TINY_SPARSE as SMALL
from ..helpers import ARCHS, build_model, left_padded
from .test_layer_graphs_cpu import _assert_same_sealed_state

pytestmark = [pytest.mark.cuda, pytest.mark.triton]

COUNTERS = ("recalled_blocks", "recalled_bytes", "decode_recalled_blocks", "decode_host_bytes", "offloaded_bytes",
            "decode_steps", "hit_rate", "host_kv_bytes", "device_kv_bytes", "tail_share")  # fmt: skip


def _generate(model, ids, mask, steps, **options):
    cache = OffloadCache(model, **SMALL, decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS, **options)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False)  # fmt: skip
    torch.cuda.synchronize()
    return out, cache


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("selector", ["quantkey", "quantkey[bits=4,tail_bits=2,tail_near=2]", "solohead"])
def test_layer_graphs_same_tokens_and_counters(arch, selector):
    model = build_model(arch).cuda()
    ids, mask = left_padded([70, 53, 31], seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    steps = 60  # several seals of 8-token blocks
    expected, eager = _generate(model, ids, mask, steps, selector=selector, cuda_graphs=False)
    attention, attention_cache = _generate(model, ids, mask, steps, selector=selector, cuda_graphs=True,
                                           graph_scope="attention")  # fmt: skip
    got, graphed = _generate(model, ids, mask, steps, selector=selector, cuda_graphs=True, graph_scope="layer")
    assert torch.equal(attention, expected)
    assert torch.equal(got, expected)
    a, b = eager.stats(), graphed.stats()
    for name in COUNTERS:
        assert a[name] == b[name], name
    for idx in a["layers"]:
        assert a["layers"][idx]["lookups"] == b["layers"][idx]["lookups"]
    layers = graphed.offload_layers
    counts = [(int(layer.stats.layer_graph_captures), int(layer.stats.layer_graph_replays)) for layer in layers]
    # Step 1 runs op by op and captures the attention; step 2 captures the layer; from then on the layer replays,
    # except on the steps that seal a block (one in 8) and the step of any new capture.
    assert all(captures == 1 for captures, _ in counts), counts
    assert all(replays >= (steps - 1) * 3 // 4 for _, replays in counts), counts
    assert int(attention_cache.offload_layers[0].stats.layer_graph_replays) == 0
    assert b["graph_replays"] >= sum(replays for _, replays in counts)


@pytest.mark.parametrize("admission", ["auto", "always"])
def test_layer_graphs_with_reuse_give_the_tokens_of_op_by_op(admission):
    """``reselect_every=2``: the choosing and the reusing step alternate as two graphs of the whole layer per layer,
    with the tokens and counters of the same steps run op by op."""
    model = build_model("llama").to("cuda", torch.bfloat16)
    ids, mask = left_padded([200, 150], seed=4)
    ids, mask = ids.cuda(), mask.cuda()
    options = dict(selector="quantkey", reselect_every=2, admission=admission)
    expected, eager = _generate(model, ids, mask, 120, cuda_graphs=False, **options)
    got, cache = _generate(model, ids, mask, 120, cuda_graphs=True, **options)
    assert torch.equal(got, expected)
    a, b = eager.stats(), cache.stats()
    for name in ("reused_selections", "decode_steps", "hit_rate", "decode_recalled_blocks"):
        assert a[name] == b[name], name
    assert b["reused_selections"] > 0
    for layer in cache.offload_layers:
        reuse = sorted(key[2][-1] for key in layer.graphs.graphs if key[1:2] == ("layer",))
        assert reuse == [False, True], reuse
        assert int(layer.stats.layer_graph_replays) > 80


@pytest.mark.parametrize("admission", ["auto", "always"])
def test_layer_graphs_bf16_long_decode_matches_op_by_op(admission):
    """300 decode steps of a bf16 model over ~40 seals: the same tokens as op by op (with every block on the device,
    the captured seals write the blocks; offloaded, the offload stream does after each replay)."""
    model = build_model("llama").to("cuda", torch.bfloat16)
    ids, mask = left_padded([200, 150], seed=4)
    ids, mask = ids.cuda(), mask.cuda()
    expected, eager = _generate(model, ids, mask, 300, cuda_graphs=False, admission=admission)
    got, cache = _generate(model, ids, mask, 300, cuda_graphs=True, admission=admission)
    assert torch.equal(got, expected)
    assert all(int(layer.stats.layer_graph_replays) > 200 for layer in cache.offload_layers)
    for layer in cache.offload_layers:
        # ~37 seals after replayed steps: the first op by op, then from captured seals (a new one where a seal grew
        # the host pool); summaries, block tables and stored blocks as op by op.
        assert int(layer.stats.seal_graph_replays) >= 30
        _assert_same_sealed_state(layer, eager.layers[layer.layer_idx])
        assert layer.blocks.host.all_admitted == (admission == "auto")


def test_layer_graphs_survive_reset_and_a_new_batch():
    model = build_model("qwen2").cuda()
    cache = OffloadCache(model, **SMALL, cuda_graphs=True, decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS)
    for lengths, seed in (([40, 33], 5), ([61, 20, 44], 6)):
        ids, mask = left_padded(lengths, seed=seed)
        ids, mask = ids.cuda(), mask.cuda()
        expected, _ = _generate(model, ids, mask, 30, cuda_graphs=False)
        cache.reset()
        with torch.no_grad():
            got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=30,
                                 min_new_tokens=30, do_sample=False)  # fmt: skip
        assert torch.equal(got, expected)
        assert int(cache.offload_layers[0].stats.layer_graph_replays) > 0


def test_uncapturable_layer_code_falls_back_with_a_warning():
    """A decoder layer that reads a value on the host cannot be captured: the layer warns once and keeps replaying
    only its attention's graph, with the same tokens."""
    model = build_model("llama").cuda()
    ids, mask = left_padded([40, 33], seed=7)
    ids, mask = ids.cuda(), mask.cuda()
    expected, _ = _generate(model, ids, mask, 24, cuda_graphs=False)
    layer = model.model.layers[1]
    mlp_forward = layer.mlp.forward

    def syncing_mlp(x):
        if float(x.abs().max()) < 0:  # a host synchronisation
            raise AssertionError("unreachable")
        return mlp_forward(x)

    layer.mlp.forward = syncing_mlp
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, cache = _generate(model, ids, mask, 24, cuda_graphs=True)
    finally:
        del layer.mlp.forward
    assert torch.equal(got, expected)
    assert sum("capturing the whole decoder layer" in str(w.message) for w in caught) == 1
    flags = [layer.graphs.layer_graphs for layer in cache.offload_layers]
    assert flags[1] is False and all(flags[:1] + flags[2:])
    assert int(cache.offload_layers[1].stats.graph_replays) > 0  # its attention still replays


def test_hidden_states_of_replayed_layers_are_not_overwritten():
    """The outputs of a replayed layer are copies: hidden states kept from one step survive the next."""
    model = build_model("llama").cuda()
    ids, mask = left_padded([40, 33], seed=8)
    ids, mask = ids.cuda(), mask.cuda()
    cache = OffloadCache(model, **SMALL, cuda_graphs=True, decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS)
    assert all(isinstance(m.__dict__.get("forward"), DecoderLayerCall) for m in model.model.layers)
    kept = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(6):
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True,
                        output_hidden_states=True)  # fmt: skip
            kept.append([h.clone() for h in out.hidden_states] + [list(out.hidden_states)])
            token = out.logits[:, -1:].argmax(-1)
    assert int(cache.offload_layers[0].stats.layer_graph_replays) > 0
    for entry in kept:
        copies, live = entry[:-1], entry[-1]
        for a, b in zip(copies, live):
            assert torch.equal(a, b)
