"""The CUDA graph memory pools of the caches' graphs, as bookkeeping (on the CPU: a stand-in for the pool): a cache
takes an idle pool or makes one, holds it while one of its graphs lives, and hands it on after the last one, so a
process that makes a cache per request does not reserve one more pool per request."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from hf_offload import OffloadConfig
from hf_offload.cache import release_graph_pools
from hf_offload.cache import shared
from hf_offload.cache.shared import DeviceResources

DEVICE = torch.device("cuda", 0)  # a key here; nothing runs on it


class _Graph:
    """A captured graph's stand-in (graphs are tracked by weak reference)."""


@pytest.fixture
def pools(monkeypatch):
    made = []

    class StandInPool:
        def __init__(self, device, stream):
            self.handle = ("pool", len(made))
            made.append(self)

    monkeypatch.setattr(shared, "_PoolLease", StandInPool)
    monkeypatch.setattr(shared, "_IDLE_POOLS", {})
    monkeypatch.setattr(DeviceResources, "streams", lambda self, device: SimpleNamespace(capture=None))
    return made


def _capture(resources):
    return resources._in_pool(DEVICE, lambda pool, stream: _Graph())


def _fail(pool, stream):
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_pool_goes_from_cache_to_cache(pools):
    config = OffloadConfig(budget_tokens=64)
    first = DeviceResources(config)
    graphs = [_capture(first) for _ in range(3)]
    assert len(pools) == 1 and first.graph_pools[DEVICE] == pools[0].handle  # one pool for a cache's graphs
    second = DeviceResources(config)
    other = _capture(second)
    assert len(pools) == 2 and second.graph_pools[DEVICE] == pools[1].handle  # caches alive at once: one each
    del graphs[:2]
    gc.collect()
    assert shared._IDLE_POOLS.get(DEVICE, []) == []  # a graph of the first cache still lives
    del graphs
    gc.collect()
    assert shared._IDLE_POOLS[DEVICE] == [pools[0]]
    third = DeviceResources(config)
    again = _capture(third)
    assert len(pools) == 2 and third.graph_pools[DEVICE] == pools[0].handle  # taken up, not made anew
    del other, again
    gc.collect()
    assert len(shared._IDLE_POOLS[DEVICE]) == 1  # at most one idle pool per device; the other is let go
    assert release_graph_pools() == 1 and not shared._IDLE_POOLS


def test_a_pool_a_capture_failed_in_is_not_handed_on(pools):
    resources = DeviceResources(OffloadConfig(budget_tokens=64))
    kept = _capture(resources)
    with pytest.raises(RuntimeError, match="capturing"):
        resources._in_pool(DEVICE, _fail)
    later = _capture(resources)
    assert len(pools) == 2 and resources.graph_pools[DEVICE] == pools[1].handle  # the next capture: a new pool
    del kept, later
    gc.collect()
    assert shared._IDLE_POOLS[DEVICE] == [pools[1]]  # the failed one is dropped, the new one handed on


def test_what_a_caches_captures_reserve_is_reported_while_its_graphs_live(pools, monkeypatch):
    # The allocator's reserved bytes as a stand-in: each capture reserves 3 MiB more. The cache reports them while
    # one of its graphs lives, and no longer once its last graph is gone; a failed capture that reserved nothing adds
    # nothing. They are not counted under device_memory_gib (the planner cannot predict them).
    reserved = [0]

    def capture_reserving(pool, stream):
        reserved[0] += 3 << 20
        return _Graph()

    monkeypatch.setattr(shared, "_reserved_bytes", lambda device: reserved[0])
    resources = DeviceResources(OffloadConfig(budget_tokens=64))
    graphs = [resources._in_pool(DEVICE, capture_reserving) for _ in range(2)]
    assert resources.graph_pool_bytes(DEVICE) == 6 << 20
    with pytest.raises(RuntimeError):
        resources._in_pool(DEVICE, _fail)
    assert resources.graph_pool_bytes(DEVICE) == 6 << 20  # the earlier graphs still live (in the old pool)
    del graphs
    gc.collect()
    assert resources.graph_pool_bytes(DEVICE) == 0
