"""The tensor-core estimate of the unselected blocks (``hf_offload.kernels.tail_mma``): its rounding scheme on the
CPU against the float32 reference, the kernel itself on CUDA (compute capability 9.0+) against that scheme and the
reference, through an index and without, and as ``tail_attention``'s default."""

from __future__ import annotations

import pytest
import torch

import hf_offload.kernels.tail as tail_module
from hf_offload.kernels import tail_mma
from hf_offload.kernels.tail import tail_attention, tail_attention_reference
from hf_offload.kernels.tail_mma import mma_supported, tail_emulated
from hf_offload.kernels.quant import quantize_keys

HAS_MMA = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
needs_mma = pytest.mark.skipif(not HAS_MMA, reason="needs a CUDA device of compute capability 9.0 or newer")


def _inputs(batch, n, heads, group, dim, key_bits, value_bits, device="cpu", capacity=None, seed=0):
    """Scaled queries, the quantized keys (channels of different ranges, as RoPE'd keys have) and values of the
    first ``n`` blocks of buffers of ``capacity`` blocks, and a token mask with empty blocks."""
    g = torch.Generator().manual_seed(seed)
    capacity = capacity or n
    scale = torch.linspace(0.2, 4.0, dim)
    keys = (torch.randn(batch, capacity, heads, 16, dim, generator=g) * scale).to(torch.bfloat16)
    values = (torch.randn(batch, capacity, heads, 16, dim, generator=g) + 0.5).to(torch.bfloat16)
    kq = {k: v.to(device)[:, :n] for k, v in quantize_keys(keys, key_bits).items()}
    vq = {k: v.to(device)[:, :n] for k, v in quantize_keys(values, value_bits).items()}
    query = (torch.randn(batch, heads, group, dim, generator=g) * dim**-0.5 * 2).to(device)
    ok = torch.rand(batch, n, 16, generator=g) > 0.3
    ok[:, : min(n, 3)] = False  # whole blocks left out (the selected ones)
    return query, kq, vq, ok.to(device)


SCHEME = (2**-7, 0.02)
"""How far the kernel's roundings may move the estimate from the float32 reference: log-sum-exps by ``2**-7`` of
``1 + |lse|`` (the bfloat16 rounding of ``kstep * q``, ``2**-9`` relative per channel, on logits of up to about 18
here; sums of terms of both signs reached ``2**-8`` on the GPU), outputs by 2% of
their largest magnitude (the probabilities of the value product in bfloat16)."""

KERNEL = (1e-4, 2e-3)
"""How far the kernel may be from its emulated scheme: float32 sums in another order and, now and then, the last
bit of a bfloat16 probability (the kernel rounds it relative to the running maximum)."""


def _assert_near(got, want, tol):
    """``(out, lse)`` against ``want``, within ``tol = (lse share, output share)`` (see :data:`SCHEME`)."""
    out, lse = got
    want_out, want_lse = want
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse)) and torch.equal(lse[~fin], want_lse[~fin])
    assert ((lse - want_lse)[fin].abs() <= tol[0] * (1 + want_lse[fin].abs())).all(), (lse - want_lse)[fin].abs().max()
    scale = want_out.abs().amax().clamp_min(1e-6)
    assert ((out - want_out).abs() <= tol[1] * scale).all(), ((out - want_out).abs().max(), scale)


@pytest.mark.parametrize("key_bits,value_bits", [(4, 2), (2, 2), (4, 4), (2, 4)])
@pytest.mark.parametrize("shape", [(2, 23, 2, 7, 64), (1, 9, 3, 4, 128), (1, 5, 1, 1, 256)])
def test_emulated_scheme_is_close_to_the_reference(key_bits, value_bits, shape):
    """The kernel's roundings (``kstep * q`` and the query's two parts in bfloat16, the value product's
    probabilities in bfloat16) move the estimate by less than :data:`SCHEME`; and they do move it (the scheme is
    not the reference itself)."""
    batch, n, heads, group, dim = shape
    query, kq, vq, ok = _inputs(batch, n, heads, group, dim, key_bits, value_bits)
    want = tail_attention_reference(query, kq, key_bits, vq, value_bits, ok)
    got = tail_emulated(query, kq, key_bits, vq, value_bits, ok)
    _assert_near(got, want, SCHEME)
    assert not torch.equal(got[0], want[0])


def test_emulated_scheme_with_nothing_to_attend():
    query, kq, vq, ok = _inputs(2, 6, 2, 4, 64, 4, 2)
    ok[1] = False
    out, lse = tail_emulated(query, kq, 4, vq, 2, ok)
    want_out, want_lse = tail_attention_reference(query, kq, 4, vq, 2, ok)
    assert torch.isneginf(lse[1]).all() and torch.equal(out[1], torch.zeros_like(out[1]))
    _assert_near((out[:1], lse[:1]), (want_out[:1], want_lse[:1]), SCHEME)


