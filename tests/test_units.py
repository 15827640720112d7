"""Model-free unit tests of the stores, the online softmax and the config."""

from __future__ import annotations

import pytest
import torch

from hf_offload import OffloadConfig
from hf_offload.kernels import OnlineSoftmax
from hf_offload.store import DeviceSlotPool, HostBlockPool, HostMemoryBudget


def test_config_defaults_scale_with_budget():
    cfg = OffloadConfig(budget_tokens=2048)
    assert (cfg.sink_tokens, cfg.window_tokens, cfg.block_tokens) == (64, 256, 16)
    assert cfg.pool_tokens == 2560 and cfg.pool_blocks == 160
    small = OffloadConfig(budget_tokens=256)
    assert (small.sink_tokens, small.window_tokens) == (16, 32)


def test_host_pool_roundtrip_across_chunks_and_reuse():
    shape = (2, 3, 4, 8)
    pool = HostBlockPool(shape, torch.float32, pin_memory=False, chunk_bytes=5 * 2 * 3 * 4 * 8 * 4, budget=HostMemoryBudget(None))
    assert pool.chunk_blocks == 5
    ids = pool.allocate(12)  # three chunks
    blocks = torch.randn(12, *shape)
    pool.write(ids, blocks)
    perm = torch.randperm(12)
    assert torch.equal(pool.read(ids[perm]), blocks[perm])
    heads = torch.tensor([0, 2, 1])
    assert torch.equal(pool.read(ids[:3], heads=heads), blocks[torch.arange(3), :, heads])
    assert len(pool.chunks) == 3 and pool.used_bytes == 12 * pool.block_bytes
    pool.free(ids[:4])
    again = pool.allocate(4)
    assert sorted(again.tolist()) == sorted(ids[:4].tolist()) and len(pool.chunks) == 3


def test_host_budget_refuses_growth_beyond_limit():
    budget = HostMemoryBudget(host_memory_gib=1 / 1024)  # 1 MiB
    pool = HostBlockPool((2, 1, 16, 64), torch.float32, False, chunk_bytes=768 << 10, budget=budget)
    pool.allocate(1)
    with pytest.raises(MemoryError, match="host_memory_gib"):
        pool.allocate(pool.chunk_blocks + 1)


def test_slot_pool_hits_and_lru_eviction():
    pool = DeviceSlotPool(batch=1, slots=3, kv_heads=2, block_tokens=4, head_dim=8, dtype=torch.float32, device="cpu")
    keep = torch.ones(1, 1, 3, dtype=torch.bool)
    slots, miss = pool.assign(torch.tensor([[[0, 1, 2]]]), keep)
    assert miss.all() and sorted(slots[0, 0].tolist()) == [0, 1, 2]
    slots2, miss2 = pool.assign(torch.tensor([[[2, 0]]]), keep[..., :2])
    assert not miss2.any()
    assert slots2[0, 0].tolist() == [slots[0, 0, 2].item(), slots[0, 0, 0].item()]
    # Block 1 is now least recently used: a new block replaces it, not 0 or 2.
    slots3, miss3 = pool.assign(torch.tensor([[[7]]]), keep[..., :1])
    assert miss3.all() and slots3[0, 0, 0].item() == slots[0, 0, 1].item()
    assert sorted(pool.block[0, 0].tolist()) == [0, 2, 7]


def test_slot_pool_per_head_and_unkept_entries():
    pool = DeviceSlotPool(batch=2, slots=2, kv_heads=2, block_tokens=4, head_dim=8, dtype=torch.float32, device="cpu")
    blocks = torch.tensor([[[3, 4], [5, 6]], [[1, 2], [1, 9]]])
    keep = torch.tensor([[[True, False], [True, True]], [[True, True], [False, True]]])
    slots, miss = pool.assign(blocks, keep)
    assert torch.equal(miss, keep)
    for b in range(2):
        for h in range(2):
            held = set(pool.block[b, h].tolist()) - {-1}
            assert held == set(blocks[b, h][keep[b, h]].tolist())


def _reference(q, k, v, allowed, scaling):
    group = q.shape[1] // k.shape[1]
    logits = q @ k.repeat_interleave(group, 1).transpose(-1, -2) * scaling
    logits = logits.masked_fill(~allowed, float("-inf"))
    return torch.softmax(logits, -1) @ v.repeat_interleave(group, 1)


