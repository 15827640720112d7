"""The paged decode attention kernel gives the output and log-sum-exp of its pure-torch reference: blocks read in
place from admitted chunks or from their slots, the open block from the last slot, padding and entries not kept
masked; shared and per-head selections, several splits; and the cache's decode steps through it give the tokens of
the slot-pool path. Runs where Triton can run: on CUDA, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch

from hf_offload import OffloadCache
import hf_offload.kernels.quantkey as quantkey_kernels
import hf_offload.kernels.tail as tail_kernels
from hf_offload.kernels.paged import paged_decode, paged_decode_reference, paged_decode_supported
from hf_offload.store.device import DeviceSlotPool
from ..helpers import build_model, left_padded

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton

# Triton's interpreter keeps bfloat16 as raw 16-bit integers and its tl.dot multiplies those bits (triton 3.6,
# interpreter.create_dot), so on the CPU the half-precision case is float16.
HALF = [torch.bfloat16, torch.float16] if DEVICE.type == "cuda" else [torch.float16]


def _case(seed, batch, heads, group, head_dim, tokens, slots, k, per_head, dtype, chunk_blocks=4, n_chunks=4):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(DEVICE)  # noqa: E731
    chunks = [rand(chunk_blocks, 2, heads, tokens, head_dim) for _ in range(n_chunks)]
    admitted = [bool(i % 2) for i in range(n_chunks)]  # chunks 1 and 3 "in device memory"
    n_ids = chunk_blocks * n_chunks
    n_blocks = n_ids // batch
    table = torch.stack([torch.randperm(n_ids, generator=g)[:n_blocks] for _ in range(batch)])  # [B, n_blocks]
    table = torch.cat([table, torch.full((batch, 3), -1)], dim=1).to(DEVICE)  # capacity past the sealed blocks
    rows_sel = heads if per_head else 1
    blocks = torch.stack([torch.randperm(n_blocks, generator=g)[:k] for _ in range(batch * rows_sel)])
    blocks = blocks.view(batch, rows_sel, k).to(DEVICE)
    keep = (torch.rand(batch, rows_sel, k, generator=g) > 0.25).to(DEVICE)
    slots_t = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(batch * heads)])
    slots_t = slots_t.view(batch, heads, k).to(DEVICE)
    pool = rand(2, batch, heads, slots + 1, tokens, head_dim)
    rows = torch.rand(batch, n_blocks + 2, tokens, generator=g) > 0.2
    rows[:, n_blocks + 1] = False
    rows[:, n_blocks, 0] = True  # the open block always has its first token
    rows = rows.to(DEVICE)
    query = rand(batch, heads, group, head_dim)
    addrs = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64, device=DEVICE)
    on_host = torch.tensor([not a for a in admitted] + [False], device=DEVICE)
    return dict(query=query, blocks=blocks, keep=keep, slots=slots_t, rows=rows, open_row=n_blocks, table=table,
                chunks=chunks, admitted=admitted, addrs=addrs, on_host=on_host, chunk_blocks=chunk_blocks, pool=pool)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
def test_paged_decode_matches_the_reference(per_head, splits, dtype):
    c = _case(7 + splits if splits else 5, batch=2, heads=2, group=3, head_dim=16, tokens=8, slots=9, k=7,
              per_head=per_head, dtype=dtype)  # fmt: skip
    assert paged_decode_supported(c["pool"])
    scaling = 0.25
    ref_out, ref_lse = paged_decode_reference(
        c["query"], scaling, c["blocks"], c["keep"], c["slots"], c["rows"], c["open_row"], c["table"], c["chunks"],
        c["admitted"], c["pool"],
    )  # fmt: skip
    out, lse = paged_decode(
        c["query"], scaling, c["blocks"], c["keep"], c["slots"], c["rows"], c["open_row"], c["table"], c["addrs"],
        c["on_host"], c["chunk_blocks"], c["pool"], splits=splits, block_e=2,
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # half precision: the kernel rounds the probabilities to it
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=tol)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    # The admitted chunks are really read in place: changing one admitted block that is selected changes the output.
    kept_ids = c["table"].gather(1, torch.where(c["keep"], c["blocks"], 0).flatten(1))[c["keep"].flatten(1)]
    admitted_ids = [i for i in kept_ids.tolist() if c["admitted"][i // c["chunk_blocks"]]]
    assert admitted_ids, "the case selects no admitted block"
    block = admitted_ids[0]
    c["chunks"][block // c["chunk_blocks"]][block % c["chunk_blocks"]] += 1.0
    out2, _ = paged_decode(
        c["query"], scaling, c["blocks"], c["keep"], c["slots"], c["rows"], c["open_row"], c["table"], c["addrs"],
        c["on_host"], c["chunk_blocks"], c["pool"], splits=splits, block_e=2,
    )  # fmt: skip
    assert not torch.allclose(out2, out)


@pytest.mark.cuda
@pytest.mark.parametrize("block_e,splits", [(4, None), (8, 3), (2, 1)])
def test_paged_decode_at_a_real_shape(block_e, splits):
    """The 8B shape's heads, 16-token blocks, 60 selected blocks in many tiles per program, bfloat16."""
    c = _case(11, batch=3, heads=8, group=4, head_dim=128, tokens=16, slots=75, k=60, per_head=False,
              dtype=torch.bfloat16, chunk_blocks=16, n_chunks=12)  # fmt: skip
    args = (c["query"], 0.088, c["blocks"], c["keep"], c["slots"], c["rows"], c["open_row"], c["table"])
    ref_out, ref_lse = paged_decode_reference(*args, c["chunks"], c["admitted"], c["pool"])
    out, lse = paged_decode(*args, c["addrs"], c["on_host"], c["chunk_blocks"], c["pool"], block_e=block_e,
                            splits=splits)  # fmt: skip
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=2e-2)


