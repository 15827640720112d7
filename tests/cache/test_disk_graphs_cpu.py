"""Captured decode steps with a disk tier, on the CPU: the host's reads from disk sit between two graphs.

A capture that the captured code splits with :func:`~hf_offload.cache.capture.between_graphs` becomes a
:class:`~hf_offload.cache.capture.SegmentedGraph` (checked here with a stand-in for ``torch.cuda.CUDAGraph``), and a
cache with blocks on disk replaying stand-in graphs (``tests/cache/test_layer_graphs_cpu.py``) gives the tokens,
selections and counters of the same cache op by op. Real graphs: ``tests/cache/test_cuda_lifecycle.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from hf_offload import OffloadCache
from hf_offload.cache import GRAPH_CAPACITY_BLOCKS, capture

from ..helpers import TINY_SPARSE, build_model, left_padded
from .test_disk_tier import DISK, _generate, _recorded
from .test_layer_graphs_cpu import seal_capture_fails, stand_in_graphs  # noqa: F401 (fixtures)


class _Graph:
    """Stands in for ``torch.cuda.CUDAGraph``: records what a capture does into ``log``."""

    def __init__(self, log: list, state: dict):
        self.log, self.state, self.name = log, state, f"g{len(state['graphs'])}"
        state["graphs"].append(self)

    def capture_begin(self, pool=None):
        self.state["capturing"] = self
        self.log.append(("begin", self.name, pool))

    def capture_end(self):
        assert self.state["capturing"] is self, "capture_end on a graph that is not capturing"
        self.state["capturing"] = None
        self.log.append(("end", self.name))

    def pool(self):
        return ("pool of", self.name)

    def replay(self):
        self.log.append(("replay", self.name))


@pytest.fixture
def fake_cuda(monkeypatch):
    """``torch.cuda`` as far as a capture uses it, recording into the returned list."""
    log: list = []
    state = {"graphs": [], "capturing": None}
    stream = type("Stream", (), {"wait_stream": lambda self, other: None})()
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: _Graph(log, state))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"] is not None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    return log


def test_host_work_outside_a_capture_runs_at_once():
    ran = []
    capture.between_graphs(lambda: ran.append(1))
    assert ran == [1]


def test_a_capture_split_by_host_work_replays_its_graphs_with_the_work_between(fake_cuda):
    log = fake_cuda

    def enqueue():
        log.append("first part")
        capture.between_graphs(lambda: log.append("host work"))
        log.append("second part")
        capture.between_graphs(lambda: log.append("more host work"))
        return "out"

    captured = capture.capture_work(enqueue, torch.device("cpu"), "pool", held=())
    assert captured.out == "out"
    # The work is not run while capturing; each split ends a graph and begins the next in the same memory pool.
    assert log == [("begin", "g0", "pool"), "first part", ("end", "g0"),
                   ("begin", "g1", "pool"), "second part", ("end", "g1"), ("begin", "g2", "pool"),
                   ("end", "g2")]  # fmt: skip
    assert isinstance(captured.graph, capture.SegmentedGraph) and len(captured.graph.graphs) == 3
    assert not capture._CAPTURING
    log.clear()
    captured.graph.replay()
    assert log == [("replay", "g0"), "host work", ("replay", "g1"), "more host work", ("replay", "g2")]


def test_a_capture_without_host_work_is_one_graph_and_a_split_without_a_pool_shares_the_first_graphs(fake_cuda):
    plain = capture.capture_work(lambda: None, torch.device("cpu"), None, held=())
    assert not isinstance(plain.graph, capture.SegmentedGraph)
    fake_cuda.clear()
    capture.capture_work(lambda: capture.between_graphs(lambda: None), torch.device("cpu"), None, held=())
    begins = [entry for entry in fake_cuda if entry[0] == "begin"]
    assert begins[0][2] is None and begins[1][2] == ("pool of", begins[0][1])


def test_a_capture_that_fails_after_a_split_ends_its_current_graph_and_raises(fake_cuda):
    def enqueue():
        capture.between_graphs(lambda: None)
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="not permitted"):
        capture.capture_work(enqueue, torch.device("cpu"), "pool", held=())
    ends = [entry for entry in fake_cuda if entry[0] == "end"]
    assert ends[:2] == [("end", "g0"), ("end", "g1")]  # then the empty capture that releases the generator
    assert not capture._CAPTURING


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("selector", ["quantkey[bits=4,tail_bits=2,tail_near=3]", "solohead"])
def test_replayed_steps_with_blocks_on_disk_select_and_count_as_op_by_op(stand_in_graphs, tmp_path, selector,
                                                                         lookahead):  # fmt: skip
    """The whole layer replayed (stand-in graphs) with most sealed blocks on disk: the tokens, every plan's
    selection and the counters of the same cache run op by op, blocks read from disk, and the blocks ranked below
    each selection staged (``disk_stage_near``); with lookahead, its prefetch inside the layer's graph stages the
    next layer's blocks on disk and counts as op by op."""
    model = build_model("llama")
    ids, mask = left_padded([140, 101], seed=21)
    settings = dict(TINY_SPARSE, selector=selector, decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS,
                    disk_stage_near=2, lookahead=lookahead, **dict(DISK, disk_staging_chunks=8))  # fmt: skip
    runs = {}
    for graphs in (False, None):
        directory = tmp_path / str(graphs)
        directory.mkdir()
        cache = OffloadCache(model, **settings, cuda_graphs=graphs, disk_dir=directory)
        runs[graphs] = (*_recorded(lambda: _generate(model, ids, mask, cache, new_tokens=20)), cache)
    (expected, chosen, eager), (got, chosen_graphed, graphed) = runs[False], runs[None]
    assert torch.equal(got, expected) and chosen_graphed == chosen
    a, b = eager.stats(), graphed.stats()
    # (How many blocks come from disk depends on how far the staging threads got: not compared.)
    for name in ("recalled_blocks", "decode_recalled_blocks", "hit_rate", "decode_steps", "disk_kv_bytes",
                 "prefetched_blocks", "prefetch_used_blocks"):  # fmt: skip
        assert a[name] == b[name], (name, a[name], b[name])
    if lookahead:  # the first layer's graphs prefetch for the second
        assert b["prefetched_blocks"] > 0 and b["prefetch_used_blocks"] > 0
        first = graphed.offload_layers[0].graphs.graphs
        assert any(key[1:2] == ("layer",) and key[4] is not None for key in first)
    assert b["disk_kv_bytes"] > b["host_kv_bytes"] > 0 and b["disk_read_blocks"] > 0
    assert b["disk_staged_ahead_blocks"] > 0
    assert all(int(layer.stats.layer_graph_replays) > 0 for layer in graphed.offload_layers)
    eager.close()
    graphed.close()


@pytest.mark.parametrize("cuda_graphs, expected", [(None, True), (True, True), (False, False)])
def test_graphs_with_a_disk_tier_follow_cuda_graphs_as_without_one(tmp_path, cuda_graphs, expected):
    """With a disk tier a layer on CUDA with the kernel path replays graphs by default (and with True); False keeps
    it op by op; timing turns them off as without a disk tier."""
    from hf_offload.cache.execution import LayerExecution, resolve
    from hf_offload.config import OffloadConfig

    for disk_dir in (None, str(tmp_path)):
        tier = {} if disk_dir is None else {"disk_dir": disk_dir, "host_memory_gib": 1.0}
        config = OffloadConfig(budget_tokens=64, cuda_graphs=cuda_graphs, **tier)
        execution = LayerExecution(use_kernels=True)
        resolve(execution, config, torch.device("cuda"), False)
        assert execution.graphs is expected
        execution = LayerExecution(use_kernels=True)
        resolve(execution, OffloadConfig(budget_tokens=64, timing=True, **tier), torch.device("cuda"), False)
        assert execution.graphs is False
