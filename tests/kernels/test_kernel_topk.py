"""The two-tier top-k kernels give the torch code's indices and values bit for bit: random rows, many exact ties,
``+inf`` and ``-inf`` entries, signed zeros, extreme floats, strided inputs. Each test runs the Triton kernel where
Triton can run (on CUDA, or on the CPU under Triton's interpreter, ``TRITON_INTERPRET=1``) and the CUDA kernel on
CUDA, which also writes the tier's keep mask."""

from __future__ import annotations

import pytest
import torch

from hf_offload.kernels import topk
from hf_offload.kernels.topk import (
    MAX_N,
    cuda_topk_supported,
    ranked_topk,
    ranked_topk_keep,
    ranked_topk_reference,
    ranked_topk_supported,
)

from ..helpers import kernel_backends

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton

INF = float("inf")

backend = kernel_backends(topk)


def _assert_same(scores, k, ranked):
    """Kernel and reference agree exactly (values compared as bits, so -0.0 and 0.0 differ); returns the result."""
    assert ranked_topk_supported(scores, ranked)
    assert cuda_topk_supported(scores, ranked) == (topk.BACKEND == "cuda")
    got_i, got_v, keep = ranked_topk_keep(scores, k, ranked)
    assert keep.dtype == torch.bool and torch.equal(keep, got_v[..., :k] > -INF)
    assert torch.equal(got_i, ranked_topk(scores, k, ranked)[0])
    want_i, want_v = ranked_topk_reference(scores, k, ranked)
    batch, rows, _ = scores.shape
    assert got_i.shape == want_i.shape == got_v.shape == (batch, rows, ranked)
    assert got_i.dtype == torch.int64 and got_v.dtype == torch.float32 and got_i.device == scores.device
    assert torch.equal(got_i, want_i)
    assert torch.equal(got_v.view(torch.int32), want_v.view(torch.int32))
    return got_i.cpu(), got_v.cpu()


def _random(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 4.0).to(DEVICE)


@pytest.mark.parametrize(
    "shape,k,ranked",
    [
        ((1, 1, 1), 1, 1),
        ((3, 2, 5), 2, 4),
        ((2, 1, 5), 5, 5),
        ((4, 2, 37), 7, 7),
        ((4, 2, 37), 3, 20),
        ((2, 1, 37), 1, 37),
        ((5, 1, 128), 16, 48),
        ((2, 2, 128), 128, 128),
        ((12, 1, 4096 + 3), 128, 256),
        ((2, 2, 3000), 100, 100),
        ((1, 1, 8200), 120, 2040),  # the default selector just past 128K
        ((3, 1, 10240), 1, 10240),
        ((1, 1, 20000), 300, 19999),
        ((1, 1, MAX_N), 1000, MAX_N),  # too long to count both thresholds in one int32 reduction
    ],
)
def test_random_rows_match_the_reference(shape, k, ranked):
    _assert_same(_random(shape, seed=shape[-1] + k), k, ranked)


@pytest.mark.parametrize("n,k,ranked", [(37, 5, 12), (300, 40, 100), (1000, 250, 251), (64, 1, 64), (8200, 120, 2040),
                                         (5000, 1500, 3000)])  # fmt: skip
def test_many_exact_ties(n, k, ranked):
    g = torch.Generator().manual_seed(n)
    scores = torch.randint(0, 4, (3, 2, n), generator=g).float().to(DEVICE)
    scores[0, 0] = 1.0  # a row of one value: the lowest indices win
    idx, _ = _assert_same(scores, k, ranked)
    assert torch.equal(idx[0, 0], torch.arange(ranked))


def test_infinite_entries():
    n, k, ranked = 50, 5, 12
    scores = _random((6, 1, n), seed=3)
    scores[0, 0, ::2] = INF  # more +inf than ranked
    scores[1, 0, [3, 17]] = INF  # fewer +inf than k
    scores[2, 0, 7:] = -INF  # 7 entries above -inf: between k and ranked
    scores[3, 0, 3:] = -INF  # fewer entries above -inf than k
    scores[4, 0] = -INF  # nothing but -inf
    scores[5, 0, :40] = -INF
    scores[5, 0, [41, 45, 49]] = INF
    idx, val = _assert_same(scores, k, ranked)
    assert torch.equal(idx[0, 0], torch.cat([torch.arange(0, 10, 2), torch.arange(10, 24, 2)]))
    assert {3, 17} <= set(idx[1, 0, :k].tolist()) and (val[1, 0, k:] < INF).all()
    assert torch.equal(idx[3, 0, :3], torch.arange(3)) and (val[3, 0, 3:] == -INF).all()
    assert torch.equal(idx[4, 0], torch.arange(ranked)) and (val[4, 0] == -INF).all()


