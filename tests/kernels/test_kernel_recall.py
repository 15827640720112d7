"""A decode step's recall of a shared selection in one launch (``kernels/recall.py``) moves the bytes and counts what
the torch code and the copy kernel it replaces do: the slot pool after it, the kept / recalled / from-host counts,
the pool-keep mask; and the cache's decode steps through it give the tokens and every counter of the separate
operations, with blocks admitted to the device and without. Runs where Triton can run: on CUDA, or on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch

import hf_offload.cache.recaller as recaller_module
import hf_offload.kernels.quantkey as quantkey_kernels
import hf_offload.kernels.tail as tail_kernels
from hf_offload import OffloadCache
from hf_offload.kernels.recall import pool_keep, pool_keep_reference, recall_entries, recall_entries_reference
from ..helpers import build_model, left_padded

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton


def _case(seed, batch=3, heads=2, tokens=4, head_dim=8, slots=6, n=5, chunk_blocks=4, n_chunks=5, sel_heads=1):
    g = torch.Generator().manual_seed(seed)
    chunks = [torch.randn(chunk_blocks, 2, heads, tokens, head_dim, generator=g).to(DEVICE) for _ in range(n_chunks)]
    admitted = [i % 2 == 1 for i in range(n_chunks)]
    n_ids = chunk_blocks * n_chunks
    n_blocks = n_ids // batch
    table = torch.stack([torch.randperm(n_ids, generator=g)[:n_blocks] for _ in range(batch)])
    table[0, 1] = -1  # a block without an id: counted when missed, never copied
    capacity = n_blocks + 3
    table = torch.cat([table, torch.full((batch, 3), -1)], dim=1).to(DEVICE)
    blocks = torch.stack([torch.randperm(n_blocks, generator=g)[:n] for _ in range(batch)])[:, None]
    blocks[0, 0, 0] = 1
    blocks = blocks.expand(batch, sel_heads, n).contiguous().to(DEVICE)
    keep = (torch.rand(batch, 1, n, generator=g) > 0.2).expand(batch, sel_heads, n).contiguous().to(DEVICE)
    miss = keep[:, :1].expand(batch, heads, n) & (torch.rand(batch, 1, n, generator=g) > 0.4).to(DEVICE)
    miss[0, :, 0] = True
    slot = torch.stack([torch.randperm(slots, generator=g)[:n] for _ in range(batch)])[:, None]
    slot = slot.expand(batch, heads, n).contiguous().to(DEVICE)
    pool = torch.randn(2, batch, heads, slots + 1, tokens, head_dim, generator=g).to(DEVICE)
    addrs = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64, device=DEVICE)
    # Room for more chunks than there are (zeros), and the last entry False, as the host pool keeps its table.
    on_host = torch.zeros(n_chunks + 4, dtype=torch.bool)
    on_host[:n_chunks] = torch.tensor([not a for a in admitted])
    return dict(blocks=blocks, keep=keep, miss=miss, slots=slot, table=table, addrs=addrs, on_host=on_host.to(DEVICE),
                chunk_blocks=chunk_blocks, block_words=2 * heads * tokens * head_dim, pool=pool, chunks=chunks,
                capacity=capacity)  # fmt: skip


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("sel_heads", [1, 2])
def test_recall_entries_moves_and_counts_as_the_copy_kernel_and_torch(seed, sel_heads):
    c = _case(seed, sel_heads=sel_heads)
    args = (c["blocks"], c["keep"], c["miss"], c["slots"], c["table"], c["addrs"], c["on_host"], c["chunk_blocks"],
            c["block_words"])  # fmt: skip
    got_pool, want_pool = c["pool"].clone(), c["pool"].clone()
    got, want = (torch.full((3,), 5, dtype=torch.int64, device=DEVICE) for _ in range(2))
    recall_entries(*args, got_pool, got, words_per_program=16)  # pieces of 32 words: two programs each
    recall_entries_reference(*args, want_pool, want)
    assert torch.equal(got_pool, want_pool) and torch.equal(got, want)
    assert not torch.equal(got_pool, c["pool"])  # something moved
    # The counts by hand: kept entries, missed entries (the one without an id included), those on host chunks.
    missed = c["miss"][:, 0].cpu()
    ids = torch.where(missed, c["table"].cpu().gather(1, torch.where(missed, c["blocks"][:, 0].cpu(), 0)), -1)
    on_host = [c["on_host"][int(i) // c["chunk_blocks"]].item() if i >= 0 else False for i in ids[missed].tolist()]
    assert got.tolist() == [5 + int(c["keep"][:, 0].sum()), 5 + int(missed.sum()), 5 + sum(on_host)]
    # Missed blocks with an id hold their host block in their slot; entries not missed keep the pool's bytes.
    for b, j in missed.nonzero().tolist():
        block_id = int(ids[b, j])
        slot = int(c["slots"][b, 0, j])
        if block_id < 0:
            assert torch.equal(got_pool[:, b, :, slot], c["pool"][:, b, :, slot])
            continue
        host = c["chunks"][block_id // c["chunk_blocks"]][block_id % c["chunk_blocks"]]
        assert torch.equal(got_pool[:, b, :, slot].cpu(), host.cpu())
    # Without counts: the same bytes.
    again = c["pool"].clone()
    recall_entries(*args, again, None)
    assert torch.equal(again, want_pool)


@pytest.mark.parametrize("sel_heads", [1, 2])
def test_pool_keep_matches_the_torch_code(sel_heads):
    c = _case(7, batch=4, n=9, slots=12, n_chunks=10, sel_heads=sel_heads)
    blocks = c["blocks"].clone()
    blocks[1, :, 2] = c["capacity"] + 5  # an entry past the table (not kept): any column serves it
    keep = c["keep"].clone()
    keep[1, :, 2] = False
    args = (blocks, keep, c["table"], c["on_host"], c["chunk_blocks"])
    got, want = pool_keep(*args), pool_keep_reference(*args)
    assert got.dtype == torch.bool and torch.equal(got, want)
    assert want.any() and (keep & ~want).any()  # some kept entries lie in admitted chunks


@pytest.mark.parametrize("admission,selector,attention", [
    ("always", "solohead", "paged"), ("auto", "solohead", "paged"), ("auto", "solohead", "pool"),
    ("always", "quantkey[bits=4,tail_bits=2,tail_near=3]", "paged"),
    ("auto", "quantkey[bits=4,tail_bits=2,tail_near=3]", "paged")])  # fmt: skip
def test_cache_counts_and_tokens_equal_the_separate_operations(admission, selector, attention, monkeypatch):
    """Greedy tokens and every counter of a cache whose decode steps recall through the one launch
    equal those of the separate operations, in host memory only and with some chunks admitted (read in place by the
    paged attention, or recalled from device memory into slots by the pool path)."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(quantkey_kernels, "block_lse_supported", lambda *args: False)
        monkeypatch.setattr(tail_kernels, "tail_kernel_supported", lambda *args: False)
    model = build_model("llama").to(DEVICE)
    ids, mask = left_padded([80, 61], seed=5)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    block_bytes = 2 * 2 * 8 * 16 * 4  # K and V, 2 KV heads, 8 tokens, head_dim 16, float32
    settings = dict(budget_tokens=48, block_tokens=8, selector=selector, transfer="kernel", cuda_graphs=False,
                    host_chunk_mib=4 * block_bytes / 2**20, decode_attention=attention)  # fmt: skip
    if admission == "auto":
        probe = OffloadCache(model, admission="always", **settings)
        model.generate(ids, attention_mask=mask, past_key_values=probe, max_new_tokens=5, do_sample=False)
        buffers = sum(layer.blocks.device_buffer_bytes() for layer in probe.offload_layers)
        settings.update(admission="auto", device_memory_gib=(buffers + 16 * block_bytes) / 2**30)
    else:
        settings.update(admission="always")
    calls = []
    fused = recaller_module.Recaller._recall_entries
    monkeypatch.setattr(recaller_module.Recaller, "_recall_entries",
                        lambda self, *a: calls.append(1) or fused(self, *a))  # fmt: skip
    results = {}
    for on in (True, False):
        monkeypatch.setattr(recaller_module, "FUSED_RECALL", on)
        calls.clear()
        cache = OffloadCache(model, **settings)
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False)
        assert (len(calls) > 0) == on
        if admission == "auto":
            host = cache.offload_layers[0].blocks.host
            assert 0 < host.admitted_chunks < len(host.chunks)
        results[on] = (out, cache.stats())
    assert torch.equal(results[True][0], results[False][0])
    fused_stats, separate = results[True][1], results[False][1]
    for name in ("hit_rate", "recalled_blocks", "recalled_bytes", "decode_recalled_blocks", "decode_recalled_bytes",
                 "decode_host_bytes", "decode_steps"):  # fmt: skip
        assert fused_stats[name] == separate[name], name
    assert fused_stats["decode_recalled_blocks"] > 0
    if attention == "pool" and admission == "auto":  # some recalls read admitted chunks: not host bytes
        assert 0 < fused_stats["decode_host_bytes"] < fused_stats["decode_recalled_bytes"]
    # A reset zeroes the kernel's counts with the rest.
    layer_stats = cache.offload_layers[0].stats
    layer_stats.reset()
    assert int(layer_stats.recalled_blocks) == 0 and int(layer_stats.lookups) == 0
