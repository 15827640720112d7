"""Lookahead inside the graphs of whole decoder layers, on the CPU: a stand-in graph runs the captured call again
at each replay (``tests/cache/test_layer_graphs_cpu.py``), so the prefetch that a layer's graph starts for the next
layer (from the predicted query or from its own) runs at every replayed step. It never changes what is attended:
the tokens and the sealed state are those of the cache without lookahead and without graphs. CUDA graphs with the
prefetch stream forked and joined inside them: ``tests/cache/test_cuda_graphs.py``."""

from __future__ import annotations

import pytest
import torch

from .test_layer_graphs_cpu import _assert_same_sealed_state, _generate
from .test_layer_graphs_cpu import seal_capture_fails, stand_in_graphs  # noqa: F401  (fixtures)


def _prefetched(cache) -> list[int]:
    return [int(layer.stats.prefetched_blocks) for layer in cache.offload_layers]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("query", ["next", "same"])
def test_replayed_layers_prefetch_for_the_next_and_give_the_tokens_of_op_by_op(arch, query, stand_in_graphs):  # noqa: F811
    from ..helpers import build_model

    model = build_model(arch)
    steps = 40
    expected, eager = _generate(model, steps, cuda_graphs=False)
    got, graphed = _generate(model, steps, cuda_graphs=None, lookahead=True, lookahead_query=query)
    assert torch.equal(got, expected)
    layers = graphed.offload_layers
    assert all(layer.execution.graphs and layer.execution.lookahead for layer in layers)
    replays = [int(layer.stats.layer_graph_replays) for layer in layers]
    assert all(r > 0 for r in replays), replays
    for layer in layers:
        _assert_same_sealed_state(layer, eager.layers[layer.layer_idx])
    # Every offloaded layer but the first is prefetched for; the guesses come from the previous layer's graph, and
    # the replayed steps count the guesses they use as the steps run op by op do.
    counts = _prefetched(graphed)
    assert counts[0] == 0 and all(c > 0 for c in counts[1:]), counts
    _, op_by_op = _generate(model, steps, cuda_graphs=False, lookahead=True, lookahead_query=query)
    a, b = graphed.stats(), op_by_op.stats()
    assert a["prefetch_used_blocks"] > 0
    for name in ("prefetched_blocks", "prefetch_used_blocks", "hit_rate", "decode_recalled_blocks"):
        assert a[name] == b[name], (name, a[name], b[name])


def test_the_graph_keeps_prefetching_for_the_next_layer_at_every_replay(stand_in_graphs, monkeypatch):  # noqa: F811
    """Counted per replay: with the prefetch left out of the layer graphs, the replayed steps prefetch nothing."""
    from hf_offload.cache.graphs import GraphRunner

    from ..helpers import build_model

    model = build_model("llama")
    _, with_ahead = _generate(model, 40, cuda_graphs=None, lookahead=True)
    monkeypatch.setattr(GraphRunner, "_with_lookahead", lambda self, forward, *rest: forward)
    _, without = _generate(model, 40, cuda_graphs=None, lookahead=True, lookahead_query="next")
    ahead, plain = _prefetched(with_ahead), _prefetched(without)
    # Without it only the steps run op by op prefetch (eagerly, before the graphs exist).
    assert all(a > p for a, p in zip(ahead[1:], plain[1:])), (ahead, plain)


def test_at_the_whole_context_budget_the_graphs_prefetch_as_op_by_op(stand_in_graphs):  # noqa: F811
    """Every block attended: the graphs still plan the next layer (select all) and give the counts of op by op."""
    from ..helpers import TINY_BLOCKS, build_model, left_padded

    model = build_model("llama")
    ids, mask = left_padded([70, 53, 31], seed=3)
    runs = {}
    for name, graphs in (("op_by_op", False), ("graphs", None)):
        from hf_offload import OffloadCache

        cache = OffloadCache(model, **dict(TINY_BLOCKS, budget_tokens=4096, pool_tokens=256, decode_capacity_blocks=64),
                             cuda_graphs=graphs,
                             lookahead=True)  # fmt: skip
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=30,
                                 min_new_tokens=30, do_sample=False)  # fmt: skip
        runs[name] = (out, cache)
    assert torch.equal(runs["graphs"][0], runs["op_by_op"][0])
    a, b = runs["graphs"][1].stats(), runs["op_by_op"][1].stats()
    assert all(int(layer.stats.layer_graph_replays) > 0 for layer in runs["graphs"][1].offload_layers)
    for name in ("prefetched_blocks", "prefetch_used_blocks", "decode_recalled_blocks"):
        assert a[name] == b[name], (name, a[name], b[name])


def test_a_layer_whose_capture_with_the_prefetch_fails_keeps_its_graph_without_it(stand_in_graphs, monkeypatch):  # noqa: F811
    """Where the next layer's prefetch cannot be captured, the layer warns once and captures itself without it
    (its graphs stay whole-layer ones; lookahead runs only in steps op by op); the tokens do not change."""
    from hf_offload.cache import OffloadLayer

    from ..helpers import build_model

    resolve = OffloadLayer.resolve

    def failing_with_prefetch(self):
        resolve(self)
        capture = self.graphs._capture_layer

        def capture_layer(device, forward, args, kwargs, held):
            if self.layer_idx == 0 and forward.__name__ == "forward_with_lookahead":
                raise RuntimeError("operation not permitted when stream is capturing")
            return capture(device, forward, args, kwargs, held)

        self.graphs._capture_layer = capture_layer

    monkeypatch.setattr(OffloadLayer, "resolve", failing_with_prefetch)
    model = build_model("llama")
    expected, _ = _generate(model, 40, cuda_graphs=False)
    with pytest.warns(RuntimeWarning, match="capturing the next layer's prefetch") as caught:
        got, cache = _generate(model, 40, cuda_graphs=None, lookahead=True)
    assert sum("capturing the next layer's prefetch" in str(w.message) for w in caught) == 1
    assert torch.equal(got, expected)
    first, second = cache.offload_layers
    assert not first.graphs.ahead_graphs and first.graphs.layer_graphs
    assert int(first.stats.layer_graph_replays) > 0