def test_unsupported_inputs_are_declined():
    query, kq, vq, _ = _inputs(1, 4, 1, 4, 64, 4, 2)
    assert not mma_supported(query, kq, 4, vq, 2)  # a CPU tensor
    if HAS_MMA:
        dev = {k: v.cuda() for k, v in kq.items()}
        vdev = {k: v.cuda() for k, v in vq.items()}
        q = query.cuda()
        assert mma_supported(q, dev, 4, vdev, 2)
        assert not mma_supported(q, dev, 8, vdev, 2)  # 8-bit keys
        assert not mma_supported(torch.randn(1, 1, 9, 64, device="cuda"), dev, 4, vdev, 2)  # 9 query heads
        f32 = {k: (v.float() if v.is_floating_point() else v) for k, v in vdev.items()}
        assert not mma_supported(q, dev, 4, f32, 2)  # float32 parameters


@pytest.mark.cuda
@needs_mma
@pytest.mark.parametrize("key_bits,value_bits", [(4, 2), (2, 2), (4, 4), (2, 4)])
@pytest.mark.parametrize("shape", [(2, 37, 2, 7, 64), (3, 45, 8, 4, 128), (1, 5, 1, 1, 256), (2, 33, 2, 8, 128)])
def test_kernel_matches_its_scheme_and_the_reference(key_bits, value_bits, shape):
    """The kernel, its ranges merged, against its scheme (:data:`KERNEL`) and the reference (:data:`SCHEME`)."""
    batch, n, heads, group, dim = shape
    query, kq, vq, ok = _inputs(batch, n, heads, group, dim, key_bits, value_bits, "cuda", capacity=n + 5)
    ok[0, -1] = False  # an entry with nothing to estimate
    assert mma_supported(query, kq, key_bits, vq, value_bits, has_index=False)
    got = tail_attention(query, kq, key_bits, vq, value_bits, ok, variant="mma")
    _assert_near(got, tail_emulated(query, kq, key_bits, vq, value_bits, ok), KERNEL)
    _assert_near(got, tail_attention_reference(query, kq, key_bits, vq, value_bits, ok), SCHEME)
    parts = tail_module.tail_partials(query, kq, key_bits, vq, value_bits, ok, variant="mma")
    assert parts[0].shape[2] == -(-n // tail_mma.BLOCKS_PER_WARP)


@pytest.mark.cuda
@needs_mma
def test_kernel_reads_blocks_through_an_index():
    """Entry ``j`` is block ``index[b, j]`` of the full summaries (repeats and any order), as the reference over
    copies of those blocks; a sequence with nothing to attend gives ``-inf`` and zeros."""
    batch, n, heads, group, dim = 3, 70, 8, 4, 128
    query, kq, vq, _ = _inputs(batch, n, heads, group, dim, 4, 2, "cuda", capacity=n + 9)
    g = torch.Generator().manual_seed(5)
    index = torch.stack([torch.randperm(n, generator=g)[:41], torch.randint(0, n, (41,), generator=g),
                         torch.arange(41)]).cuda()  # fmt: skip
    ok = (torch.rand(batch, 41, 16, generator=g) > 0.25).cuda()
    ok[0, 4] = False
    ok[2] = False
    rows = torch.arange(batch, device="cuda")[:, None]
    near_k = {k: v[rows, index] for k, v in kq.items()}
    near_v = {k: v[rows, index] for k, v in vq.items()}
    got = tail_attention(query, kq, 4, vq, 2, ok, index=index, variant="mma")
    want = tail_attention_reference(query, near_k, 4, near_v, 2, ok)
    assert torch.isneginf(got[1][2]).all() and torch.equal(got[0][2], torch.zeros_like(got[0][2]))
    _assert_near((got[0][:2], got[1][:2]), (want[0][:2], want[1][:2]), SCHEME)
    emu = tail_emulated(query, near_k, 4, near_v, 2, ok)
    _assert_near((got[0][:2], got[1][:2]), (emu[0][:2], emu[1][:2]), KERNEL)


@pytest.mark.cuda
@needs_mma
def test_default_is_the_tensor_core_kernel_and_the_merged_path_uses_it(monkeypatch):
    """``tail_attention`` runs the ``mma`` kernel by default (the same result as asking for it), ``dot`` where
    ``mma`` cannot run, and ``tail_attention_merged`` merges the kernel's ranges as the torch merge does."""
    query, kq, vq, ok = _inputs(2, 40, 2, 4, 128, 4, 2, "cuda")
    mma = tail_attention(query, kq, 4, vq, 2, ok, variant="mma")
    default = tail_attention(query, kq, 4, vq, 2, ok)
    assert torch.equal(default[0], mma[0]) and torch.equal(default[1], mma[1])
    with monkeypatch.context() as patch:
        patch.setattr(tail_mma, "mma_supported", lambda *args: False)
        dot = tail_attention(query, kq, 4, vq, 2, ok)
    assert not torch.equal(dot[0], mma[0])
    _assert_near(dot, mma, SCHEME)
    sel_out = torch.randn(2, 2, 4, 128, device="cuda")
    sel_lse = torch.randn(2, 2, 4, device="cuda") + 3
    out, lse = tail_module.tail_attention_merged(query, kq, 4, vq, 2, ok, sel_out, sel_lse)
    want_out, want_lse = tail_module.finish_tail_reference(*mma, sel_out, sel_lse, None, None)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
