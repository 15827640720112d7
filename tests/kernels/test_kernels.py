"""The copy kernels: bit-exact against their reference, and the kernel transfer path end to end.

Runs where Triton can run: on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache
from hf_offload.attention import offload_attention_forward, take_handoff
from hf_offload.kernels.gather import copy_pieces, copy_pieces_reference
from hf_offload.store import HostBlockPool, HostMemoryBudget

from ..helpers import TINY_PREFILL as SMALL
from ..helpers import build_model, left_padded

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton


def _pool(block_shape, dtype, chunk_blocks=3):
    nbytes = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()
    return HostBlockPool(block_shape, dtype, DEVICE.type == "cuda", chunk_blocks * nbytes, HostMemoryBudget(None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("to_host", [False, True])
@pytest.mark.parametrize("group, split", [(1, 1), (2, 1), (4, 2), (8, 1)])
def test_copy_pieces_bit_exact_against_reference(dtype, to_host, group, split):
    """One piece per program, or groups of pieces per program (a group of only skipped pieces, a group of skipped
    and copied ones), each piece in one or two programs."""
    g = torch.Generator().manual_seed(0)
    host = _pool((2, 2, 8, 16), dtype)
    ids = host.allocate(8)  # three chunks
    for chunk in host.chunks:
        chunk.view(torch.int16 if dtype != torch.float32 else torch.int32).random_(generator=g)
    words = host.block_words
    n_pieces, piece_words = 8, words // 4
    piece_ids = torch.tensor([ids[7], -1, ids[0], ids[4], ids[4], ids[2], -1, -1], dtype=torch.int64)
    host_off = torch.tensor([0, 0, 1, 2, 3, 0, 1, 2], dtype=torch.int64) * piece_words
    dev_off = torch.randperm(10, generator=g)[:n_pieces] * piece_words
    device_tensor = torch.randn(10 * piece_words * 4 // torch.empty((), dtype=dtype).element_size(), generator=g).to(dtype)
    ref_chunks = [c.clone() for c in host.chunks]
    ref_device = device_tensor.clone()
    got_device = device_tensor.to(DEVICE)
    copy_pieces(
        host.chunk_addrs(DEVICE), host.chunk_blocks, words, piece_ids.to(DEVICE), host_off.to(DEVICE), got_device,
        dev_off.to(DEVICE), piece_words, to_host, words_per_program=piece_words // split, pieces_per_program=group,
    )  # fmt: skip
    copy_pieces_reference(ref_chunks, host.chunk_blocks, piece_ids, host_off, ref_device, dev_off, piece_words, to_host)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(got_device.cpu().view(torch.int8), ref_device.view(torch.int8))
    for got, ref in zip(host.chunks, ref_chunks):
        assert torch.equal(got.view(torch.int8), ref.view(torch.int8))


@pytest.mark.parametrize("selector", ["solohead", "headwise"])
def test_kernel_transfer_token_identical_to_dynamic_cache(selector):
    model = build_model("qwen2").to(DEVICE)
    ids, mask = left_padded([37, 29, 18], seed=1)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    with torch.no_grad():
        expected = model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config), max_new_tokens=8,
            do_sample=False,
        )
        cache = OffloadCache(model, budget_tokens=4096, selector=selector, transfer="kernel", **SMALL)
        got = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert all(layer.execution.use_kernels for layer in cache.offload_layers)
    assert torch.equal(got, expected)
    assert cache.stats()["recalled_blocks"] > 0


@pytest.mark.parametrize("selector", ["solohead", "headwise"])
def test_kernel_and_torch_transfer_agree_in_sparse_mode(selector):
    """Same selections, same slots, same bytes: the two transfer paths give identical sparse outputs and state."""
    model = build_model("llama").to(DEVICE)
    ids, mask = left_padded([70, 51], seed=2)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    runs = {}
    for transfer in ("kernel", "torch"):
        cache = OffloadCache(model, budget_tokens=40, selector=selector, transfer=transfer, admission="always",
                             **SMALL)  # fmt: skip
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                                 do_sample=False)  # fmt: skip
        runs[transfer] = (out, cache.stats(), cache.dense_kv(0))
    assert torch.equal(runs["kernel"][0], runs["torch"][0])
    for key in ("recalled_blocks", "recalled_bytes", "hit_rate", "host_kv_bytes"):
        assert runs["kernel"][1][key] == runs["torch"][1][key], key
    assert torch.equal(runs["kernel"][2][0], runs["torch"][2][0])


@pytest.mark.parametrize("selector", ["solohead"])
def test_kernel_path_with_a_decode_capacity(selector):
    """Steps that score 16-block capacities recall through the device block table past the sealed blocks (-1
    there) and give the tokens and recall counts of steps over the sealed blocks. (quantkey with capacities runs in
    tests/test_decode_capacity.py on the torch path and in tests/test_cuda_graphs.py on CUDA; under the interpreter
    its scoring kernel takes half a minute here.)"""
    model = build_model("llama").to(DEVICE)
    ids, mask = left_padded([70, 51], seed=2)
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    runs = {}
    for capacity in (1, 16):
        cache = OffloadCache(model, budget_tokens=40, selector=selector, transfer="kernel", decode_capacity_blocks=capacity,
                             **SMALL)  # fmt: skip
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12,
                                 do_sample=False)  # fmt: skip
        runs[capacity] = (out, cache.stats())
        layer = cache.offload_layers[0]
        assert layer.blocks.block_table_dev.shape[1] >= 16
        assert torch.equal(layer.blocks.block_table_dev[:, : layer.n_blocks].cpu(), layer.blocks.block_table)
        assert (layer.blocks.block_table_dev[:, layer.n_blocks :] == -1).all()
    assert torch.equal(runs[16][0], runs[1][0])
    for key in ("recalled_blocks", "decode_recalled_blocks", "hit_rate"):
        assert runs[16][1][key] == runs[1][1][key], key


def test_kernel_path_slots_never_stale():
    model = build_model("llama").to(DEVICE)
    cache = OffloadCache(model, budget_tokens=32, selector="headwise", transfer="kernel", **SMALL)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(3)
    for q_len in [21, 1, 1, 17] + [1] * 10:
        k, v = torch.randn(2, 2, q_len, 16, generator=g).to(DEVICE), torch.randn(2, 2, q_len, 16, generator=g).to(DEVICE)
        layer.update(k, v)
        offload_attention_forward(take_handoff(), torch.randn(2, 4, q_len, 16, generator=g).to(DEVICE), None)
        dense_k, dense_v = layer.dense_kv()
        pool = layer.blocks.pool
        for b, h, s in (pool.block >= 0).nonzero().tolist():
            j = pool.block[b, h, s].item()
            assert torch.equal(pool.data[0, b, h, s], dense_k[b, h, j * 8 : (j + 1) * 8])
            assert torch.equal(pool.data[1, b, h, s], dense_v[b, h, j * 8 : (j + 1) * 8])


def test_copy_pieces_reads_expanded_index_tensors():
    """One block recalled as its 2 x kv_heads pieces: the recall builds the piece ids with expand(), and for a single
    entry flatten() returns a stride-0 view. The kernel must read its 4 ids, not 1 id and 3 words past it."""
    g = torch.Generator().manual_seed(1)
    host = _pool((2, 2, 8, 16), torch.float32)
    ids = host.allocate(5)
    for chunk in host.chunks:
        chunk.view(torch.int32).random_(generator=g)
    words = host.block_words
    piece_words = words // 4
    one = ids[3:4].to(DEVICE)
    piece_ids = one[:, None].expand(-1, 4).flatten()
    assert piece_ids.stride() == (0,)  # the layout that was read out of bounds
    host_off = (torch.arange(4, device=DEVICE) * piece_words)[None, :].expand(1, -1).flatten()
    dev_off = torch.tensor([3, 0, 2, 1], device=DEVICE) * piece_words
    got = torch.zeros(4 * piece_words, dtype=torch.float32, device=DEVICE)
    expected = torch.zeros(4 * piece_words, dtype=torch.float32)
    copy_pieces(host.chunk_addrs(DEVICE), host.chunk_blocks, words, piece_ids, host_off, got, dev_off, piece_words,
                False)  # fmt: skip
    copy_pieces_reference([c.clone() for c in host.chunks], host.chunk_blocks, piece_ids.cpu().contiguous(),
                          host_off.cpu().contiguous(), expected, dev_off.cpu(), piece_words, False)  # fmt: skip
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(got.cpu().view(torch.int32), expected.view(torch.int32))
