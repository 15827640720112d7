"""The one-launch seal of a full block (``hf_offload.kernels.seal``) against the operations it replaces: codes,
minima and steps bit for bit equal to ``quantize_keys_reference`` (keys and values, 1 to 8 bits, float16, bfloat16 and
float32, exact ties of the rounding, constant channels), the block in its pool block, the block table's column, and
nothing else written. Runs where Triton can run: on CUDA, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_offload.kernels.quant import quantize_keys, quantize_keys_reference
from hf_offload.kernels.seal import quantize_blocks, quantize_blocks_supported, seal_block, seal_block_supported

from ..cache.test_layer_graphs_cpu import _assert_same_sealed_state
from ..cache.test_layer_graphs_cpu import seal_capture_fails, stand_in_graphs  # noqa: F401 (fixtures)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton

BATCH, HEADS, TOKENS, DIM, CAPACITY, CHUNK_BLOCKS = 3, 2, 16, 64, 6, 4


def _stores(bits: int, value_bits: int, dtype) -> dict[str, torch.Tensor]:
    shape = (BATCH, CAPACITY, HEADS)
    out = {"codes": torch.full((*shape, TOKENS, DIM * bits // 8), 7, dtype=torch.uint8, device=DEVICE),
           "kmin": torch.full((*shape, DIM), 5.0, dtype=dtype, device=DEVICE),
           "kstep": torch.full((*shape, DIM), 6.0, dtype=dtype, device=DEVICE)}  # fmt: skip
    if value_bits:
        out.update(vcodes=torch.full((*shape, TOKENS, DIM * value_bits // 8), 9, dtype=torch.uint8, device=DEVICE),
                   vmin=torch.full((*shape, DIM), 3.0, dtype=dtype, device=DEVICE),
                   vstep=torch.full((*shape, DIM), 4.0, dtype=dtype, device=DEVICE))  # fmt: skip
    return out


def _block(dtype, seed: int, ties: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (BATCH, HEADS, TOKENS, DIM)
    if ties:
        # Values on a grid of half steps between 0 and 3 (the 2-bit step is then 1): every odd multiple of 0.5 is a
        # tie of the rounding, to be broken to the even code.
        k = torch.randint(0, 7, shape, generator=g).float() * 0.5
        k[..., 0, :], k[..., 1, :] = 0.0, 3.0
        v = k.flip(-2)
    else:
        k, v = torch.randn(shape, generator=g) * 4.0, torch.randn(shape, generator=g)
        k[:, :, :, 3] = 1.25  # a constant channel: a zero step, every code 0
    # A strided view, as the open block lives in the slot pool: [batch, heads, tokens, dim] with a larger batch stride.
    room = torch.zeros((BATCH, HEADS + 1, TOKENS, DIM), dtype=dtype, device=DEVICE)
    vroom = torch.zeros_like(room)
    room[:, :HEADS] = k.to(dtype)
    vroom[:, :HEADS] = v.to(dtype)
    return room[:, :HEADS], vroom[:, :HEADS]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits,value_bits", [(2, 0), (4, 2), (1, 8), (8, 4)])
@pytest.mark.parametrize("ties", [False, True])
def test_seal_block_matches_the_operations_it_replaces(dtype, bits, value_bits, ties):
    keys, values = _block(dtype, seed=bits * 10 + value_bits, ties=ties)
    stores = _stores(bits, value_bits, dtype)
    before = {name: t.clone() for name, t in stores.items()}
    pos, ids = 4, torch.tensor([5, 0, 2])  # two chunks of the pool, blocks in both
    args = torch.cat([torch.tensor([pos]), ids]).to(DEVICE)
    chunks = [torch.zeros((CHUNK_BLOCKS, 2, HEADS, TOKENS, DIM), dtype=dtype, device=DEVICE) for _ in range(2)]
    addrs = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64, device=DEVICE)
    table = torch.full((BATCH, CAPACITY), -1, dtype=torch.int64, device=DEVICE)
    assert seal_block_supported(keys, stores, bits, value_bits)
    seal_block(keys, values, args, stores, bits, value_bits, chunk_addrs=addrs, chunk_blocks=CHUNK_BLOCKS, table=table)

    want = quantize_keys_reference(keys.unsqueeze(1), bits)  # [batch, 1, heads, ...]
    if value_bits:
        vwant = quantize_keys_reference(values.unsqueeze(1), value_bits)
        want.update(vcodes=vwant["codes"], vmin=vwant["kmin"], vstep=vwant["kstep"])
    assert sorted(want) == sorted(stores)
    for name in want:
        got = stores[name]
        assert torch.equal(got[:, pos], want[name][:, 0]), name
        other = torch.ones(CAPACITY, dtype=torch.bool)
        other[pos] = False
        assert torch.equal(got[:, other], before[name][:, other]), f"{name}: another position was written"
    for seq, block_id in enumerate(ids.tolist()):
        stored = chunks[block_id // CHUNK_BLOCKS][block_id % CHUNK_BLOCKS]
        assert torch.equal(stored[0], keys[seq]) and torch.equal(stored[1], values[seq])
    untouched = [(0, 1), (0, 3), (1, 0), (1, 2), (1, 3)]  # (chunk, block) pairs no id names
    assert all(not chunks[c][b].any() for c, b in untouched)
    assert torch.equal(table[:, pos].cpu(), ids)
    assert (table[:, torch.arange(CAPACITY) != pos] == -1).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("ties", [False, True])
def test_quantize_blocks_matches_the_reference(dtype, bits, ties):
    """Many blocks at once (a prefill's seal), from a strided view of the keys: the reference's codes, minima and
    steps bit for bit; ``quantize_keys`` takes this kernel where it runs and the reference elsewhere."""
    keys, values = _block(dtype, seed=bits, ties=ties)  # [batch, heads, tokens, dim] strided
    blocks = torch.stack([keys, values, keys.flip(-2)], dim=1)  # [batch, 3 blocks, heads, tokens, dim]
    wide = torch.zeros((*blocks.shape[:-1], DIM + 8), dtype=dtype, device=DEVICE)
    wide[..., :DIM] = blocks
    blocks = wide[..., :DIM]  # not contiguous: a larger stride per token
    assert quantize_blocks_supported(blocks, bits) and not blocks.is_contiguous()
    got, want = quantize_blocks(blocks, bits), quantize_keys_reference(blocks, bits)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        assert torch.equal(quantize_keys(blocks, bits)[name], want[name]), name
    odd = torch.randn(2, 2, 1, 16, 6, device=DEVICE).to(dtype)  # 6 channels: padded for 4 bits, the reference's
    assert not quantize_blocks_supported(odd, 4)
    fallback, reference = quantize_keys(odd, 4), quantize_keys_reference(odd, 4)
    assert all(torch.equal(fallback[name], reference[name]) for name in reference)
    empty = quantize_blocks(blocks[:, :0], bits)
    assert empty["codes"].shape == (BATCH, 0, HEADS, TOKENS, DIM * bits // 8)


def test_seal_block_writes_only_what_it_is_given():
    keys, values = _block(torch.bfloat16, seed=1, ties=False)
    stores = _stores(2, 0, torch.bfloat16)
    args = torch.tensor([0, 1, 2, 3], device=DEVICE)
    seal_block(keys, values, args, stores, 2)  # no pool, no table: the summaries only
    assert torch.equal(stores["codes"][:, 0], quantize_keys(keys.unsqueeze(1), 2)["codes"][:, 0])


def test_seal_block_supported_refuses_what_it_cannot_seal():
    keys, _ = _block(torch.bfloat16, seed=2, ties=False)
    stores = _stores(2, 2, torch.bfloat16)
    assert seal_block_supported(keys, stores, 2, 2)
    assert not seal_block_supported(keys, {k: v for k, v in stores.items() if k != "vmin"}, 2, 2)  # a buffer missing
    assert not seal_block_supported(keys, stores, 4, 2)  # codes of another width
    assert not seal_block_supported(keys, stores, 3, 0)  # 3 bits
    assert not seal_block_supported(keys.double(), stores, 2, 0)  # float64
    assert not seal_block_supported(keys[..., :48], stores, 2, 0)  # head_dim not a power of two
    assert not seal_block_supported(keys[:, :, :12], stores, 2, 0)  # block_tokens not a power of two
    half = {**stores, "kmin": stores["kmin"].half()}
    assert not seal_block_supported(keys, half, 2, 0)  # minima not of the cache dtype


@pytest.mark.parametrize("selector,admission", [("quantkey", "always"), ("quantkey[bits=4,tail_bits=2]", "auto"),
                                                ("solohead", "always")])  # fmt: skip
def test_a_layers_seal_work_leaves_the_state_of_its_op_by_op_seal(selector, admission):
    """``OffloadLayer.seal_work`` (what a seal after a replayed step runs: the kernel for plain quantkey, the torch
    operations for other selectors) and the op-by-op seal leave the same summaries, block tables and stored blocks."""
    from hf_offload import OffloadCache

    from ..helpers import build_model, left_padded

    model = build_model("llama").to(DEVICE)
    ids, mask = left_padded([45, 30], seed=5)
    caches = []
    for _ in range(2):
        cache = OffloadCache(model, budget_tokens=32, block_tokens=8, sink_tokens=8, window_tokens=8, pool_tokens=32,
                             selector=selector, admission=admission, cuda_graphs=False,
                             device_memory_gib=1.0 if admission == "auto" else None,
                             decode_attention="paged" if admission == "auto" else "auto")  # fmt: skip
        with torch.no_grad():
            model(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), past_key_values=cache)
        caches.append(cache)
    for fused, plain in zip(caches[0].offload_layers, caches[1].offload_layers):
        assert fused.execution.use_kernels and fused.blocks.seal_is_one_launch() == selector.startswith("quantkey")
        assert fused.blocks.host.all_admitted == (admission == "auto")
        assert fused.execution.paged or admission == "always"  # "auto": no copy into the slot pool (on CUDA "always" too)
        for layer in (fused, plain):  # the open block (5 tokens, then what the buffer held) sealed as it stands
            block_ids = layer.blocks.host.allocate(layer.blocks.batch)
            if layer is fused:
                layer.blocks.seal_from(block_ids, layer.blocks.seal_work)
            else:
                layer.blocks.seal(layer.blocks.open_k, layer.blocks.open_v, 1, ids=block_ids)
            layer.finish_step()
        assert fused.n_blocks == plain.n_blocks
        _assert_same_sealed_state(fused, plain)
        assert torch.equal(fused.blocks.pool.data, plain.blocks.pool.data)  # the window's copy in the slot pool


def test_a_seal_that_reallocates_the_chunk_tables_is_captured_again(stand_in_graphs):  # noqa: F811 (the fixture)
    """A seal whose new blocks need a new chunk table (one block per chunk here: 60 chunks after the prefill, 66 at
    the second decode seal, past the table's 64 entries) captures its work again instead of replaying a graph that
    reads the old table; the state stays that of op by op. (No estimate of the unselected blocks: under Triton's
    interpreter it would be most of this test's time, and the seal's tables do not depend on it.)"""
    from hf_offload import OffloadCache
    from hf_offload.cache import GRAPH_CAPACITY_BLOCKS

    from ..helpers import build_model, left_padded

    model = build_model("llama").to(DEVICE)
    ids, mask = left_padded([80, 80, 80], seed=6)
    caches = {}
    for graphs in (False, None):
        cache = OffloadCache(model, budget_tokens=48, block_tokens=4, sink_tokens=8, window_tokens=8, pool_tokens=48,
                             host_chunk_mib=1e-6, cuda_graphs=graphs, selector="quantkey[bits=4]",
                             decode_capacity_blocks=GRAPH_CAPACITY_BLOCKS)  # fmt: skip
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), past_key_values=cache,
                                 max_new_tokens=13, min_new_tokens=13, do_sample=False)  # fmt: skip
        caches[graphs] = (out, cache)
    (expected, eager), (got, graphed) = caches[False], caches[None]
    assert torch.equal(got, expected)
    for layer in graphed.offload_layers:
        assert layer.blocks.host.chunk_blocks == 1 and len(layer.blocks.host.chunks) == 3 * 23  # 20 blocks + 3 decode seals each
        assert layer.blocks.host.table_version == 2  # 64 entries, then 128 at the second decode seal
        assert int(layer.stats.seal_graph_captures) == 2 and int(layer.stats.seal_graph_replays) == 1
        _assert_same_sealed_state(layer, eager.layers[layer.layer_idx])


def test_a_summaries_kernel_that_cannot_run_warns_once_and_leaves_the_reference(monkeypatch):
    from hf_offload.kernels import quant

    def broken(keys, bits):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(quant, "_KERNEL", {"ran": set(), "failed": None})
    monkeypatch.setattr(quant, "quantize_blocks", broken)
    monkeypatch.setattr(quant, "quantize_blocks_supported", lambda keys, bits: True)
    keys = torch.randn(2, 3, 2, 16, 64)
    with pytest.warns(RuntimeWarning, match="summaries' kernel could not run .*no compiler"):
        got = quantize_keys(keys, 4)
    want = quantize_keys_reference(keys, 4)
    assert all(torch.equal(got[name], want[name]) for name in want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: no second warning, the reference directly
        again = quantize_keys(keys, 4)
    assert all(torch.equal(again[name], want[name]) for name in want)
