"""Sparse mode: planted attention mass is found, and the tiers always re-assemble the dense KV bit for bit."""

from __future__ import annotations

import pytest
import torch

from hf_offload import OffloadCache
from hf_offload.attention import offload_attention_forward, take_handoff
from hf_offload.selectors import SELECTORS

from ..helpers import build_model

B, HQ, H, D, T = 2, 4, 2, 16, 8
PLANTED = {0: [5, 11, 17], 1: [3, 14, 20]}  # blocks that hold the attention mass, per sequence


def _offload_layer(model, **config):
    cache = OffloadCache(model, **config)
    return cache, cache.layers[0]


@pytest.fixture(scope="module")
def model():
    return build_model("llama")


def _planted_inputs(seed: int = 0):
    """Keys with a few blocks aligned with the decode query, carrying >= 99% of its attention mass."""
    g = torch.Generator().manual_seed(seed)
    n_tokens = 24 * T + 5
    keys = torch.randn(B, H, n_tokens, D, generator=g) * 0.3
    values = torch.randn(B, H, n_tokens, D, generator=g)
    group = HQ // H
    # Query heads of one group point roughly the same way (as GQA heads tend to), so one planted key serves all.
    base = torch.randn(B, H, 1, 1, D, generator=g)
    query = (base + 0.3 * torch.randn(B, H, group, 1, D, generator=g)).view(B, HQ, 1, D)
    for b, blocks in PLANTED.items():
        for block in blocks:
            for h in range(H):
                direction = query[b, h * group : (h + 1) * group, 0].mean(0)
                keys[b, h, block * T : (block + 1) * T] = direction / direction.norm() * 12.0
    return keys, values, query


