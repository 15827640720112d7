"""Parking (:mod:`hf_offload.cache.parking`) on the CPU: a collected cache's layers, buffers and graphs serve the next
cache of the same model and settings, which then replays instead of capturing.

CUDA graphs need a GPU (``tests/cache/test_cuda_parking.py``). Here the stand-in graphs of
``test_layer_graphs_cpu.py`` run the captured calls again at each replay. A stand-in of a whole layer gets the cache
that runs the step at replay time (a real graph holds no Python object), and the stand-in of a seal checks that it
replays on the buffers it was captured with.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache, release_parked
from hf_offload.cache import SUMMARY_CHUNK_BLOCKS, parked_bytes
from hf_offload.cache.capture import CapturedLayer, StaticInputs
from hf_offload.patches import installed

from ..helpers import build_model, left_padded
from .test_layer_graphs_cpu import SMALL, _assert_same_sealed_state, _stand_in_work, install_stand_ins

CAPTURES = ("graph_captures", "layer_graph_captures", "seal_graph_captures")
_RUNNING: dict = {}  # the cache of the forward running now (a stand-in replay calls the layer with it)


class _Running:
    """Stands for the cache argument in a stand-in graph (a real graph does not hold the cache)."""


def _stand_in_layer(layer):
    statics = StaticInputs()

    def capture(device, forward, args, kwargs, held):
        buffers, static_args, static_kwargs = statics.load(args, kwargs)
        static_kwargs = {k: _Running() if isinstance(v, OffloadCache) else v for k, v in static_kwargs.items()}
        mode = layer.graphs.layer_capture
        captured = CapturedLayer(graph=None, statics=buffers, inputs=statics, out=None, held=held)
        read = [*layer.blocks.summary_store.values(), layer.blocks.pool.data, layer.blocks.open_k]

        def run():
            now = [*layer.blocks.summary_store.values(), layer.blocks.pool.data, layer.blocks.open_k]
            assert all(a is b for a, b in zip(now, read)), "a layer replayed on new buffers"
            cache = _RUNNING["cache"]()
            call = {k: cache if isinstance(v, _Running) else v for k, v in static_kwargs.items()}
            layer.graphs.layer_capture = mode
            try:
                captured.out = forward(*static_args, **call)
            finally:
                layer.graphs.layer_capture = None

        captured.graph = type("Replay", (), {"replay": staticmethod(run)})()
        return captured

    return capture


@pytest.fixture
def graphs(monkeypatch):
    """Offloaded layers on the CPU capture and replay stand-in graphs; parked states are freed after the test."""
    before = OffloadCache.before_forward

    def before_forward(self, q_len, batch=None):
        _RUNNING["cache"] = weakref.ref(self)
        return before(self, q_len, batch)

    install_stand_ins(monkeypatch, _stand_in_layer, _stand_in_work)
    monkeypatch.setattr(OffloadCache, "before_forward", before_forward)
    yield
    release_parked()
    _RUNNING.clear()


def _generate(model, lengths=(70, 53, 31), seed=3, steps=24, inspect=None, **options):
    """Greedy tokens of a fresh cache and its stats (``inspect(cache)`` runs before the cache is let go of, which
    parks it: a parked layer holds no blocks)."""
    ids, mask = left_padded(list(lengths), seed=seed)
    cache = OffloadCache(model, **dict(SMALL, **options))
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False)  # fmt: skip
    if inspect is not None:
        inspect(cache)
    return out, cache.stats()


def _captures(stats) -> dict:
    return {name: int(stats[name]) for name in CAPTURES}


@pytest.mark.parametrize("capacity", [None, 8])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_next_cache_replays_the_parked_graphs_and_gives_the_tokens_of_a_fresh_one(arch, capacity, graphs):
    """Capacity 8: the 70-token prompts fill 8 blocks, so the first seal of the decode moves the steps to another
    block capacity (16): the graphs of both capacities are kept for the next cache."""
    model = build_model(arch)
    options = {} if capacity is None else {"decode_capacity_blocks": capacity}
    eager = {}
    expected, eager_stats = _generate(model, seed=4, cuda_graphs=False, inspect=lambda c: eager.update(cache=c),
                                      **options)  # fmt: skip
    eager = eager["cache"]  # held: parks nothing (no graphs) and keeps its blocks
    first, stats = _generate(model, seed=3, **options)
    assert all(v > 0 for v in _captures(stats).values())
    assert installed(model).parked is not None and parked_bytes(model) > 0
    held = [layer.blocks.host.used_blocks for layer in installed(model).parked.layers]
    assert held == [0] * len(held)  # a parked layer's blocks are freed (its tables stay)

    def same_state(cache):
        for layer in cache.offload_layers:
            _assert_same_sealed_state(layer, eager.layers[layer.layer_idx])

    # Other prompts of the same lengths: the same geometry, other contents.
    got, stats = _generate(model, seed=4, inspect=same_state, **options)
    assert stats["parking"] == "took a parked state"
    assert _captures(stats) == dict.fromkeys(CAPTURES, 0)
    assert int(stats["layer_graph_replays"]) > 0 and int(stats["seal_graph_replays"]) > 0
    assert torch.equal(got, expected)
    for name in ("recalled_blocks", "decode_recalled_blocks", "offloaded_bytes", "decode_steps", "host_kv_bytes"):
        assert stats[name] == eager_stats[name], name
    assert not torch.equal(first, got)


def test_a_cache_of_another_batch_or_other_settings_frees_the_parked_state(graphs):
    model = build_model("llama")
    _generate(model)
    got, stats = _generate(model, lengths=(70, 53))  # another batch: the parked state is freed before the prefill
    assert stats["parking"] == "freed a parked state: batch 2, not 3"
    assert all(v > 0 for v in _captures(stats).values())
    expected, _ = _generate(model, lengths=(70, 53), cuda_graphs=False)
    assert torch.equal(got, expected)
    _generate(model)
    assert installed(model).parked is not None
    got, stats = _generate(model, budget_tokens=40)  # other settings: the parked state is freed, not taken
    assert stats["parking"] == "freed a parked state: other settings (budget_tokens)"
    assert installed(model).parked is not None  # this cache's own, parked after it
    assert all(v > 0 for v in _captures(stats).values())
    expected, _ = _generate(model, budget_tokens=40, cuda_graphs=False)
    assert torch.equal(got, expected)


def test_a_closed_cache_parks_nothing_and_other_caches_free_the_parked_state(graphs):
    model = build_model("llama")
    ids, mask = left_padded([70, 53, 31], seed=3)
    with OffloadCache(model, **SMALL) as cache:
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False)
    del cache
    assert installed(model).parked is None
    _generate(model)
    assert installed(model).parked is not None
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache())
    assert installed(model).parked is None and parked_bytes(model) == 0
    _generate(model)
    assert release_parked(model) == 1 and installed(model).parked is None
    assert release_parked(model) == 0


def test_a_collected_cache_is_freed_at_once_and_parked_layers_follow_the_model(graphs):
    model = build_model("llama")
    ids, mask = left_padded([70, 53, 31], seed=3)
    cache = OffloadCache(model, **SMALL)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False)
    ref = weakref.ref(cache)
    layer = weakref.ref(cache.offload_layers[0])
    del cache
    assert ref() is None  # no cycle holds it: parked at once, not at the next collection
    assert layer() is not None and installed(model).parked is not None
    del model
    gc.collect()
    assert layer() is None  # the parked state goes with the model


def test_a_hook_added_or_removed_between_calls_is_not_replayed_from_the_parked_graphs(graphs):
    """A whole-layer graph runs what the layer's Python did at its capture, hooks included: a parked state whose
    model has gained or lost a hook since is freed, not taken."""
    model = build_model("llama")
    mlp = model.model.layers[1].mlp

    def shift(module, args, output):
        return output + 0.5

    expected_plain, _ = _generate(model, seed=4, cuda_graphs=False)
    handle = mlp.register_forward_hook(shift)
    expected_hooked, _ = _generate(model, seed=4, cuda_graphs=False)
    handle.remove()
    assert not torch.equal(expected_plain, expected_hooked)
    _generate(model, seed=3)  # parks, without the hook
    handle = mlp.register_forward_hook(shift)
    got, stats = _generate(model, seed=4)
    assert int(stats["layer_graph_captures"]) > 0 and torch.equal(got, expected_hooked)
    assert stats["parking"].startswith("freed a parked state: the model changed")
    handle.remove()
    got, stats = _generate(model, seed=4)
    assert int(stats["layer_graph_captures"]) > 0 and torch.equal(got, expected_plain)
    model.train()  # the training flag too
    _, stats = _generate(model, seed=4)
    assert int(stats["layer_graph_captures"]) > 0


@pytest.mark.parametrize("lengths", [(70, 53, 31), (20, 17, 9)])
def test_graphs_that_can_never_replay_again_do_not_pile_up_over_calls(lengths, graphs):
    """A block capacity of 2 blocks (and, for the short prompts, a budget that takes every block) changes the step's
    shapes at every other seal: each call captures anew past its entry geometry, and the graphs keyed by step inputs
    no longer kept are dropped when the next cache takes the layers, so the parked graphs stay as many from call to
    call."""
    model = build_model("llama")
    counts = []

    def count(cache):
        counts.append(sum(len(layer.graphs.graphs) for layer in cache.offload_layers))

    for call in range(6):
        _generate(model, lengths=lengths, seed=call, steps=24, inspect=count, decode_capacity_blocks=2)
    assert max(counts[2:]) <= max(counts[:2]), counts


@pytest.mark.parametrize("blocks", [SUMMARY_CHUNK_BLOCKS, SUMMARY_CHUNK_BLOCKS - 1])
def test_graphs_of_buffers_replaced_since_are_dropped_and_the_next_call_captures_nothing(blocks, graphs):
    """Prompts that fill the summary buffers (a multiple of ``SUMMARY_CHUNK_BLOCKS`` blocks: they grow before the
    first decode step's capture) or that fill them at the first seal of the decode (one block less: they grow at
    the step after it, so the first call's entry graphs read buffers that are gone from the layer). The next cache
    drops the graphs of the old buffers when it takes the layers, and captures nothing."""
    model = build_model("llama")
    tokens = blocks * SMALL["block_tokens"]
    epochs = []

    def keyed_epochs(cache):
        for layer in cache.offload_layers:
            now = layer.blocks.storage_key()[:2]
            keys = [k[2] if k[1] == "layer" else (k[1] if k[0] == "seal" else k) for k in layer.graphs.graphs]
            epochs.append({(key[6] if len(key) > 6 else key)[:2] == now for key in keys})

    _generate(model, lengths=(tokens,), seed=3, steps=12, inspect=keyed_epochs)
    assert all(found == ({True} if blocks == SUMMARY_CHUNK_BLOCKS else {True, False}) for found in epochs), epochs
    epochs.clear()
    _, stats = _generate(model, lengths=(tokens,), seed=4, steps=12, inspect=keyed_epochs)
    assert all(found == {True} for found in epochs), epochs
    captured = _captures(stats)
    if blocks < SUMMARY_CHUNK_BLOCKS:  # the first call sealed only over the old buffers: one seal graph per layer
        assert captured.pop("seal_graph_captures") <= 2
    assert captured == dict.fromkeys(captured, 0)
