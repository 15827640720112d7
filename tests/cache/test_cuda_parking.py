"""Parking on CUDA (:mod:`hf_offload.cache.parking`): from the second ``generate()`` with a fresh cache on the same
model and shapes, the decode replays the CUDA graphs the first cache captured, and gives the tokens of a cache that
captures its own. Skipped without CUDA (and Triton: graphs need the kernel transfer path)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache, release_parked
from hf_offload.cache import GRAPH_CAPACITY_BLOCKS, parked_bytes
from hf_offload.patches import installed

from ..helpers import TINY_SPARSE as SMALL
from ..helpers import build_model, left_padded

pytestmark = [pytest.mark.cuda, pytest.mark.triton]

CAPTURES = ("graph_captures", "layer_graph_captures", "seal_graph_captures")
COUNTERS = ("recalled_blocks", "decode_recalled_blocks", "offloaded_bytes", "decode_steps", "host_kv_bytes",
            "device_kv_bytes", "hit_rate")  # fmt: skip


@pytest.fixture(autouse=True)
def _nothing_parked():
    release_parked()
    yield
    release_parked()


def _generate(model, seed, steps, lengths=(70, 53, 31), **options):
    """Tokens and stats of one ``generate()`` with a fresh cache, let go of on return."""
    ids, mask = left_padded(list(lengths), seed=seed)
    cache = OffloadCache(model, **dict(SMALL, **options))
    with torch.no_grad():
        out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), past_key_values=cache,
                             max_new_tokens=steps, min_new_tokens=steps, do_sample=False)  # fmt: skip
    torch.cuda.synchronize()
    return out, cache.stats()


@pytest.mark.parametrize("admission", ["always", "auto"])
@pytest.mark.parametrize("selector", [None, "quantkey"])
def test_later_generate_calls_replay_the_first_calls_graphs(selector, admission):
    model = build_model("llama").cuda()
    options = dict(admission=admission, **({} if selector is None else {"selector": selector}))
    steps = 40  # several seals of 8-token blocks
    expected = {seed: _generate(model, seed, steps, cuda_graphs=False, decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS,
                                **options) for seed in (3, 4, 5)}  # fmt: skip
    first, stats = _generate(model, 3, steps, **options)
    assert torch.equal(first, expected[3][0])
    assert all(int(stats[name]) > 0 for name in CAPTURES)
    assert installed(model).parked is not None and parked_bytes(model) > 0
    for seed in (4, 5):
        got, stats = _generate(model, seed, steps, **options)
        assert torch.equal(got, expected[seed][0]), seed
        assert {name: int(stats[name]) for name in CAPTURES} == dict.fromkeys(CAPTURES, 0), seed
        assert int(stats["layer_graph_replays"]) > 0 and int(stats["seal_graph_replays"]) > 0
        for name in COUNTERS:
            assert stats[name] == expected[seed][1][name], (seed, name)


def test_another_batch_a_dynamic_cache_and_release_free_the_parked_state():
    model = build_model("llama").cuda()
    expected, _ = _generate(model, 4, 24, lengths=(70, 53), cuda_graphs=False,
                            decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS)  # fmt: skip
    _generate(model, 3, 24)
    held = parked_bytes(model)
    assert held > 0
    got, stats = _generate(model, 4, 24, lengths=(70, 53))  # another batch: freed before the prefill, captured anew
    assert torch.equal(got, expected)
    assert int(stats["graph_captures"]) > 0
    ids, mask = left_padded([70, 53], seed=4)
    with torch.no_grad():
        model(input_ids=ids.cuda(), attention_mask=mask.cuda(), past_key_values=DynamicCache())
    assert installed(model).parked is None
    _generate(model, 3, 24)
    assert release_parked() == 1 and parked_bytes() == 0


def test_a_cache_per_call_keeps_the_device_memory_of_one_parked_state():
    """The pattern parking serves (a fresh cache per ``generate()``): the memory allocated after each call is that
    after the first (one parked state, taken and parked again), not a state per call."""
    model = build_model("llama").cuda()
    device = torch.device("cuda", torch.cuda.current_device())
    after = []
    for call in range(8):
        _, stats = _generate(model, call, 20)
        if call:
            assert int(stats["graph_captures"]) == 0, call
        torch.cuda.synchronize(device)
        after.append(torch.cuda.memory_allocated(device))
    growth = [(b - after[0]) / 2**20 for b in after[1:]]
    assert max(growth) < 1.0, f"device memory allocated grew by {growth} MiB after the first call"


def test_warm_up_captures_and_parks_for_the_calls_that_follow():
    from hf_offload import warm_up

    model = build_model("llama").cuda()
    options = {"decode_capacity_blocks": GRAPH_CAPACITY_BLOCKS}
    out = warm_up(model, batch_size=3, prompt_tokens=70, **dict(SMALL, **options))
    assert out["graph_captures"] > 0 and 0 < out["attended_blocks"] < 70 // SMALL["block_tokens"]
    assert parked_bytes(model) > 0
    _, stats = _generate(model, seed=3, steps=24, **options)
    assert stats["parking"] == "took a parked state"
