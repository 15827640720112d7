"""The quantkey scoring kernel against its pure-torch reference; the selector's scores through either path.

Runs where Triton can run: on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch

from hf_offload.kernels.gather import kernels_available
from hf_offload.kernels.quantkey import block_lse, block_lse_reference, block_lse_supported
from hf_offload.selectors.quantkey import QuantKeySelector, quantize_keys

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernels_available(DEVICE), reason="needs Triton on CUDA (or TRITON_INTERPRET=1)")


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


def test_no_blocks_and_unsupported_head_dims_fall_back():
    query = torch.randn(1, 2, 3, 48, device=DEVICE)
    s = quantize_keys(torch.randn(1, 3, 2, 16, 48, device=DEVICE), 2)
    assert not block_lse_supported(query, s["codes"])  # 48 is not a power of two: the reference runs
    assert torch.allclose(block_lse(query, s["codes"], s["kmin"], s["kstep"], 2),
                          block_lse_reference(query, s["codes"], s["kmin"], s["kstep"], 2))  # fmt: skip
    q64 = torch.randn(1, 2, 3, 64, device=DEVICE)
    empty = quantize_keys(torch.randn(1, 0, 2, 16, 64, device=DEVICE), 2)
    assert block_lse(q64, empty["codes"], empty["kmin"], empty["kstep"], 2).shape == (1, 2, 3, 0)


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
