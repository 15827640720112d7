"""The rotary embedding kernel (``hf_offload.kernels.rotary``) against transformers' ``apply_rotary_pos_emb``, bit for
bit: every dtype, decode and prefill shapes, broadcast embeddings, strided states, the strides of the results, and
the inputs it refuses. The kernel runs where Triton runs: on CUDA, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, as CI runs this file); the rest runs everywhere."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_offload.kernels.gather import kernels_available
from hf_offload.kernels.rotary import rotary, rotary_reference, rotary_supported

TRITON = kernels_available(torch.device("cpu"))
needs_triton = pytest.mark.skipif(not TRITON, reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _embedding(batch, seq, head_dim, dtype, device="cpu", seed=0, offset=0):
    """``cos`` and ``sin`` as Llama's rotary module makes them, ``[batch, seq, head_dim]`` in ``dtype``, for
    positions that differ per sequence."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq)[None].float() + offset + torch.randint(0, 5000, (batch, 1), generator=g).float()
    inv = 1.0 / (500000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = pos[..., None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def _states(batch, seq, heads, head_dim, dtype, device="cpu", seed=0, scale=3.0):
    """States as the attention forwards make them: ``[batch, seq, heads, head_dim]`` viewed as ``[batch, heads,
    seq, head_dim]`` (transposed, not contiguous)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, seq, heads, head_dim, generator=g) * scale).to(dtype).to(device).transpose(1, 2)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides on every dimension longer than one (a length-one dimension's stride is arbitrary)."""
    return a.shape == b.shape and all(sa == sb for sa, sb, n in zip(a.stride(), b.stride(), a.shape) if n > 1)


def _check(q, k, cos, sin):
    got_q, got_k = rotary(q, k, cos, sin)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    ref_q, ref_k = rotary_reference(q, k, cos, sin)
    assert torch.equal(want_q, ref_q) and torch.equal(want_k, ref_k)  # the reference is transformers' function
    assert got_q.dtype == want_q.dtype and got_k.dtype == want_k.dtype
    assert torch.equal(got_q, want_q), (got_q.float() - want_q.float()).abs().max()
    assert torch.equal(got_k, want_k), (got_k.float() - want_k.float()).abs().max()
    assert _same_layout(got_q, want_q) and _same_layout(got_k, want_k)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "batch, seq, q_heads, kv_heads, head_dim",
    [(12, 1, 32, 8, 128), (2, 7, 4, 2, 8), (3, 5, 7, 3, 64), (2, 4, 2, 1, 6), (1, 3, 14, 2, 256), (2, 1, 9, 9, 32)],
)
def test_bit_for_bit_with_transformers(dtype, batch, seq, q_heads, kv_heads, head_dim):
    q = _states(batch, seq, q_heads, head_dim, dtype, seed=1)
    k = _states(batch, seq, kv_heads, head_dim, dtype, seed=2)
    cos, sin = _embedding(batch, seq, head_dim, dtype, seed=3)
    _check(q, k, cos, sin)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_embeddings_contiguous_states_and_other_strides(dtype):
    q = _states(3, 6, 4, 16, dtype, seed=4)
    k = _states(3, 6, 2, 16, dtype, seed=5)
    cos, sin = _embedding(1, 6, 16, dtype, seed=6)  # one row for every sequence (position_ids of batch 1)
    _check(q, k, cos, sin)
    _check(q.contiguous(), k.contiguous(), cos, sin)  # already [batch, heads, seq, head_dim]
    wide = torch.randn(3, 6, 4, 48).to(dtype)[..., 8:24].transpose(1, 2)  # rows of a wider buffer
    _check(wide, k, *_embedding(3, 6, 16, dtype, seed=7))
    cos3, sin3 = _embedding(3, 6, 16, dtype, seed=8)
    _check(q, k, cos3[:, :, :], sin3.unsqueeze(0)[0])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_tiny_and_special_values_round_as_torch(dtype):
    q = _states(2, 3, 4, 32, dtype, seed=9, scale=1.0)
    k = _states(2, 3, 2, 32, dtype, seed=10, scale=1.0)
    big = torch.finfo(dtype).max / 2
    tiny = torch.finfo(dtype).tiny
    q[0, 0, 0, :4] = torch.tensor([big, -big, tiny, -tiny], dtype=dtype)
    q[1, 1, 2, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=dtype)
    k[0, 1, 1, 16:20] = torch.tensor([big, tiny * 3, 0.0, -0.0], dtype=dtype)
    cos, sin = _embedding(2, 3, 32, dtype, seed=11)
    got_q, got_k = rotary(q, k, cos, sin)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    # NaN patterns may differ (torch keeps the input's payload, the kernel writes the quiet NaN): compare as values.
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


@needs_triton
def test_zero_length_and_single_head_inputs():
    dtype = torch.bfloat16
    q, k = _states(2, 0, 4, 16, dtype), _states(2, 0, 1, 16, dtype)
    cos, sin = _embedding(2, 0, 16, dtype)
    got_q, got_k = rotary(q, k, cos, sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    _check(_states(1, 2, 1, 16, dtype, seed=1), _states(1, 2, 1, 16, dtype, seed=2), *_embedding(1, 2, 16, dtype))


def test_inputs_it_cannot_take_are_refused_with_what_to_change():
    q, k = _states(2, 3, 4, 16, torch.bfloat16), _states(2, 3, 2, 16, torch.bfloat16)
    cos, sin = _embedding(2, 3, 16, torch.bfloat16)
    if not TRITON:
        assert not rotary_supported(q, k, cos, sin)
        with pytest.raises(ValueError, match="needs Triton on q's device"):
            rotary(q, k, cos, sin)
        return
    assert rotary_supported(q, k, cos, sin)
    cases = [
        ((q, k, cos.float(), sin.float()), {}, "one dtype"),
        ((q.to(torch.int32), k, cos, sin), {}, "one dtype"),
        ((q, k, cos, sin), {"unsqueeze_dim": 2}, "unsqueeze_dim=1"),
        ((q[..., :15], k[..., :15], cos[..., :15], sin[..., :15]), {}, "even head_dim"),
        ((q, k[:1], cos, sin), {}, "k of q's batch"),
        ((q, k, cos[:, :2], sin[:, :2]), {}, "cos of shape"),
        ((q[0], k[0], cos, sin), {}, "4 dimensions"),
        ((q.transpose(-1, -2).contiguous().transpose(-1, -2), k, cos, sin), {}, "contiguous"),
    ]
    for args, kwargs, match in cases:
        assert not rotary_supported(*args, **kwargs)
        with pytest.raises(ValueError, match=match):
            rotary(*args, **kwargs)


@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, seq, q_heads, kv_heads, head_dim",
                         [(12, 1, 32, 8, 128), (1, 333, 14, 2, 64), (3, 5, 7, 3, 256)])  # fmt: skip
def test_cuda_bit_for_bit_with_transformers(dtype, batch, seq, q_heads, kv_heads, head_dim):
    q = _states(batch, seq, q_heads, head_dim, dtype, device="cuda", seed=1)
    k = _states(batch, seq, kv_heads, head_dim, dtype, device="cuda", seed=2)
    cos, sin = _embedding(batch, seq, head_dim, dtype, device="cuda", seed=3)
    _check(q, k, cos, sin)


@pytest.mark.cuda
@pytest.mark.triton
def test_cuda_replays_in_a_graph():
    dtype = torch.bfloat16
    q = _states(4, 1, 8, 128, dtype, device="cuda", seed=1)
    k = _states(4, 1, 2, 128, dtype, device="cuda", seed=2)
    cos, sin = _embedding(4, 1, 128, dtype, device="cuda", seed=3)
    rotary(q, k, cos, sin)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_q, out_k = rotary(q, k, cos, sin)
    new_cos, new_sin = _embedding(4, 1, 128, dtype, device="cuda", seed=4)
    cos.copy_(new_cos)
    sin.copy_(new_sin)
    graph.replay()
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(out_q, want_q) and torch.equal(out_k, want_k)
