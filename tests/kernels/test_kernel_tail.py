"""The tail-estimate kernel against its pure-torch reference, and the selector's estimate through either path.

Runs where Triton can run: on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch

import hf_offload.kernels.tail as tail_module
from hf_offload.kernels.tail import (
    dot_kernel_fits,
    tail_attention,
    tail_attention_reference,
    tail_kernel_supported,
)
from hf_offload.kernels.quant import quantize_keys
from hf_offload.selectors.quantkey import QuantKeySelector

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton


def _inputs(batch, n, heads, group, tokens, dim, key_bits, value_bits, dtype, capacity=None, seed=0):
    """Quantized keys and values as the cache holds them (views of the first ``n`` blocks of buffers of
    ``capacity`` blocks), a scaled query and a token mask with some empty blocks."""
    g = torch.Generator().manual_seed(seed)
    capacity = capacity or n
    keys = (torch.randn(batch, capacity, heads, tokens, dim, generator=g) * 2).to(dtype)
    values = torch.randn(batch, capacity, heads, tokens, dim, generator=g).to(dtype)
    kq = {k: v.to(DEVICE)[:, :n] for k, v in quantize_keys(keys, key_bits).items()}
    vq = {k: v.to(DEVICE)[:, :n] for k, v in quantize_keys(values, value_bits).items()}
    query = (torch.randn(batch, heads, group, dim, generator=g) * dim**-0.5).to(DEVICE)
    ok = torch.rand(batch, n, tokens, generator=g) > 0.3
    ok[:, : min(n, 3)] = False  # whole blocks left out (the selected ones)
    return query, kq, vq, ok.to(DEVICE)


@pytest.mark.parametrize("variant", ["dot", "loop"])
@pytest.mark.parametrize("key_bits,value_bits", [(2, 2), (4, 2), (2, 4), (8, 1)])
@pytest.mark.parametrize("shape", [(2, 37, 2, 7, 16, 64), (1, 5, 3, 4, 8, 128), (3, 16, 1, 1, 16, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_reference(variant, key_bits, value_bits, shape, dtype):
    batch, n, heads, group, tokens, dim = shape
    query, kq, vq, ok = _inputs(batch, n, heads, group, tokens, dim, key_bits, value_bits, dtype, capacity=n + 9)
    assert tail_kernel_supported(query, kq, vq)
    if variant == "dot" and not dot_kernel_fits(tokens, dim, key_bits, value_bits):
        with pytest.raises(ValueError, match="variant='loop'"):
            tail_attention(query, kq, key_bits, vq, value_bits, ok, variant="dot")
        return
    want_out, want_lse = tail_attention_reference(query, kq, key_bits, vq, value_bits, ok, chunk_blocks=5)
    for per in (1, 5, 16):
        out, lse = tail_attention(query, kq, key_bits, vq, value_bits, ok, blocks_per_program=per, variant=variant,
                                  precision="ieee")  # fmt: skip
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("key_bits,value_bits", [(2, 2), (4, 2)])
def test_dot_kernel_with_tensor_core_products_is_close(key_bits, value_bits):
    """The ``dot`` kernel at its defaults, TF32 products (exact float32 under the interpreter): the error stays far
    below the codes' own (a 4-bit step is 1/15 of a channel's range in the block). It is the default where the
    tensor-core CUDA kernel cannot run (``tests/test_kernel_tail_mma.py``)."""
    query, kq, vq, ok = _inputs(4, 64, 2, 4, 16, 128, key_bits, value_bits, torch.bfloat16)
    assert dot_kernel_fits(16, 128, key_bits, value_bits)
    out, lse = tail_attention(query, kq, key_bits, vq, value_bits, ok, variant="dot")
    want_out, want_lse = tail_attention_reference(query, kq, key_bits, vq, value_bits, ok)
    torch.testing.assert_close(lse, want_lse, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, want_out, atol=1e-2, rtol=1e-2)


def test_kernel_settings_are_checked():
    query, kq, vq, ok = _inputs(1, 4, 1, 2, 16, 64, 2, 2, torch.float32)
    with pytest.raises(ValueError, match="unknown variant"):
        tail_attention(query, kq, 2, vq, 2, ok, variant="fast")
    with pytest.raises(ValueError, match="precision"):
        tail_attention(query, kq, 2, vq, 2, ok, precision="fp16")


@pytest.mark.parametrize("variant", ["dot", "loop"])
def test_kernel_reads_blocks_through_an_index(variant):
    """With ``index`` the kernel reads block ``index[b, j]`` of the full summaries for entry ``j``: the same as the
    reference over copies of those blocks (repeats and out-of-order entries included), and the same as the
    reference path of ``tail_attention`` itself (which gathers)."""
    batch, n, heads, group, tokens, dim = 2, 29, 2, 4, 16, 64
    query, kq, vq, _ = _inputs(batch, n, heads, group, tokens, dim, 4, 2, torch.bfloat16, capacity=n + 7)
    g = torch.Generator().manual_seed(3)
    index = torch.stack([torch.randperm(n, generator=g)[:11], torch.randint(0, n, (11,), generator=g)]).to(DEVICE)
    ok = (torch.rand(batch, 11, tokens, generator=g) > 0.25).to(DEVICE)
    ok[0, 4] = False  # an entry with nothing to estimate
    rows = torch.arange(batch, device=DEVICE)[:, None]
    want_out, want_lse = tail_attention_reference(
        query, {k: v[rows, index] for k, v in kq.items()}, 4, {k: v[rows, index] for k, v in vq.items()}, 2, ok)
    for per in (1, 16):
        out, lse = tail_attention(query, kq, 4, vq, 2, ok, blocks_per_program=per, variant=variant,
                                  precision="ieee", index=index)  # fmt: skip
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    out, lse = tail_attention(query, kq, 4, vq, 2, ok, softcap=1e9, index=index)  # the reference path
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="index must be int64"):
        tail_attention(query, kq, 4, vq, 2, ok, index=index[:, :5])


def test_kernel_with_nothing_to_attend_and_with_no_blocks():
    query, kq, vq, ok = _inputs(2, 20, 2, 3, 16, 32, 2, 2, torch.float32)
    ok[1] = False  # one sequence attends nothing
    out, lse = tail_attention(query, kq, 2, vq, 2, ok)
    assert torch.isneginf(lse[1]).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    want_out, want_lse = tail_attention_reference(query, kq, 2, vq, 2, ok)
    torch.testing.assert_close(out, want_out, atol=1e-4, rtol=1e-4)
    empty = {k: v[:, :0] for k, v in kq.items()}
    out, lse = tail_attention(query, empty, 2, {k: v[:, :0] for k, v in vq.items()}, 2, ok[:, :0])
    assert torch.isneginf(lse).all() and not out.any()


def test_selector_estimate_is_the_same_through_kernel_and_reference(monkeypatch):
    selector = QuantKeySelector(bits=2, tail_bits=2)
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 30, 2, 16, 64, generator=g).to(DEVICE)
    values = torch.randn(2, 30, 2, 16, 64, generator=g).to(DEVICE)
    summaries = {**selector.summarize(keys), **selector.summarize_values(values)}
    query = torch.randn(2, 2, 7, 64, generator=g).to(DEVICE)
    ok = (torch.rand(2, 30, 16, generator=g) > 0.5).to(DEVICE)
    got = selector.tail_attention(query, summaries, 0.125, ok)
    monkeypatch.setattr(tail_module, "tail_kernel_supported", lambda *a: False)
    want = selector.tail_attention(query, summaries, 0.125, ok)
    # On CUDA the default ``dot`` kernel forms its products in TF32 (7.9e-4 off the float32 reference on an H200);
    # on the CPU the interpreter computes them in exact float32.
    tol = 2e-3 if DEVICE.type == "cuda" else 1e-4
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