def _dense_attention(query, keys, values, scaling):
    keys = keys.repeat_interleave(HQ // H, dim=1)
    values = values.repeat_interleave(HQ // H, dim=1)
    weights = torch.softmax(query @ keys.transpose(-1, -2) * scaling, dim=-1)
    return weights @ values, weights


@pytest.mark.parametrize("selector", sorted(set(SELECTORS) - {"streaming"}))
def test_planted_blocks_found_and_output_matches(model, selector):
    keys, values, query = _planted_inputs()
    scaling = D**-0.5
    expected, weights = _dense_attention(query, keys, values, scaling)
    # The planted blocks really hold >= 99% of the mass in every head of every sequence.
    for b, blocks in PLANTED.items():
        idx = torch.cat([torch.arange(k * T, (k + 1) * T) for k in blocks])
        assert weights[b, :, 0, idx].sum(-1).min() >= 0.99

    cache, layer = _offload_layer(
        model, budget_tokens=6 * T, block_tokens=T, sink_tokens=T, window_tokens=T, selector=selector
    )
    layer.update(keys[:, :, :-1], values[:, :, :-1])  # prefill (its handoff is not needed here)
    take_handoff()
    layer.update(keys[:, :, -1:], values[:, :, -1:])  # the decode token
    handoff = take_handoff()
    selection = layer.planner.select(query.view(B, H, HQ // H, D), None, scaling, handoff)
    for b, blocks in PLANTED.items():
        for h in range(selection.blocks.shape[1]):
            chosen = set(selection.blocks[b, h][selection.keep[b, h]].tolist())
            assert set(blocks) <= chosen, (selector, b, h, chosen)
    got = offload_attention_forward(handoff, query, None, scaling=scaling)  # [B, 1, HQ, D]
    got = got.transpose(1, 2)
    for b in range(B):
        err = (got[b] - expected[b]).norm() / expected[b].norm()
        assert err <= 1e-2, (selector, b, float(err))
    # The budget was respected: sink + window + selected blocks + the open block.
    attended = selection.keep.sum(-1).max().item() * T + handoff.key.shape[-2]
    assert attended <= 6 * T


def test_streaming_attends_to_sink_and_window_only(model):
    keys, values, query = _planted_inputs()
    cache, layer = _offload_layer(
        model, budget_tokens=8 * T, block_tokens=T, sink_tokens=T, window_tokens=2 * T, selector="streaming"
    )
    layer.update(keys[:, :, :-1], values[:, :, :-1])
    take_handoff()
    layer.update(keys[:, :, -1:], values[:, :, -1:])
    handoff = take_handoff()
    selection = layer.planner.select(query.view(B, H, HQ // H, D), None, D**-0.5, handoff)
    n = handoff.n_blocks_before
    for b in range(B):
        assert set(selection.blocks[b, 0][selection.keep[b, 0]].tolist()) == {0, n - 2, n - 1}


@pytest.mark.parametrize("selector", sorted(SELECTORS))
@pytest.mark.parametrize("budget_tokens,pool_tokens", [(4 * T, T), (4 * T, 8 * T), (10_000, 2 * T)])
def test_tiers_reassemble_dense_kv_bit_for_bit(model, selector, budget_tokens, pool_tokens):
    """Host pool + open block equal every key and value ever given, and every slot holds its block's exact bytes."""
    g = torch.Generator().manual_seed(1)
    sink = T if budget_tokens >= 3 * T else 0
    cache, layer = _offload_layer(
        model, budget_tokens=budget_tokens, block_tokens=T, sink_tokens=sink, window_tokens=T,
        pool_tokens=pool_tokens, selector=selector,
    )
    all_k, all_v = [], []
    for step, q_len in enumerate([13, 1, 1, 30, 1, 7] + [1] * 12):
        k = torch.randn(B, H, q_len, D, generator=g)
        v = torch.randn(B, H, q_len, D, generator=g)
        all_k.append(k)
        all_v.append(v)
        layer.update(k, v)
        handoff = take_handoff()
        query = torch.randn(B, HQ, q_len, D, generator=g)
        offload_attention_forward(handoff, query, None)  # exercises selection, recall and slot eviction
        dense_k, dense_v = layer.dense_kv()
        assert torch.equal(dense_k, torch.cat(all_k, dim=-2))
        assert torch.equal(dense_v, torch.cat(all_v, dim=-2))
        # No slot serves stale data: each (sequence, head, slot) equals the block it claims to hold.
        pool = layer.blocks.pool
        for b, h, s in (pool.block >= 0).nonzero().tolist():
            j = pool.block[b, h, s].item()
            assert torch.equal(pool.data[0, b, h, s], dense_k[b, h, j * T : (j + 1) * T])
            assert torch.equal(pool.data[1, b, h, s], dense_v[b, h, j * T : (j + 1) * T])
    assert layer.stats.recalled_blocks > 0


def test_sparse_generate_stays_within_budget_and_reports(model):
    from ..helpers import left_padded

    ids, mask = left_padded([120, 90], seed=5)
    cache = OffloadCache(model, budget_tokens=48, block_tokens=8, sink_tokens=8, window_tokens=16)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False)
    stats = cache.stats()
    assert stats["decode_steps"] == 5
    assert 0.0 <= stats["hit_rate"] <= 1.0
    assert set(stats["layers"]) == {0, 1}
    for layer in cache.offload_layers:
        # Device KV is the slot pool, whose last slot is the open block's buffer, independent of the context.
        assert layer.blocks.device_kv_bytes() == layer.blocks.pool.nbytes == (layer.blocks.pool.slots + 1) * 2 * B * H * T * D * 4
        assert layer.blocks.host_kv_bytes() == layer.n_blocks * B * 2 * H * T * D * 4


def test_window_blocks_stay_resident_after_chunked_prefill(model):
    """Blocks sealed by the last prefill chunk are hits at the first decode step, although the chunk streamed all
    older blocks through the slot pool."""
    from ..helpers import left_padded

    ids, mask = left_padded([100])
    cache = OffloadCache(model, budget_tokens=64, block_tokens=8, sink_tokens=8, window_tokens=16, pool_tokens=32,
                         selector="streaming")
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2, do_sample=False,
                       prefill_chunk_size=48)
    for layer_stats in cache.stats()["layers"].values():
        # One decode step: the sink block is recalled, both window blocks are already resident.
        assert layer_stats["lookups"] == 3 * 2  # 3 blocks x 2 KV heads
        assert layer_stats["hit_rate"] == pytest.approx(2 / 3)


def test_timing_reports_phases_per_decode_step(model):
    from ..helpers import left_padded

    ids, mask = left_padded([90])
    cache = OffloadCache(model, budget_tokens=48, block_tokens=8, sink_tokens=8, window_tokens=16, timing=True)
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False)
    timing = cache.stats()["timing"]
    assert timing["timed_steps"] == 4  # 5 decode steps give 4 complete step-to-step spans
    for phase in ("select_ms", "recall_ms", "attention_ms", "step_ms"):
        assert timing[phase] > 0
    assert timing["step_ms"] >= timing["select_ms"] + timing["recall_ms"] + timing["attention_ms"]
    assert OffloadCache(model).stats()["timing"] is None


def test_transfer_cap_swaps_lowest_misses_for_close_resident_blocks():
    from hf_offload.selectors import Selection
    from hf_offload.selectors.transfer_cap import cap_transfers, resident_blocks

    inf = float("inf")
    #           block: 0     1    2    3    4    5    6    7
    scores = torch.tensor([[[inf, 5.0, 4.0, 3.0, 2.9, 2.0, 1.0, inf]]])
    selection = Selection(blocks=torch.tensor([[[0, 7, 1, 2, 3]]]), keep=torch.ones(1, 1, 5, dtype=torch.bool),
                          scores=scores)
    slot_blocks = torch.tensor([[[4, 6, -1, 0]]])  # blocks 4, 6 and 0 resident; one empty slot
    resident = resident_blocks(slot_blocks, 1, 8)
    assert resident[0, 0].tolist() == [True, False, False, False, True, False, True, False]
    capped = cap_transfers(selection, resident, cap_blocks=2, margin=0.1)
    chosen = set(capped.blocks[0, 0][capped.keep[0, 0]].tolist())
    # Misses 1, 2, 3, 7 (7 is forced, never swapped); one over the cap: the lowest miss (3, score 3.0) is replaced
    # by resident block 4 (2.9 >= 3.0 - 0.3). Block 6 (1.0) is too far from any miss.
    assert chosen == {0, 7, 1, 2, 4}
    none = cap_transfers(selection, resident, cap_blocks=0, margin=0.0)
    assert set(none.blocks[0, 0][none.keep[0, 0]].tolist()) == {0, 7, 1, 2, 3}  # no resident block is close enough


def test_transfer_cap_bounds_recall_in_generate(model):
    from ..helpers import left_padded

    ids, mask = left_padded([150, 120], seed=8)
    recalled = {}
    for cap in (None, 0):
        cache = OffloadCache(model, budget_tokens=48, block_tokens=8, sink_tokens=8, window_tokens=8,
                             transfer_cap_blocks=cap, transfer_cap_margin=1e9)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False)
        recalled[cap] = cache.stats()["decode_recalled_blocks"]
    # With a cap of 0 and an unbounded margin only forced blocks (sink, window) are ever recalled.
    assert recalled[0] < recalled[None]