def test_paged_decode_in_output_dtype_and_nothing_but_the_open_block():
    c = _case(3, batch=1, heads=2, group=4, head_dim=32, tokens=8, slots=5, k=4, per_head=False,
              dtype=HALF[0])  # fmt: skip
    keep = torch.zeros_like(c["keep"])  # nothing selected: the open block alone
    args = (c["query"], 0.3, c["blocks"], keep, c["slots"], c["rows"], c["open_row"], c["table"])
    ref_out, ref_lse = paged_decode_reference(*args, c["chunks"], c["admitted"], c["pool"])
    out, lse = paged_decode(*args, c["addrs"], c["on_host"], c["chunk_blocks"], c["pool"], out_dtype=HALF[0])
    assert out.dtype == HALF[0]
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=2e-2)


# A shared selection, one per KV head, the default selector (its estimate of the unselected blocks merges with the
# kernel's log-sum-exp), and lookahead (its prefetch leaves admitted blocks alone).
@pytest.mark.parametrize("selector,lookahead", [("solohead", False), ("headwise", False),
                                                ("quantkey[bits=4,tail_bits=2,tail_near=3]", False),
                                                ("solohead", True)])  # fmt: skip
def test_cache_decodes_the_tokens_of_the_pool_path(selector, lookahead, monkeypatch):
    """Greedy tokens through the paged kernel (admitted chunks read in place, others from slots) equal those of the
    slot-pool path, with some chunks admitted and some offloaded, left padding included; fewer bytes are recalled."""
    if DEVICE.type == "cpu":
        # The selector's own kernels (tested in test_kernel_quantkey.py and test_kernel_tail.py) take minutes under
        # the interpreter; here its torch code selects and estimates, in both runs alike.
        monkeypatch.setattr(quantkey_kernels, "block_lse_supported", lambda *args: False)
        monkeypatch.setattr(tail_kernels, "tail_kernel_supported", lambda *args: False)
    model = build_model("llama").to(DEVICE)
    ids, mask = left_padded([120, 97], seed=3)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    block_bytes = 2 * 2 * 8 * 16 * 4  # K and V, 2 KV heads, 8 tokens, head_dim 16, float32
    settings = dict(budget_tokens=64, block_tokens=8, selector=selector, transfer="kernel",
                    host_chunk_mib=4 * block_bytes / 2**20, lookahead=lookahead)  # fmt: skip

    def two_turns(cache):
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=10, do_sample=False)
        # A second turn on the same cache: its prefill reads admitted blocks through the slot pool (copies), then
        # decode steps read them in place again.
        more = torch.cat([out, torch.randint(3, 90, (2, 21), generator=torch.Generator().manual_seed(1)).to(DEVICE)], 1)
        mask2 = torch.cat([mask, torch.ones_like(more[:, mask.shape[1]:])], 1)
        return model.generate(more, attention_mask=mask2, past_key_values=cache, max_new_tokens=8, do_sample=False)

    probe = OffloadCache(model, admission="always", **settings)
    two_turns(probe)
    buffers = sum(layer.blocks.device_buffer_bytes() for layer in probe.offload_layers)
    results = {}
    for attention in ("pool", "paged"):
        # Chunks of 4 blocks; device_memory_gib holds the cache's buffers and four chunks (of the ~14 the two layers
        # fill), the rest offloaded.
        cache = OffloadCache(model, admission="auto", device_memory_gib=(buffers + 16 * block_bytes) / 2**30,
                             decode_attention=attention, **settings)  # fmt: skip
        out = two_turns(cache)
        layer = cache.offload_layers[0]
        assert layer.execution.paged == (attention == "paged")
        assert 0 < layer.blocks.host.admitted_chunks < len(layer.blocks.host.chunks)
        results[attention] = (out, cache.stats())
    assert torch.equal(results["paged"][0], results["pool"][0])
    assert results["paged"][1]["recalled_bytes"] < results["pool"][1]["recalled_bytes"]
    if lookahead:
        assert results["paged"][1]["prefetched_blocks"] > 0


