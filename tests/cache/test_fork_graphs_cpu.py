"""A fork refilled for the next questions (``fork(into=...)``) replays the graphs its earlier answers captured
(stand-in graphs on the CPU: see ``tests/cache/test_layer_graphs_cpu.py``), while a new fork captures its own; both
give the same tokens."""

from __future__ import annotations

import torch

from hf_offload import OffloadCache

from ..helpers import build_model, left_padded
from .test_layer_graphs_cpu import SMALL
from .test_layer_graphs_cpu import seal_capture_fails, stand_in_graphs  # noqa: F401  (fixtures)

DOCUMENT, QUESTION, NEW = 150, 6, 12


def test_a_refilled_fork_replays_the_graphs_of_its_earlier_answers(stand_in_graphs):  # noqa: F811
    model = build_model("llama")
    document, _ = left_padded([DOCUMENT] * 2, seed=3)
    prefix = OffloadCache(model, **SMALL)
    with torch.no_grad():
        model(input_ids=document, attention_mask=torch.ones_like(document), past_key_values=prefix)

    def answer(cache, seed):
        questions = left_padded([QUESTION] * 2, seed=seed)[0]
        ids = torch.cat([document, questions], dim=1)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)  # fmt: skip
        return out, cache.stats()

    reused = prefix.fork()
    layers = len(reused.offload_layers)
    for seed in (1, 2, 3):
        expected, new = answer(prefix.fork(), seed)
        assert new["layer_graph_captures"] > 0  # a new fork captures its own graphs
        cache = reused if seed == 1 else prefix.fork(into=reused)
        assert cache is reused
        got, stats = answer(cache, seed)
        assert torch.equal(got, expected)
        if seed == 1:
            assert stats["layer_graph_captures"] == new["layer_graph_captures"]
        else:  # the refilled fork replays what it captured for the first question
            assert stats["layer_graph_captures"] == 0
            assert stats["layer_graph_replays"] >= (NEW - 2) * layers
    assert all(layer.execution.graphs for layer in reused.offload_layers)
