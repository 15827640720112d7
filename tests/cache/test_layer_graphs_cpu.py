"""The routing of decoder-layer calls through the cache (``graph_scope="layer"``), on the CPU.

CUDA graphs need a GPU (``tests/test_layer_graphs.py``). Here a stand-in "graph" records the call at capture time and
runs it again at each replay, in the mode a capture records (the token written at the step's ``open_pos``, the
attention's fused step with the planned geometry), so that everything the host does around a replay is exercised:
which calls are served, the static input buffers, the host-side state after a replay (token count, open block, a
seal after the replay), the counters, and the fallback when a capture fails.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache, disable_offload_attention
from hf_offload.cache import GRAPH_CAPACITY_BLOCKS, OffloadLayer
from hf_offload.cache.capture import CapturedDecode, CapturedLayer, CapturedWork, StaticInputs, call_signature
from hf_offload.patches.layers import DecoderLayerCall, decoder_layers, install_layer_calls, remove_layer_calls

from ..helpers import TINY_SPARSE, build_model, left_padded

SMALL = dict(TINY_SPARSE, decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS)
COUNTERS = ("recalled_blocks", "recalled_bytes", "decode_recalled_blocks", "offloaded_bytes", "decode_steps",
            "hit_rate", "host_kv_bytes", "device_kv_bytes")  # fmt: skip


class _Replay:
    def __init__(self, run):
        self.run = run

    def replay(self):
        self.run()


def _stand_in_attention(device, body, query, held):
    static = query.clone()
    captured = CapturedDecode(graph=None, query=static, out=None, held=held)

    def run():
        captured.out = body(static)

    captured.graph = _Replay(run)
    return captured


def _buffers_read(layer) -> list:
    """The buffers a captured seal of ``layer`` reads and writes in place (a real graph keeps reading the ones it
    was captured with)."""
    found = list(layer.blocks.summary_store.values())
    if layer.execution.use_kernels:
        found += [layer.blocks.block_table_dev, layer.blocks.host._chunk_addrs]
    return found


def _stand_in_work(layer, fail_layers=()):
    def capture(device, enqueue, held):
        if layer.layer_idx in fail_layers:
            raise RuntimeError("operation not permitted when stream is capturing")
        captured = CapturedWork(graph=None, out=None, held=held)
        read = _buffers_read(layer)

        def run():
            now = _buffers_read(layer)
            assert len(now) == len(read) and all(a is b for a, b in zip(now, read)), "a seal replayed on new buffers"
            captured.out = enqueue()

        captured.graph = _Replay(run)
        return captured

    return capture


def _stand_in_layer(layer, fail_layers=()):
    statics = StaticInputs()

    def capture(device, forward, args, kwargs, held, pad=None):
        if layer.layer_idx in fail_layers:
            raise RuntimeError("operation not permitted when stream is capturing")
        buffers, static_args, static_kwargs = statics.load(args, kwargs, pad=pad)
        mode = layer.graphs.layer_capture  # what the capture records: run again in that mode at each replay
        captured = CapturedLayer(graph=None, statics=buffers, inputs=statics, out=None, held=held)

        def run():
            layer.graphs.layer_capture = mode
            # A question's replay changes no counter on the host (the runner adds what one call counts).
            totals = layer.stats.totals_snapshot() if pad is not None else None
            try:
                captured.out = forward(*static_args, **static_kwargs)
            finally:
                layer.graphs.layer_capture = None
                if totals is not None:
                    layer.stats.restore_totals(totals)

        captured.graph = _Replay(run)
        return captured

    return capture


@pytest.fixture
def seal_capture_fails():
    """The set of layer indices whose capture of a seal fails (with :func:`stand_in_graphs`)."""
    return set()


@pytest.fixture
def stand_in_graphs(monkeypatch, seal_capture_fails):
    """Offloaded layers on the CPU replay stand-in graphs; returns the set of layer indices whose whole-layer capture
    fails."""
    fail: set[int] = set()
    install_stand_ins(monkeypatch, lambda layer: _stand_in_layer(layer, fail),
                      lambda layer: _stand_in_work(layer, seal_capture_fails))  # fmt: skip
    return fail


def install_stand_ins(monkeypatch, capture_layer, capture_work) -> None:
    """Offloaded layers on the CPU capture stand-in graphs where graphs are not off: the attention's
    (:func:`_stand_in_attention`), the whole layer's (``capture_layer(layer)``) and the seal's
    (``capture_work(layer)``)."""
    resolve = OffloadLayer.resolve

    def resolve_with_graphs(self):
        resolve(self)
        if self.config.cuda_graphs is not False:
            self.execution.graphs = True
            self.execution.capacity_blocks = self.config.decode_capacity_blocks
            self.graphs._capture_graph = _stand_in_attention
            self.graphs._capture_layer = capture_layer(self)
            self.graphs._capture_work = capture_work(self)

    monkeypatch.setattr(OffloadLayer, "resolve", resolve_with_graphs)


def _generate(model, steps, seed=3, **options):
    ids, mask = left_padded([70, 53, 31], seed=seed)
    cache = OffloadCache(model, **SMALL, **options)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False)  # fmt: skip
    return out, cache


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("selector", ["quantkey", "solohead"])
def test_replayed_layers_give_the_tokens_and_counters_of_op_by_op(arch, selector, stand_in_graphs):
    model = build_model(arch)
    steps = 40  # five seals of 8-token blocks
    expected, eager = _generate(model, steps, selector=selector, cuda_graphs=False)
    got, graphed = _generate(model, steps, selector=selector, cuda_graphs=None)
    assert torch.equal(got, expected)
    a, b = eager.stats(), graphed.stats()
    for name in COUNTERS:
        assert a[name] == b[name], name
    # The accuracy certificate, pooled and per sequence, recorded by replayed steps as by steps run op by op.
    cert, replayed = a["missed_mass"], b["missed_mass"]
    assert replayed["steps"] == cert["steps"] and replayed["mean"] == pytest.approx(cert["mean"])
    assert len(cert["per_sequence"]["mean"]) == 3
    assert replayed["per_sequence"]["mean"] == pytest.approx(cert["per_sequence"]["mean"])
    assert replayed["per_sequence"]["max"] == pytest.approx(cert["per_sequence"]["max"])
    for layer in graphed.offload_layers:
        # Of the steps - 1 decode steps (the prefill gives the first token) the first captures the attention, the
        # next the layer; every later step replays it, the steps that seal a block included, except where a seal
        # changed the buffers the graphs read (a new host chunk: the attention is captured again, then the layer).
        # So each capture of the layer costs one step or two: two where a seal came between the attention's capture
        # and the layer's (here the torch transfer path's seal at the second decode step changes the attention's
        # buffers, the kernel path's, under Triton's interpreter, does not).
        captures = int(layer.stats.layer_graph_captures)
        assert 1 <= captures <= 2
        decode_steps = steps - 1
        assert decode_steps - 2 * captures <= int(layer.stats.layer_graph_replays) <= decode_steps - captures
        assert layer.n_tokens == eager.layers[layer.layer_idx].n_tokens
        assert layer.n_blocks == eager.layers[layer.layer_idx].n_blocks
        torch.testing.assert_close(layer.keys, eager.layers[layer.layer_idx].keys, rtol=0, atol=0)
        _assert_same_sealed_state(layer, eager.layers[layer.layer_idx])
        # The seals after replayed steps: the first op by op, the later ones from a captured seal (a seal that grew
        # the host pool changed the buffers it writes: captured again).
        assert int(layer.stats.seal_graph_captures) >= 1
        assert int(layer.stats.seal_graph_replays) >= 2


def _generate_with_warnings(model, steps, **options):
    """:func:`_generate`, and the messages of every warning it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, cache = _generate(model, steps, **options)
    return got, cache, [str(w.message) for w in caught]