@pytest.mark.parametrize("selector", ["solohead", "quantkey[bits=4,tail_bits=2,tail_near=3]"])
def test_a_layer_with_every_chunk_admitted_skips_the_slot_pool(selector, monkeypatch):
    """While every chunk of a layer lies in device memory, its decode steps take no slots and recall nothing (the
    paged kernel reads every block in place), and give the slot-pool path's tokens and lookup counts; once a chunk
    goes to host memory, recall resumes and the tokens still agree."""
    if DEVICE.type == "cpu":
        monkeypatch.setattr(quantkey_kernels, "block_lse_supported", lambda *args: False)
        monkeypatch.setattr(tail_kernels, "tail_kernel_supported", lambda *args: False)
    model = build_model("llama").to(DEVICE)
    ids, mask = left_padded([120, 97], seed=4)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    block_bytes = 2 * 2 * 8 * 16 * 4  # K and V, 2 KV heads, 8 tokens, head_dim 16, float32
    assigned = []  # decode steps' slot assignments: the paged run's first turn makes none
    original_assign = DeviceSlotPool.assign

    def counted_assign(pool, *args, **kwargs):
        assigned.append(1)
        return original_assign(pool, *args, **kwargs)

    monkeypatch.setattr(DeviceSlotPool, "assign", counted_assign)
    settings = dict(budget_tokens=48, block_tokens=8, selector=selector, transfer="kernel",
                    host_chunk_mib=4 * block_bytes / 2**20)  # fmt: skip
    probe = OffloadCache(model, admission="always", **settings)
    model.generate(ids, attention_mask=mask, past_key_values=probe, max_new_tokens=6, do_sample=False)
    buffers = sum(layer.blocks.device_buffer_bytes() for layer in probe.offload_layers)
    results = {}
    for attention in ("pool", "paged"):
        assigned.clear()
        # Chunks of 4 blocks; the first turn's 15 blocks per sequence fill 8 chunks per layer (16 in all: with the
        # cache's buffers, the device bound); the second turn's blocks need more chunks, which go to host memory.
        cache = OffloadCache(model, admission="auto", device_memory_gib=(buffers + 16 * 4 * block_bytes) / 2**30,
                             decode_attention=attention, **settings)  # fmt: skip
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=6, do_sample=False)
        layers = cache.offload_layers
        assert all(layer.blocks.host.all_admitted for layer in layers)
        assert (len(assigned) == 0) == (attention == "paged")
        first = cache.stats()
        more = torch.cat([out, torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(2)).to(DEVICE)], 1)
        mask2 = torch.cat([mask, torch.ones_like(more[:, mask.shape[1]:])], 1)
        out2 = model.generate(more, attention_mask=mask2, past_key_values=cache, max_new_tokens=8, do_sample=False)
        assert not any(layer.blocks.host.all_admitted for layer in layers)
        assert all(0 < layer.blocks.host.admitted_chunks < len(layer.blocks.host.chunks) for layer in layers)
        results[attention] = (out, first, out2, cache.stats())
    (out_pool, first_pool, out2_pool, _), (out_paged, first_paged, out2_paged, last_paged) = results.values()
    assert torch.equal(out_paged, out_pool) and torch.equal(out2_paged, out2_pool)
    assert first_paged["decode_recalled_bytes"] == 0 < first_pool["decode_recalled_bytes"]
    assert first_paged["hit_rate"] == 1.0
    lookups = {name: [layer["lookups"] for layer in stats["layers"].values()]
               for name, stats in (("pool", first_pool), ("paged", first_paged))}  # fmt: skip
    assert lookups["paged"] == lookups["pool"] and min(lookups["paged"]) > 0
    assert last_paged["decode_host_bytes"] > 0  # the host chunks' blocks were recalled in the second turn
