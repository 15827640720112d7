"""A loaded cache decodes through graphs as the cache it was saved from does (stand-in graphs on the CPU: see
``tests/cache/test_layer_graphs_cpu.py``): its continuation captures and replays whole-layer graphs and gives the
uninterrupted cache's tokens."""

from __future__ import annotations

import torch

from hf_offload import OffloadCache

from ..helpers import build_model, left_padded
from .test_layer_graphs_cpu import SMALL
from .test_layer_graphs_cpu import seal_capture_fails, stand_in_graphs  # noqa: F401  (fixtures)


def test_a_loaded_cache_continues_through_graphs(tmp_path, stand_in_graphs):  # noqa: F811
    model = build_model("llama")
    ids, mask = left_padded([70, 53, 31], seed=3)
    cache = OffloadCache(model, **SMALL)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8,
                             min_new_tokens=8, do_sample=False)  # fmt: skip
    cache.save(tmp_path / "cache.safetensors")
    loaded = OffloadCache.load(tmp_path / "cache.safetensors", model)
    mask = torch.cat([mask, torch.ones(mask.shape[0], out.shape[1] - ids.shape[1], dtype=mask.dtype)], dim=1)
    cache.reset_stats()
    runs = {}
    for name, c in (("uninterrupted", cache), ("loaded", loaded)):
        with torch.no_grad():
            runs[name] = model.generate(input_ids=out, attention_mask=mask, past_key_values=c, max_new_tokens=24,
                                        min_new_tokens=24, do_sample=False)  # fmt: skip
    assert torch.equal(runs["loaded"], runs["uninterrupted"])
    a, b = cache.stats(), loaded.stats()
    layers = len(loaded.offload_layers)
    assert a["decode_steps"] == b["decode_steps"] == 24  # per step of the cache; graph counts are per layer
    # The loaded cache captures its graphs afresh (the saved one still holds its own), then replays them.
    assert a["layer_graph_captures"] == 0 < b["layer_graph_captures"] <= 2 * layers
    assert b["layer_graph_replays"] >= 24 * layers - 2 * layers
    assert all(layer.execution.graphs for layer in loaded.offload_layers)
    cache.close()
    loaded.close()