def _assert_same_sealed_state(layer, eager):
    """Every summary, the block tables and the stored blocks of ``layer`` equal ``eager``'s."""
    assert layer.blocks.summaries.keys() == eager.blocks.summaries.keys()
    for name, summary in eager.blocks.summaries.items():
        assert torch.equal(layer.blocks.summaries[name], summary), name
    assert torch.equal(layer.blocks.block_table, eager.blocks.block_table)
    if layer.execution.use_kernels:
        n = layer.n_blocks
        assert torch.equal(layer.blocks.block_table_dev[:, :n], eager.blocks.block_table_dev[:, :n])
    ids = layer.blocks.block_table.flatten()
    assert torch.equal(layer.blocks.host.read(ids), eager.blocks.host.read(ids))


def test_a_seal_that_cannot_be_captured_warns_once_and_seals_op_by_op(stand_in_graphs, seal_capture_fails):
    model = build_model("llama")
    expected, eager = _generate(model, 40, cuda_graphs=False)
    seal_capture_fails.add(0)
    got, cache, messages = _generate_with_warnings(model, 40, cuda_graphs=None)
    assert torch.equal(got, expected)
    assert sum("capturing the seal of a block" in m for m in messages) == 1
    first, second = cache.offload_layers
    assert not first.graphs.seal_graphs and int(first.stats.seal_graph_replays) == 0
    assert second.graphs.seal_graphs and int(second.stats.seal_graph_replays) >= 2
    assert int(first.stats.layer_graph_replays) > 0  # the layer itself still replays
    for layer in cache.offload_layers:
        _assert_same_sealed_state(layer, eager.layers[layer.layer_idx])


def test_attention_scope_replays_no_layer(stand_in_graphs):
    model = build_model("llama")
    expected, _ = _generate(model, 20, cuda_graphs=False)
    got, cache = _generate(model, 20, cuda_graphs=None, graph_scope="attention")
    assert torch.equal(got, expected)
    assert all(int(layer.stats.layer_graph_replays) == 0 for layer in cache.offload_layers)
    assert all(int(layer.stats.graph_replays) > 0 for layer in cache.offload_layers)