def test_online_softmax_over_segments_equals_one_softmax():
    g = torch.Generator().manual_seed(0)
    B, HQ, H, Q, N, D = 2, 6, 2, 5, 37, 16
    q, k, v = torch.randn(B, HQ, Q, D, generator=g), torch.randn(B, H, N, D, generator=g), torch.randn(B, H, N, D, generator=g)
    allowed = torch.rand(B, 1, Q, N, generator=g) > 0.3
    allowed[..., 0] = True
    acc = OnlineSoftmax(q.view(B, H, HQ // H, Q, D), 0.25)
    for start in range(0, N, 10):
        s = slice(start, min(start + 10, N))
        for qs in (slice(0, 2), slice(2, Q)):
            acc.add(k[:, :, s], v[:, :, s], allowed[:, :, None, qs, s], qs)
    got = acc.result().reshape(B, HQ, Q, D)
    torch.testing.assert_close(got, _reference(q, k, v, allowed, 0.25), rtol=1e-5, atol=1e-5)


def test_online_softmax_fully_masked_rows_are_zero_and_sinks_join_the_denominator():
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    allowed = torch.ones(1, 1, 3, 4, dtype=torch.bool)
    allowed[:, :, 0] = False
    acc = OnlineSoftmax(q.view(1, 2, 1, 3, 8), 1.0)
    acc.add(k, v, allowed[:, :, None])
    out = acc.result()
    assert torch.equal(out[:, :, :, 0], torch.zeros_like(out[:, :, :, 0]))
    sink = torch.tensor([0.5, -1.0])
    with_sink = acc.result(sink).reshape(1, 2, 3, 8)
    logits = (q @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    full = torch.cat([logits, sink.view(1, 2, 1, 1).expand(1, 2, 3, 1)], dim=-1)
    expected = torch.softmax(full, -1)[..., :4] @ v
    torch.testing.assert_close(with_sink[:, :, 1:], expected[:, :, 1:], rtol=1e-5, atol=1e-5)


def test_key_bound_logits_equals_elementwise_quest_bound():
    from hf_offload.selectors.base import key_bound_logits

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 4, 16, generator=g)
    a, b = torch.randn(2, 9, 3, 16, generator=g), torch.randn(2, 9, 3, 16, generator=g)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    expected = torch.maximum(q[:, :, :, None] * kmin.permute(0, 2, 1, 3)[:, :, None],
                             q[:, :, :, None] * kmax.permute(0, 2, 1, 3)[:, :, None]).sum(-1)  # fmt: skip
    torch.testing.assert_close(key_bound_logits(q, kmin, kmax), expected, rtol=1e-5, atol=1e-5)


def test_replace_rederives_sizes_that_were_derived():
    small = OffloadConfig(budget_tokens=128)
    big = small.replace(budget_tokens=8192)
    assert (big.sink_tokens, big.window_tokens, big.pool_tokens) == (64, 256, 10240)
    pinned = OffloadConfig(budget_tokens=128, sink_tokens=32).replace(budget_tokens=8192)
    assert pinned.sink_tokens == 32  # given explicitly: kept


def test_streaming_pool_holds_only_sink_window_and_the_open_block():
    cfg = OffloadConfig(budget_tokens=2048, selector="streaming")
    assert cfg.pool_tokens == cfg.sink_tokens + cfg.window_tokens + 2 * cfg.block_tokens


def test_score_shape_must_match_per_head():
    from hf_offload.selectors import SoloHeadSelector

    class Wrong(SoloHeadSelector):
        name = "wrong"

        def score(self, query, summaries, scaling):
            return torch.zeros(query.shape[0], query.shape[1], summaries["kmin"].shape[1])  # per head, but shared

    q = torch.randn(2, 3, 4, 8)
    summaries = {"kmin": torch.zeros(2, 5, 3, 8), "kmax": torch.zeros(2, 5, 3, 8)}
    forced = torch.zeros(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"per_head=False it must be \[batch, 1, n_blocks=5\]"):
        Wrong().select(q, summaries, 1.0, 2, forced, ~forced)


def test_register_selector():
    from hf_offload import register_selector
    from hf_offload.selectors import SELECTORS, SoloHeadSelector

    @register_selector
    class Mine(SoloHeadSelector):
        name = "mine_for_test"

    try:
        assert SELECTORS["mine_for_test"] is Mine
    finally:
        SELECTORS.pop("mine_for_test")
    with pytest.raises(ValueError, match="own class attribute `name`"):
        register_selector(type("NoName", (SoloHeadSelector,), {"name": "base"}))


def test_sequence_order_indices_are_kept_per_shape(monkeypatch):
    """A later chunk's recall of its earlier blocks in sequence order: entry ``b * n + j`` goes to slot ``j`` of
    sequence ``b`` with the offsets ``block_piece_offsets`` gives; the same shapes return the kept tensors, other
    shapes new ones; the kept sets stay within their byte bound (least recently used dropped first), a set above a
    quarter of it is not kept, and ``release_parked`` frees them."""
    from hf_offload import release_parked
    from hf_offload.store import transfer

    heads, tokens, dim = 2, 4, 8
    host = HostBlockPool((2, heads, tokens, dim), torch.bfloat16, False, 4 * 2 * heads * tokens * dim * 2,
                         HostMemoryBudget(None))  # fmt: skip
    scratch = DeviceSlotPool.scratch(3, 5, heads, tokens, dim, torch.bfloat16, "cpu")
    transfer.forget_sequence_order()
    batch_idx, slot_idx, (host_off, dev_base) = transfer.sequence_order_indices(host, scratch, 3, 5)
    assert batch_idx.tolist() == [b for b in range(3) for _ in range(5)]
    assert slot_idx.tolist() == list(range(5)) * 3
    expected = transfer.block_piece_offsets(host, scratch, batch_idx)
    assert torch.equal(host_off, expected[0]) and torch.equal(dev_base, expected[1])
    again = transfer.sequence_order_indices(host, scratch, 3, 5)
    assert again[0] is batch_idx and again[1] is slot_idx and again[2][1] is dev_base
    fewer = transfer.sequence_order_indices(host, scratch, 3, 4)
    assert fewer[1].tolist() == list(range(4)) * 3
    # A set of e entries takes e * (8 + 8 + 2 * (2 * heads) * 8) = 80 e bytes; the bound here keeps sets of up to 9.
    monkeypatch.setattr(transfer, "SEQUENCE_ORDER_BYTES", 4 * 80 * 9)
    transfer.forget_sequence_order()
    shapes = [(3, 3), (3, 2), (2, 3), (3, 1), (2, 2), (2, 1), (1, 3), (1, 2), (1, 1), (1, 4)]  # 40 entries
    for batch, n in shapes:
        transfer.sequence_order_indices(host, scratch, batch, n)
    kept = [(key[1], key[2]) for key in transfer._SEQUENCE_ORDER]
    assert sum(transfer._index_bytes(v) for v in transfer._SEQUENCE_ORDER.values()) <= 4 * 80 * 9
    assert kept == shapes[-len(kept):] and (3, 3) not in kept  # the least recently used went first
    transfer.sequence_order_indices(host, scratch, 3, 4)  # 12 entries: above a quarter of the bound
    assert (3, 4) not in [(key[1], key[2]) for key in transfer._SEQUENCE_ORDER]
    release_parked()
    assert not transfer._SEQUENCE_ORDER


def test_block_piece_offsets_point_at_each_piece():
    """The whole-block recall's word offsets (``transfer.block_piece_offsets`` plus ``slot * piece_words``) land on
    the K or V of head ``h`` of the entry's block in the host pool and on slot ``slot`` of its sequence in the
    device pool, for every sequence, head and slot."""
    from hf_offload.store.transfer import block_piece_offsets

    batch, heads, slots, tokens, dim = 3, 2, 5, 4, 8
    pool = DeviceSlotPool(batch=batch, slots=slots, kv_heads=heads, block_tokens=tokens, head_dim=dim,
                          dtype=torch.bfloat16, device="cpu", open_slot=True)  # fmt: skip
    host = HostBlockPool((2, heads, tokens, dim), torch.bfloat16, False, 4 * 2 * heads * tokens * dim * 2,
                         HostMemoryBudget(None))  # fmt: skip
    batch_idx = torch.tensor([2, 0, 1, 2])
    slot_idx = torch.tensor([0, 5, 3, 1])  # slot 5: the open slot
    host_off, dev_base = block_piece_offsets(host, pool, batch_idx)
    piece = host.block_words // (2 * heads)
    assert host_off.shape == dev_base.shape == (4, 2 * heads) and host_off.is_contiguous()
    dev_off = dev_base + slot_idx[:, None] * piece
    word = 4  # bytes
    block = torch.empty((2, heads, tokens, dim), dtype=torch.bfloat16)
    for e, (b, slot) in enumerate(zip(batch_idx.tolist(), slot_idx.tolist())):
        for kv in range(2):
            for h in range(heads):
                j = kv * heads + h
                assert dev_off[e, j] * word == pool.data[kv, b, h, slot].data_ptr() - pool.data.data_ptr()
                assert host_off[e, j] * word == block[kv, h].data_ptr() - block.data_ptr()
