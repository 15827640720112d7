"""Replayed decode steps with blocks on disk through the kernel transfer path, on Triton's CPU interpreter
(``TRITON_INTERPRET=1``) with the stand-in graphs of ``tests/cache/test_layer_graphs_cpu.py``: the host reads the
step's entries on disk between the plan and the copy kernel, which moves the rest; the tokens, selections and
counters of the same cache op by op and of the cache without a disk tier."""

from __future__ import annotations

import pytest
import torch

from hf_offload import OffloadCache
from hf_offload.cache import GRAPH_CAPACITY_BLOCKS
from hf_offload.cache.recaller import Recaller
from hf_offload.kernels.gather import kernels_available

from ..cache.test_disk_tier import DISK, _generate, _recorded
from ..cache.test_layer_graphs_cpu import seal_capture_fails, stand_in_graphs  # noqa: F401 (fixtures)
from ..helpers import TINY_SPARSE, build_model, left_padded

# The stand-in graphs run on the CPU: Triton's interpreter, not Triton on CUDA.
pytestmark = [pytest.mark.triton, pytest.mark.skipif(not kernels_available(torch.device("cpu")),
                                                    reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)")]


@pytest.mark.parametrize("lookahead", [False, True])
def test_replayed_steps_read_their_blocks_on_disk_between_plan_and_copy(stand_in_graphs, tmp_path, monkeypatch,
                                                                        lookahead):  # fmt: skip
    """With lookahead the first layer's graph also plans the second layer's step and stages its blocks on disk."""
    model = build_model("llama")
    ids, mask = left_padded([120, 90], seed=22)
    settings = dict(TINY_SPARSE, selector="solohead", transfer="kernel", admission="always", disk_stage_near=2,
                    decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS, lookahead=lookahead)  # fmt: skip
    spilled_reads = []
    read = Recaller._recall_spilled
    monkeypatch.setattr(Recaller, "_recall_spilled", lambda self, ids, *rest: spilled_reads.append(
        int((ids >= 0).sum())) or read(self, ids, *rest))  # fmt: skip
    memory = OffloadCache(model, **settings, cuda_graphs=False)
    expected, chosen = _recorded(lambda: _generate(model, ids, mask, memory, new_tokens=12))
    runs = {}
    for graphs in (False, None):
        directory = tmp_path / str(graphs)
        directory.mkdir()
        cache = OffloadCache(model, **settings, **dict(DISK, disk_staging_chunks=8), cuda_graphs=graphs,
                             disk_dir=directory)  # fmt: skip
        runs[graphs] = (*_recorded(lambda: _generate(model, ids, mask, cache, new_tokens=12)), cache)
    for got, selections, cache in runs.values():
        assert torch.equal(got, expected) and selections == chosen
        stats = cache.stats()
        assert stats["disk_kv_bytes"] > stats["host_kv_bytes"] > 0 and stats["disk_read_blocks"] > 0
        # With lookahead, blocks on disk are staged instead of prefetched: counted against the cache op by op.
        reference = runs[False][2] if lookahead else memory
        for name in ("recalled_blocks", "decode_recalled_blocks", "hit_rate", "decode_steps", "prefetched_blocks"):
            assert stats[name] == reference.stats()[name], name
    graphed = runs[None][2]
    assert all(layer.execution.use_kernels for layer in graphed.offload_layers)
    assert all(int(layer.stats.layer_graph_replays) > 0 for layer in graphed.offload_layers)
    assert spilled_reads and sum(spilled_reads) > 0
    if lookahead:
        assert graphed.stats()["prefetched_blocks"] > 0
        assert any(key[1:2] == ("layer",) and key[4] is not None for key in graphed.offload_layers[0].graphs.graphs)
    for _, _, cache in runs.values():
        cache.close()


def _demand_reads(cache) -> int:
    stats = cache.stats()
    return stats["disk_read_blocks"] - stats["disk_staged_ahead_blocks"]


def test_replayed_steps_under_a_disk_cap_read_only_the_sinks_from_disk(stand_in_graphs, tmp_path):  # noqa: F811
    """``disk_cap_blocks=0`` in the replayed steps (the plan reads the device tables of the chunks on disk): the same
    tokens and selections as op by op, and after the first decode step (which reads the sink blocks into the slot
    pool) no block read from disk on demand; the blocks the bound left out were staged ahead and some attended."""
    model = build_model("llama")
    ids, mask = left_padded([120, 90], seed=22)
    settings = dict(TINY_SPARSE, selector="solohead", transfer="kernel", admission="always", disk_cap_blocks=0,
                    disk_stage_left_out=4,
                    decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS, **dict(DISK, disk_staging_chunks=8))  # fmt: skip
    runs = {}
    for graphs in (False, None):
        directory = tmp_path / str(graphs)
        directory.mkdir()
        cache = OffloadCache(model, **settings, cuda_graphs=graphs, disk_dir=directory)
        prefill = OffloadCache(model, **settings, cuda_graphs=graphs, disk_dir=directory)
        with torch.no_grad():  # the reads of the prefill and the first decode step: a one-token generate
            _generate(model, ids, mask, prefill, new_tokens=2)
        first = _demand_reads(prefill)
        runs[graphs] = (*_recorded(lambda c=cache: _generate(model, ids, mask, c, new_tokens=12)), cache, first)
        prefill.close()
    (expected, chosen, _, _), (got, selections, graphed, _) = runs[False], runs[None]
    assert torch.equal(got, expected) and selections == chosen
    assert all(int(layer.stats.layer_graph_replays) > 0 for layer in graphed.offload_layers)
    for _, _, cache, first in runs.values():
        stats = cache.stats()
        assert stats["disk_kv_bytes"] > stats["host_kv_bytes"] > 0
        assert _demand_reads(cache) == first  # the 10 later decode steps read nothing from disk on demand
        assert stats["disk_staged_ahead_blocks"] > 0 and stats["disk_staged_used_blocks"] > 0
        cache.close()
