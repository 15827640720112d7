"""The device bound's count of each store's buffers (``BlockStore.device_buffer_bytes``, kept until a buffer is
replaced) equals a fresh count after every kind of edit: prefill and decode, seals that grow the buffers, a
reservation, a crop, a batch edit, forks and refills, summaries re-encoded at a coarser level, a reset and a new
prompt."""

from __future__ import annotations

import pytest
import torch

from hf_offload import OffloadCache
from hf_offload.cache.blocks import BlockStore

from ..helpers import TINY_BLOCKS, build_model, left_padded

SETTINGS = dict(TINY_BLOCKS, budget_tokens=48, pool_tokens=48, prefill_chunk_tokens=16, admission="auto")


def _fresh(store: BlockStore) -> int:
    if not store.is_initialized:
        return 0
    table = store.block_table_dev
    return store.pool.nbytes + store.device_summary_bytes() + (0 if table is None else table.numel() * 8)


@pytest.fixture
def checked(monkeypatch):
    """Every call of ``device_buffer_bytes`` (the bound asks at each check) compared with a fresh count; yields the
    list of (kept, fresh) pairs seen."""
    seen = []
    kept = BlockStore.device_buffer_bytes

    def checking(self):
        value = kept(self)
        seen.append((value, _fresh(self)))
        assert value == seen[-1][1], f"layer {self.layer_idx}: kept {value} bytes, the buffers hold {seen[-1][1]}"
        return value

    monkeypatch.setattr(BlockStore, "device_buffer_bytes", checking)
    return seen


def _generate(model, cache, ids, new=6, **kw):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                              max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)  # fmt: skip


def test_kept_count_follows_every_buffer_change(checked):
    model = build_model("llama")
    ids, _ = left_padded([70, 70], seed=3)
    cache = OffloadCache(model, device_memory_gib=1.0, **SETTINGS)
    out = _generate(model, cache, ids, new=12)  # seals during prefill and decode
    cache.reserve(400)  # the summaries and tables replaced by larger ones
    out = _generate(model, cache, out, new=4)
    cache.crop(60)
    cache.batch_select_indices(torch.tensor([1]))
    _generate(model, cache, out[1:, :60], new=4)
    prefix = OffloadCache(model, device_memory_gib=1.0, **SETTINGS)
    doc = ids[:1]
    with torch.no_grad():
        model(input_ids=doc, attention_mask=torch.ones_like(doc), past_key_values=prefix)
    fork = prefix.fork(batch=2)
    _generate(model, fork, torch.cat([doc.expand(2, -1), ids[:, :5]], 1))
    again = prefix.fork(batch=2, into=fork)
    _generate(model, again, torch.cat([doc.expand(2, -1), ids[:, 5:10]], 1))
    cache.reset()
    _generate(model, cache, ids[:, :40])  # a new prompt: new pools, whose ids may be the old ones'
    sizes = {fresh for _, fresh in checked}
    assert len(checked) > 100 and len(sizes) > 3  # asked often, over buffers that changed


def test_kept_count_follows_coarsened_summaries(checked):
    # A bound between the two levels' summary bytes: a later growth re-encodes the held summaries (same number of
    # summary buffers, new ones in their place).
    model = build_model("llama")
    ids, _ = left_padded([300, 300], seed=5)
    probe = OffloadCache(model, **SETTINGS)
    _generate(model, probe, ids, new=2)
    layers = probe.offload_layers
    buffers = sum(layer.blocks.device_buffer_bytes() for layer in layers)
    summaries = sum(layer.blocks.device_summary_bytes() for layer in layers)
    cache = OffloadCache(model, device_memory_gib=(buffers - 0.4 * summaries) / 2**30, **SETTINGS)
    with pytest.warns(RuntimeWarning, match="re-encoded"):
        _generate(model, cache, ids, new=2)
    assert cache.stats()["summary_levels"]
    for layer in cache.offload_layers:
        assert layer.blocks.device_buffer_bytes() == _fresh(layer.blocks)