def test_signed_zeros_are_equal_and_ties_go_to_lower_indices():
    scores = torch.tensor([[[-0.0, 0.0, -0.0, 0.0, 1.0, -1.0]]], device=DEVICE)
    idx, val = _assert_same(scores, 2, 4)
    assert idx.tolist() == [[[0, 4, 1, 2]]]
    assert torch.equal(val.view(torch.int32), torch.tensor([[[-0.0, 1.0, 0.0, -0.0]]]).view(torch.int32))
    g = torch.Generator().manual_seed(5)
    pool = torch.tensor([-INF, -1.0, -0.0, 0.0, 1.0, INF])
    mixed = pool[torch.randint(0, len(pool), (4, 2, 200), generator=g)].to(DEVICE)
    for k, ranked in [(1, 2), (30, 90), (100, 180), (200, 200)]:
        _assert_same(mixed, k, ranked)


def test_extreme_floats():
    tiny, big = 1.401298464324817e-45, 3.4028234663852886e38  # smallest subnormal, largest finite
    values = torch.tensor([tiny, -tiny, big, -big, 1.1754943508222875e-38, -1.1754943508222875e-38, 0.0, -0.0,
                           INF, -INF, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5])  # fmt: skip
    g = torch.Generator().manual_seed(9)
    scores = values[torch.randint(0, len(values), (3, 1, 257), generator=g)].to(DEVICE)
    scores[0, 0, : len(values)] = values
    for k, ranked in [(1, 1), (8, 16), (60, 200)]:
        _assert_same(scores, k, ranked)


def test_strided_scores():
    base = _random((3, 40, 2), seed=11)
    scores = base.transpose(1, 2)  # [3, 2, 40], stride 2 along n
    assert not scores.is_contiguous()
    _assert_same(scores, 4, 10)
    _assert_same(_random((2, 3, 64), seed=12)[:, 1:2, 5:50], 6, 6)


def test_reference_tiers_are_torch_topk_sets_without_ties():
    scores = _random((4, 2, 500), seed=13).cpu()  # continuous: no ties
    k, ranked = 20, 70
    idx, val = ranked_topk_reference(scores, k, ranked)
    top_k = torch.topk(scores, k, dim=-1).indices.sort(dim=-1).values
    top_r = torch.topk(scores, ranked, dim=-1).indices
    assert torch.equal(idx[..., :k], top_k)
    assert torch.equal(idx.sort(dim=-1).values, top_r.sort(dim=-1).values)
    assert (idx[..., :k].diff(dim=-1) > 0).all() and (idx[..., k:].diff(dim=-1) > 0).all()
    assert torch.equal(val, scores.gather(-1, idx))
    # Every tier-1 score is above every tier-2 score.
    assert (val[..., :k].min(dim=-1).values > val[..., k:].max(dim=-1).values).all()


def test_long_rows_fall_back_to_the_reference():
    scores = _random((1, 1, MAX_N + 1), seed=14)
    assert not ranked_topk_supported(scores, 64) and not cuda_topk_supported(scores, 64)
    got_i, got_v = ranked_topk(scores, 16, 64)
    want_i, want_v = ranked_topk_reference(scores, 16, 64)
    assert got_i.shape == got_v.shape == (1, 1, 64)
    assert torch.equal(got_i, want_i) and torch.equal(got_v, want_v)
    assert not ranked_topk_supported(scores[..., :10].double(), 5)


def test_bad_arguments():
    scores = _random((1, 1, 8), seed=15)
    for k, ranked in [(0, 4), (5, 4), (2, 9)]:
        with pytest.raises(ValueError):
            ranked_topk(scores, k, ranked)
        with pytest.raises(ValueError):
            ranked_topk_reference(scores, k, ranked)
    with pytest.raises(ValueError):
        ranked_topk(scores[0], 1, 1)
