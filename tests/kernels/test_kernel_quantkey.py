"""The quantkey scoring kernel against its pure-torch reference; the selector's scores through either path.

Runs where Triton can run: on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch

from hf_offload.kernels import quantkey_mma
from hf_offload.kernels.quant import quantize_keys
from hf_offload.kernels.quantkey import (
    VARIANTS,
    _default_config,
    _launch_block_lse,
    block_lse,
    block_lse_reference,
    block_lse_supported,
)
from hf_offload.selectors.quantkey import QuantKeySelector

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def _triton_kernel(monkeypatch):
    """These tests are of the Triton kernels (float32 throughout): ``block_lse`` runs ``v2`` here, not the
    tensor-core kernel it prefers on a recent GPU (``tests/test_kernel_quantkey_mma.py``)."""
    monkeypatch.setattr(quantkey_mma, "mma_supported", lambda *args: False)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(2, 13, 2, 7, 16, 64), (1, 5, 3, 4, 8, 128)])  # B, N, H, G, T, D
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_lse_matches_reference(bits, shape, dtype):
    batch, n, heads, group, tokens, head_dim = shape
    g = torch.Generator().manual_seed(bits)
    keys = (torch.randn(batch, n, heads, tokens, head_dim, generator=g) * 2).to(dtype).to(DEVICE)
    query = torch.randn(batch, heads, group, head_dim, generator=g).to(DEVICE) * head_dim**-0.5
    s = quantize_keys(keys, bits)
    assert block_lse_supported(query, s["codes"])
    got = block_lse(query, s["codes"], s["kmin"], s["kstep"], bits)
    expected = block_lse_reference(query, s["codes"], s["kmin"], s["kstep"], bits, chunk_blocks=4)
    assert got.shape == (batch, heads, group, n) and got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()


def _inputs(shape, bits, dtype=torch.bfloat16, seed=0):
    batch, n, heads, group, tokens, head_dim = shape
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(batch, n, heads, tokens, head_dim, generator=g) * 2).to(dtype).to(DEVICE)
    query = torch.randn(batch, heads, group, head_dim, generator=g).to(DEVICE) * head_dim**-0.5
    return query, quantize_keys(keys, bits)


@pytest.mark.parametrize(
    "variant, num_warps, rows",
    [("v2", None, None), ("v2", 1, None), ("v2", 8, None), ("v2", 2, 4), ("v2", 4, 2)],
)
def test_launch_settings_match_the_reference(variant, num_warps, rows):
    # 70 blocks: not a multiple of any block_n; 32 tokens: more than one thread's rows per block.
    query, s = _inputs((1, 70, 2, 4, 32, 64), 2)
    expected = block_lse_reference(query, s["codes"], s["kmin"], s["kstep"], 2)
    out = torch.full_like(expected, float("nan"))
    got = _launch_block_lse(query, s["codes"], s["kmin"], s["kstep"], 2, out, variant=variant, num_warps=num_warps,
                            rows_per_thread=rows)  # fmt: skip
    assert got is out
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    with pytest.raises(ValueError, match="variant"):
        _launch_block_lse(query, s["codes"], s["kmin"], s["kstep"], 2, out, variant="v0")
    assert set(VARIANTS) == {"v2", "mma"}  # the CUDA one: tests/test_kernel_quantkey_mma.py


@pytest.mark.parametrize(
    "bits, shape", [(4, (2, 9, 1, 8, 16, 128)), (2, (1, 6, 2, 4, 16, 8)), (1, (1, 6, 2, 3, 4, 16))]
)
def test_block_lse_matches_reference_for_other_groups_and_narrow_rows(bits, shape):
    # 8 query heads (8 rows per thread); 2 and 2 code bytes per row (the kernel reads bytes, not 32-bit words).
    query, s = _inputs(shape, bits, torch.float16)
    got = block_lse(query, s["codes"], s["kmin"], s["kstep"], bits)
    expected = block_lse_reference(query, s["codes"], s["kmin"], s["kstep"], bits)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()


def test_codes_not_aligned_to_words_are_read_by_bytes():
    query, s = _inputs((1, 11, 2, 4, 16, 64), 2)
    buffer = torch.empty(s["codes"].numel() + 1, dtype=torch.uint8, device=DEVICE)
    codes = buffer[1:].view(s["codes"].shape)  # one byte past an aligned allocation
    codes.copy_(s["codes"])
    assert codes.data_ptr() % 4 and codes.is_contiguous()
    got = block_lse(query, codes, s["kmin"], s["kstep"], 2)
    expected = block_lse_reference(query, s["codes"], s["kmin"], s["kstep"], 2)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()


def test_default_config_fills_the_warps():
    for tokens, head_dim, bits, group in [(16, 128, 2, 4), (16, 128, 4, 4), (16, 64, 1, 7), (32, 128, 8, 8)]:
        config = _default_config(tokens, head_dim, bits, group)
        row_threads = max(1, head_dim * bits // 8 // min(16, head_dim * bits // 8, 8 * bits))
        threads = config["block_n"] * row_threads * tokens // config["rows_per_thread"]
        assert threads == 32 * config["num_warps"]
        assert config["rows_per_thread"] * (1 << (group - 1).bit_length()) <= 64
    assert _default_config(16, 128, 2, 4) == {"block_n": 64, "num_warps": 4, "rows_per_thread": 16}


@pytest.mark.cuda  # CUDA graphs
def test_block_lse_replays_in_a_cuda_graph():
    query, s = _inputs((2, 100, 2, 4, 16, 128), 2)
    block_lse(query, s["codes"], s["kmin"], s["kstep"], 2)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = block_lse(query, s["codes"], s["kmin"], s["kstep"], 2)
    query.mul_(2)
    graph.replay()
    expected = block_lse(query, s["codes"], s["kmin"], s["kstep"], 2)
    assert torch.equal(got, expected)


def test_no_blocks_and_unsupported_head_dims_fall_back():
    query = torch.randn(1, 2, 3, 48, device=DEVICE)
    s = quantize_keys(torch.randn(1, 3, 2, 16, 48, device=DEVICE), 2)
    assert not block_lse_supported(query, s["codes"])  # 48 is not a power of two: the reference runs
    assert torch.allclose(block_lse(query, s["codes"], s["kmin"], s["kstep"], 2),
                          block_lse_reference(query, s["codes"], s["kmin"], s["kstep"], 2))  # fmt: skip
    q64 = torch.randn(1, 2, 3, 64, device=DEVICE)
    empty = quantize_keys(torch.randn(1, 0, 2, 16, 64, device=DEVICE), 2)
    assert block_lse(q64, empty["codes"], empty["kmin"], empty["kstep"], 2).shape == (1, 2, 3, 0)
    full = quantize_keys(torch.randn(1, 3, 2, 16, 64, device=DEVICE, dtype=torch.float64), 2)  # float64 steps
    assert torch.allclose(block_lse(q64, full["codes"], full["kmin"], full["kstep"], 2),
                          block_lse_reference(q64, full["codes"], full["kmin"], full["kstep"], 2))  # fmt: skip


def test_selector_scores_through_the_kernel_match_the_reference_path():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 40, 2, 16, 64, generator=g).to(DEVICE)
    query = torch.randn(2, 2, 4, 64, generator=g).to(DEVICE)
    selector = QuantKeySelector(bits=2)
    summaries = selector.summarize(keys)
    scores = selector.score(query, summaries, 0.125)
    lse = block_lse_reference(query.float() * 0.125, summaries["codes"], summaries["kmin"], summaries["kstep"], 2)
    expected = torch.softmax(lse, dim=-1).sum(dim=(1, 2))[:, None, :]
    assert torch.allclose(scores, expected, atol=1e-5)


@pytest.mark.parametrize("variant", ["v2"])  # the CUDA kernel's: tests/test_kernel_quantkey_mma.py
def test_reads_the_first_blocks_of_a_buffer_with_capacity(variant):
    """Summaries are views of the first blocks of buffers allocated with spare capacity (OffloadLayer): the kernel
    reads them in place and scores only those blocks."""
    from hf_offload.kernels.quantkey import summaries_layout_ok

    query, s = _inputs((3, 40, 2, 4, 16, 64), 2, seed=5)
    n = 29
    views = {name: t[:, :n] for name, t in s.items()}
    assert summaries_layout_ok(views["codes"], views["kmin"], views["kstep"])
    assert not views["codes"].is_contiguous()
    expected = block_lse_reference(query, *(views[k].contiguous() for k in ("codes", "kmin", "kstep")), 2)
    out = torch.full_like(expected, float("nan"))
    got = _launch_block_lse(query, views["codes"], views["kmin"], views["kstep"], 2, out, variant=variant)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    assert torch.allclose(block_lse(query, views["codes"], views["kmin"], views["kstep"], 2), expected, atol=1e-4,
                          rtol=1e-4)  # fmt: skip
    # Different capacities (or a layout the kernel cannot stride over) are refused by the check: block_lse copies.
    assert not summaries_layout_ok(views["codes"], s["kmin"][:, :n].contiguous(), views["kstep"])
    assert not summaries_layout_ok(views["codes"].transpose(2, 3), views["kmin"], views["kstep"])


def test_kstep_of_another_dtype_than_kmin_takes_the_reference():
    """The kernel reads kstep with kmin's element type: mixed dtypes go to the reference (same result)."""
    query, s = _inputs((2, 9, 2, 4, 16, 64), 2, seed=6)
    kstep = s["kstep"].float()
    expected = block_lse_reference(query, s["codes"], s["kmin"], kstep, 2)
    got = block_lse(query, s["codes"], s["kmin"], kstep, 2)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
