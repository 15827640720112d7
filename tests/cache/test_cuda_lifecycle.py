"""The cache's lifecycle on a CUDA device, where the decode replays CUDA graphs and the transfers run on side streams:
edits for generate() features, a fault mid-forward, save and load, forks, and the disk tier. Each result equals
DynamicCache's (float32 models, a budget covering the context). Skipped without CUDA and Triton."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache
from hf_offload.cache import GRAPH_CAPACITY_BLOCKS
from hf_offload.cache.capture import SegmentedGraph

from ..helpers import TINY_PREFILL, TINY_SPARSE, build_model, left_padded
from .test_editing import MODES, _prompt
from .test_faults import Boom, _fail_at_call

pytestmark = [pytest.mark.cuda, pytest.mark.triton]

# A budget covering every prompt, graphs on (the whole layer captured), the capacity the graphs are sized for, every
# sealed block in host memory (admission "auto" would keep these tiny caches on the device: no transfer to test).
FULL = dict(TINY_PREFILL, budget_tokens=4096, cuda_graphs=True, decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS,
            admission="always")  # fmt: skip
ARCHS = ["llama", "qwen2"]


def _generate(model, cache, ids, mask, new_tokens=10, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                              do_sample=False, **kwargs)  # fmt: skip


def _cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_generate_modes_token_identical_on_cuda(arch, mode):
    model = build_model(arch).cuda()
    ids, mask = _cuda(*(left_padded([38, 27], seed=4) if mode == "beam_search" else _prompt()))
    extra = MODES[mode](arch)
    if "assistant_model" in extra:
        extra["assistant_model"] = extra["assistant_model"].cuda()
    expected = _generate(model, DynamicCache(config=model.config), ids, mask, 14, **extra)
    cache = OffloadCache(model, **FULL)
    assert torch.equal(_generate(model, cache, ids, mask, 14, **extra), expected)
    assert cache.stats()["host_kv_bytes"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_a_decode_step_stopped_mid_forward_rolls_back_on_cuda(arch):
    model = build_model(arch).cuda()
    ids, mask = _cuda(*left_padded([37, 21], seed=1))
    expected = _generate(model, DynamicCache(config=model.config), ids, mask, 12)
    cache = OffloadCache(model, **FULL)
    hook = _fail_at_call(model, 1, 7, Boom("hook"))  # decode step 6, after layer 0
    with pytest.raises(Boom):
        _generate(model, cache, ids, mask, 12)
    hook.remove()
    held = ids.shape[1] + 5  # the prefill and five decode steps (the sixth step's input token is not in it)
    assert [int(layer.get_seq_length()) for layer in cache.layers] == [held] * len(cache.layers)
    # Continue from the tokens the cache holds: the same tokens as the uninterrupted DynamicCache run.
    known = expected[:, : held + 1]
    known_mask = torch.cat([mask, torch.ones_like(known[:, ids.shape[1] :])], 1)
    assert torch.equal(_generate(model, cache, known, known_mask, expected.shape[1] - held - 1), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_save_load_and_fork_continue_exactly_on_cuda(arch, tmp_path):
    model = build_model(arch).cuda()
    ids, mask = _cuda(*left_padded([45, 30], seed=2))
    expected = _generate(model, DynamicCache(config=model.config), ids, mask, 12)
    cache = OffloadCache(model, **FULL)
    first = _generate(model, cache, ids, mask, 4)
    cache.save(tmp_path / "cache.safetensors")
    loaded = OffloadCache.load(tmp_path / "cache.safetensors", model)
    follow_mask = torch.cat([mask, torch.ones_like(first[:, ids.shape[1] :])], 1)
    assert torch.equal(_generate(model, loaded, first, follow_mask, 8), expected)
    fork = cache.fork(batch=2)
    assert torch.equal(_generate(model, fork, first, follow_mask, 8), expected)
    assert torch.equal(_generate(model, cache, first, follow_mask, 8), expected)  # the forked cache goes on too


@pytest.mark.parametrize("arch", ARCHS)
def test_disk_tier_on_cuda_matches_dynamic_cache_and_removes_its_files(arch, tmp_path):
    block_bytes = 2 * 2 * 8 * 16 * 4  # K and V, 2 KV heads, 8 tokens, head_dim 16, float32
    disk = {"host_chunk_mib": 2 * block_bytes / 2**20, "host_memory_gib": 8 * block_bytes / 2**30, "disk_dir": tmp_path}
    model = build_model(arch).cuda()
    ids, mask = _cuda(*left_padded([101, 77], seed=1))
    expected = _generate(model, DynamicCache(config=model.config), ids, mask)
    with OffloadCache(model, **dict(TINY_PREFILL, budget_tokens=4096, admission="always"), **disk) as cache:
        assert torch.equal(_generate(model, cache, ids, mask), expected)
        stats = cache.stats()
        assert stats["disk_kv_bytes"] > stats["host_kv_bytes"] > 0 and stats["disk_reads"] > 0
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", ["full", "sparse"])
def test_disk_tier_with_graphs_replays_two_graphs_a_step_and_matches_op_by_op(arch, budget, tmp_path):
    """``cuda_graphs=True`` with a disk tier: each captured step is two graphs with the host's reads from disk
    between them (three with lookahead, at the sparse budget); the tokens of the same cache op by op (and of
    DynamicCache at a full budget)."""
    block_bytes = 2 * 2 * 8 * 16 * 4  # K and V, 2 KV heads, 8 tokens, head_dim 16, float32
    disk = {"host_chunk_mib": 2 * block_bytes / 2**20, "host_memory_gib": 8 * block_bytes / 2**30}
    # The full budget with a pool of every block (a step that recalls more than the pool holds runs in rounds,
    # without graphs).
    settings = dict(FULL, pool_tokens=256) if budget == "full" else dict(TINY_SPARSE, admission="always", disk_stage_near=2, lookahead=True,
                                                  decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS)  # fmt: skip
    settings = {**settings, **disk}
    model = build_model(arch).cuda()
    ids, mask = _cuda(*left_padded([101, 77], seed=1))
    runs = {}
    for graphs in (False, True):
        (tmp_path / str(graphs)).mkdir()
        with OffloadCache(model, **{**settings, "cuda_graphs": graphs}, disk_dir=tmp_path / str(graphs)) as cache:
            runs[graphs] = _generate(model, cache, ids, mask, new_tokens=24)
            stats = cache.stats()
            assert stats["disk_kv_bytes"] > stats["host_kv_bytes"] > 0 and stats["disk_reads"] > 0
            if graphs:
                layers = cache.offload_layers
                assert all(int(layer.stats.layer_graph_replays) > 0 for layer in layers)
                assert all(any(isinstance(g.graph, SegmentedGraph) for g in layer.graphs.graphs.values())
                           for layer in layers)  # fmt: skip
        assert not list((tmp_path / str(graphs)).iterdir())
    assert torch.equal(runs[True], runs[False])
    if budget == "full":
        assert torch.equal(runs[True], _generate(model, DynamicCache(config=model.config), ids, mask, new_tokens=24))