def test_a_layer_that_cannot_be_captured_warns_once_and_keeps_its_attention_graph(stand_in_graphs):
    model = build_model("llama")
    expected, _ = _generate(model, 24, cuda_graphs=False)
    stand_in_graphs.add(1)
    got, cache, messages = _generate_with_warnings(model, 24, cuda_graphs=None)
    assert torch.equal(got, expected)
    assert sum("capturing the whole decoder layer" in m for m in messages) == 1
    first, second = cache.offload_layers
    assert first.graphs.layer_graphs and not second.graphs.layer_graphs
    assert int(second.stats.layer_graph_replays) == 0 and int(second.stats.graph_replays) > 0
    assert int(first.stats.layer_graph_replays) > 0


def test_replayed_outputs_are_copies_and_inputs_are_copied_once_per_object():
    statics = StaticInputs()
    x, cos = torch.randn(2, 1, 4), torch.randn(2, 1, 8)
    buffers, args, kwargs = statics.load((x,), {"position_embeddings": (cos, cos), "flag": True})
    assert args[0] is buffers[0] and torch.equal(args[0], x) and kwargs["flag"] is True
    assert kwargs["position_embeddings"][0] is not cos and torch.equal(kwargs["position_embeddings"][0], cos)
    cos.add_(1)  # the same object again is not copied again (one tensor per forward serves every layer)
    again, _, kwargs2 = statics.load((torch.randn(2, 1, 4),), {"position_embeddings": (cos, cos), "flag": True})
    assert all(b is a for a, b in zip(buffers[:3], again[:3])) and again[3] is None  # same buffers; no tensor
    assert not torch.equal(kwargs2["position_embeddings"][0], cos)
    fresh = cos.clone()
    statics.load((x,), {"position_embeddings": (fresh, fresh), "flag": True})
    assert torch.equal(kwargs2["position_embeddings"][0], fresh)  # a new object is copied into the same buffer
    base = call_signature((x,), {"flag": True})
    assert call_signature((x,), {"flag": True}) == base
    assert call_signature((torch.randn(3, 1, 4),), {"flag": True}) != base
    assert call_signature((x,), {"flag": False}) != base
    assert call_signature((x.double(),), {"flag": True}) != base


def test_routing_is_installed_once_and_removed_with_the_offload_attention():
    model = build_model("qwen2")
    n = model.config.num_hidden_layers
    OffloadCache(model, **SMALL)
    OffloadCache(model, **SMALL)
    layers = decoder_layers(model)
    assert [idx for _, idx in layers] == list(range(n))
    calls = [module.__dict__.get("forward") for module, _ in layers]
    assert all(isinstance(call, DecoderLayerCall) for call in calls)
    assert all(not isinstance(call.original, DecoderLayerCall) for call in calls)  # not wrapped twice
    ids, mask = left_padded([12, 9], seed=1)
    with torch.no_grad():
        dense = model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config)).logits
    disable_offload_attention(model)
    assert all("forward" not in module.__dict__ for module, _ in layers)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config)).logits
    assert torch.equal(dense, plain)  # with another cache the routed layers ran their own forward
    assert install_layer_calls(model) == n
    remove_layer_calls(model)
    assert all("forward" not in module.__dict__ for module, _ in layers)


def test_asked_for_graphs_with_a_slot_pool_smaller_than_the_selection_warn_once(monkeypatch):
    """``cuda_graphs=True`` with a slot pool that cannot hold a step's selection: those steps run in rounds, op by op,
    and the cache says so once; with the default pool the same steps replay."""
    resolve = OffloadLayer.resolve

    def resolve_as_asked(self):
        resolve(self)
        self.execution.graphs = True
        self.execution.capacity_blocks = GRAPH_CAPACITY_BLOCKS
        self.graphs._capture_graph = _stand_in_attention
        self.graphs._capture_layer = _stand_in_layer(self)
        self.graphs._capture_work = _stand_in_work(self)
        self.graphs.config = self.config.replace(cuda_graphs=True)  # as asked for on a GPU

    monkeypatch.setattr(OffloadLayer, "resolve", resolve_as_asked)
    model = build_model("llama")
    ids, mask = left_padded([70, 53], seed=3)
    for pool, warns in ((16, True), (None, False)):
        cache = OffloadCache(model, **dict(TINY_SPARSE, pool_tokens=pool))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                               min_new_tokens=12, do_sample=False)  # fmt: skip
        said = [w for w in caught if "slot pool holds" in str(w.message)]
        assert len(said) == (1 if warns else 0), [str(w.message) for w in said]
        stats = cache.stats()
        assert (stats["graph_replays"] > 0) != warns
        assert stats["layer_graph_replays"] == sum(int(layer.stats.layer_graph_replays) for layer in cache.offload_layers)
        assert (stats["layer_graph_replays"] > 0) != warns and stats["layer_graph_captures"] <= stats["graph_captures"]
