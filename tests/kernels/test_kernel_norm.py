"""The RMS norm kernel against transformers' operations (``rms_norm_reference``): bit for bit given its own per-row
inverse root, bit for bit where the sum of squares is exact in any order, and within the rounding of the output
elsewhere; Llama and Gemma3 forms, float16, bfloat16 and float32 inputs and weights, strided rows, special values,
unsupported inputs. Runs where Triton can run: on CUDA, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_offload.kernels.norm import (
    MAX_HIDDEN,
    rms_norm,
    rms_norm_reference,
    rms_norm_scale_reference,
    rms_norm_supported,
    rms_norm_with_inv_rms,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(1, 1, 64), (3, 1, 4096), (12, 1, 4096), (2, 5, 896), (4, 1, 1536), (896,)]
EPS = 1e-6


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns as int64, ordered as the values for one sign (so a difference counts units in
    the last place)."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16).long()


def _inputs(shape, x_dtype, w_dtype, unit_offset, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3.0
    # Gemma3's weight is an offset from 1 (initialised to 0), Llama's a scale around 1.
    w = torch.randn(shape[-1], generator=g) * 0.5 + (0.0 if unit_offset else 1.0)
    return x.to(x_dtype).to(DEVICE), w.to(w_dtype).to(DEVICE)


def _out_dtype(x_dtype, w_dtype, unit_offset):
    return x_dtype if unit_offset else torch.promote_types(w_dtype, x_dtype)


def _assert_elementwise_exact(x, w, eps, unit_offset):
    """The kernel's result has the reference's shape and dtype, and is the reference's elementwise part given the
    kernel's inverse roots, bit for bit; its inverse roots are torch's within 3 float32 units in the last place (the
    sum order, and on the CPU torch's vectorised rsqrt against 1 / sqrt; 2 seen on the CPU and on an H200). Bits are
    compared, so ``-0.0`` and ``0.0`` differ. Returns ``(got, want)``."""
    got, inv = rms_norm_with_inv_rms(x, w, eps, unit_offset)
    want = rms_norm_reference(x, w, eps, unit_offset)
    assert got.shape == want.shape == x.shape
    assert got.dtype == want.dtype == _out_dtype(x.dtype, w.dtype, unit_offset)
    assert got.device == x.device and got.is_contiguous()
    assert torch.equal(_bits(got), _bits(rms_norm_scale_reference(x, w, inv, unit_offset)))
    torch_inv = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    assert inv.shape == torch_inv.shape and inv.dtype == torch.float32
    assert (_bits(inv) - _bits(torch_inv)).abs().max().item() <= 3
    return got, want


def _assert_close_to_reference(got, want, x_dtype):
    """``got`` is within the last rounding of ``want``: with a 16-bit input (rounded to its dtype before the weight,
    or once at the end) at most one unit of that dtype, and under 1% of the elements differ; with a float32 input
    and output a few float32 units, in any number of elements (a row's inverse root that differs in its last bit
    moves most of the row's last bits)."""
    diff = (got.double() - want.double()).abs()
    scale = want.double().abs()
    if x_dtype == torch.float32:
        assert (diff <= scale * 4 * torch.finfo(torch.float32).eps).all()
        return
    assert (diff <= scale * torch.finfo(x_dtype).eps).all()
    if got.dtype != torch.float32:
        assert (_bits(got) - _bits(want)).abs().max().item() <= 1
    assert (diff > 0).double().mean().item() < 0.01


@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma3"])
@pytest.mark.parametrize("w_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random_rows_match_the_reference(shape, x_dtype, w_dtype, unit_offset):
    x, w = _inputs(shape, x_dtype, w_dtype, unit_offset, seed=shape[-1] + len(shape))
    assert rms_norm_supported(x, w)
    got, want = _assert_elementwise_exact(x, w, EPS, unit_offset)
    _assert_close_to_reference(got, want, x_dtype)
    assert torch.equal(rms_norm(x, w, EPS, unit_offset), got)


def _exact_rows(rows, hidden, square_sum, seed):
    """``[rows, hidden]`` float32 rows of values ``j / 8`` (``|j| <= 16``) whose squares sum to exactly
    ``square_sum * hidden / 4`` per row of 4-element groups: every partial sum is a float32 integer multiple of
    1/64 below 2**24 / 64, so the sum of squares (and the mean) is the same in any order."""
    target = round(square_sum * 64)  # per group of 4, in units of 1/64
    groups = [q for q in itertools.product(range(17), repeat=4) if sum(j * j for j in q) == target]
    assert groups
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(len(groups), (rows, hidden // 4), generator=g)
    vals = torch.tensor(groups, dtype=torch.float32)[pick].reshape(rows, hidden) / 8.0
    signs = torch.randint(2, (rows, hidden), generator=g) * 2 - 1
    perm = torch.argsort(torch.rand((rows, hidden), generator=g), dim=-1)
    return (vals * signs).gather(-1, perm)


@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma3"])
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                             (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.float16, torch.bfloat16)], ids=str)  # fmt: skip
@pytest.mark.parametrize(
    "hidden,mean,eps",
    [(64, 1.0, 0.0), (4096, 3.0, 1.0), (896, 0.75, 0.25), (1536, 0.25, 0.0), (2048, 2.0, 2.0)],
)
def test_exact_mean_rows_equal_the_reference(hidden, mean, eps, x_dtype, w_dtype, unit_offset):
    # mean + eps is a power of 4, so the inverse root is a power of 2 whatever rsqrt's implementation; the sum of
    # squares is exact, so its order cannot matter: the whole result must be the reference's bit for bit.
    x = _exact_rows(6, hidden, 4 * mean, seed=hidden).reshape(3, 2, hidden).to(x_dtype).to(DEVICE)
    g = torch.Generator().manual_seed(hidden + 1)
    w = (torch.randn(hidden, generator=g) * 0.7 + (0.0 if unit_offset else 1.0)).to(w_dtype).to(DEVICE)
    got, want = _assert_elementwise_exact(x, w, eps, unit_offset)
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("x_dtype", DTYPES, ids=str)
def test_strided_rows_and_weight(x_dtype):
    hidden = 896
    x_base, w_base = _inputs((5, 4, 2 * hidden), x_dtype, torch.float32, False, seed=7)
    w = torch.stack([w_base[:hidden], w_base[hidden:]], dim=-1).reshape(-1)[::2]  # stride 2
    assert w.stride(0) == 2
    views = [
        x_base[:, :, :hidden],  # evenly strided rows: a view as [rows, hidden]
        x_base[:, ::2, hidden:],  # likewise (the leading dimensions merge)
        x_base[:, :3, hidden:],  # rows that no single stride reaches: copied first
        x_base[:, :, :hidden].transpose(0, 1),  # likewise
        x_base[1, :, :hidden],
    ]
    for x in views:
        assert not x.is_contiguous() and rms_norm_supported(x, w)
        for unit_offset in (False, True):
            got, want = _assert_elementwise_exact(x, w, EPS, unit_offset)
            _assert_close_to_reference(got, want, x_dtype)
            assert torch.equal(got, rms_norm(x.contiguous(), w.contiguous(), EPS, unit_offset))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on inf and NaN
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma3"])
@pytest.mark.parametrize("x_dtype", DTYPES, ids=str)
def test_special_rows(x_dtype, unit_offset):
    hidden = 64
    big = torch.finfo(x_dtype).max
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(3))
    x[0] = 0.0  # rsqrt(eps): large, finite
    x[1, 5] = big  # the square overflows (not for float16): inverse root 0 or tiny
    x[2, 7] = float("inf")  # inverse root 0: inf * 0 is NaN, the rest 0
    x[3, 9] = float("nan")
    x[4] = 1e-3  # small: a large inverse root
    x[5, ::2] = -x[5, 1::2]
    x = x.to(x_dtype).to(DEVICE)
    w = torch.linspace(-2.0, 2.0, hidden).to(torch.bfloat16).to(DEVICE)
    got, inv = rms_norm_with_inv_rms(x, w, EPS, unit_offset)
    want = rms_norm_reference(x, w, EPS, unit_offset)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, rms_norm_scale_reference(x, w, inv, unit_offset), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got[[0, 2, 3]], want[[0, 2, 3]], rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got[2, 7]) and torch.isnan(got[3]).all() and (got[2, :7] == 0).all()
    assert torch.isfinite(got[[0, 1, 4, 5]]).all()


def test_empty_rows():
    x = torch.empty((0, 1, 64), dtype=torch.bfloat16, device=DEVICE)
    w = torch.ones(64, dtype=torch.float32, device=DEVICE)
    got = rms_norm(x, w, EPS)
    assert got.shape == (0, 1, 64) and got.dtype == torch.float32


def test_unsupported_inputs_raise_with_what_to_change():
    x = torch.randn(2, 1, 64, device=DEVICE).to(torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    assert rms_norm_supported(x, w)
    cases = [
        (x, w[:32], r"1-d weight of length x\.shape\[-1\] = 64, got weight shape \(32,\)"),
        (x, w.reshape(8, 8), r"1-d weight of length x\.shape\[-1\] = 64, got weight shape \(8, 8\)"),
        (x.to(torch.int32), w, r"x of float16, bfloat16 or float32, got torch\.int32; cast x"),
        (x.double(), w, r"x of float16, bfloat16 or float32, got torch\.float64"),
        (x, w.to(torch.int64), r"weight of float16, bfloat16 or float32, got torch\.int64"),
        (torch.randn(128, 2, device=DEVICE).t(), torch.ones(128, device=DEVICE), r"pass x\.contiguous\(\)"),
        (torch.zeros(1, MAX_HIDDEN + 1, device=DEVICE), torch.ones(MAX_HIDDEN + 1, device=DEVICE), "MAX_HIDDEN"),
        (torch.zeros((), device=DEVICE), w, "0-d"),
    ]
    for xx, ww, message in cases:
        assert not rms_norm_supported(xx, ww)
        with pytest.raises(ValueError, match=message):
            rms_norm(xx, ww, EPS)
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="weight on x's device"):
            rms_norm(x, w.cpu(), EPS)
