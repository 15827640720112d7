"""QuantKeySelector: packing round trip, quantization error, the layouts of the dequantized keys, the reference
scoring's chunks, oracle agreement at 8 bits, planted mass, full budget, errors."""

from __future__ import annotations

import pytest
import torch

from hf_offload.selectors import SELECTORS, get_selector
from hf_offload.selectors.oracle import OracleSelector
from hf_offload.kernels.quant import dequantize_keys, quantize_keys
from hf_offload.selectors.quantkey import QuantKeySelector

from ._selector_checks import check_full_budget_token_identical, check_planted


def test_registered_exported_and_default():
    import hf_offload
    from hf_offload.config import DEFAULT_SELECTOR, OffloadConfig

    assert SELECTORS["quantkey"] is QuantKeySelector
    assert hf_offload.QuantKeySelector is QuantKeySelector and "QuantKeySelector" in hf_offload.__all__
    assert OffloadConfig(budget_tokens=512).selector == DEFAULT_SELECTOR == "quantkey[bits=4,tail_bits=2,tail_near=16]"
    default = get_selector(DEFAULT_SELECTOR)
    assert isinstance(default, QuantKeySelector) and (default.bits, default.tail_bits, default.tail_near) == (4, 2, 16)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_round_trip_within_half_a_step(bits):
    g = torch.Generator().manual_seed(bits)
    keys = torch.randn(2, 5, 3, 8, 16, generator=g) * torch.linspace(0.1, 4, 16)  # channels of different scales
    q = quantize_keys(keys, bits)
    assert q["codes"].dtype == torch.uint8 and q["codes"].shape == (2, 5, 3, 8, 16 * bits // 8)
    assert q["kmin"].shape == q["kstep"].shape == (2, 5, 3, 16)
    back = dequantize_keys(q["codes"], q["kmin"], q["kstep"], bits)
    assert back.shape == keys.shape
    err = (back - keys).abs()
    assert (err <= q["kstep"][:, :, :, None] / 2 + 1e-5).all()
    # The extremes of every (block, head, channel) are exact: codes 0 and 2**bits - 1.
    assert torch.allclose(back.amin(3), keys.amin(3), atol=1e-5)
    assert torch.allclose(back.amax(3), keys.amax(3), atol=1e-4)


def test_packing_layout_is_little_end_first():
    keys = torch.zeros(1, 1, 1, 2, 4)
    keys[0, 0, 0, 1] = torch.tensor([1.0, 0.0, 1.0, 1.0])  # channel-wise: min 0, max 1 (channel 1: constant 0)
    codes = quantize_keys(keys, 2)["codes"]
    # token 1, 2 bits: channels 0, 2, 3 at level 3, channel 1 at 0 (its step is 0) -> 0b11_11_00_11
    assert codes[0, 0, 0, 1].tolist() == [0b11110011]
    assert codes[0, 0, 0, 0].tolist() == [0]


def _dequantized_code_by_code(codes, kmin, kstep, bits):
    """``kmin + code * kstep`` from codes unpacked one byte position and one code at a time (float32)."""
    per = 8 // bits
    unpacked = torch.stack([(codes >> (bits * p)) & ((1 << bits) - 1) for p in range(per)], dim=-1).flatten(-2)
    return kmin.float()[:, :, :, None] + unpacked.float() * kstep.float()[:, :, :, None]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 24, 8])  # code bytes in whole 32-bit words, 16-bit words, or bytes only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_keys_are_the_same_values_in_every_layout(bits, head_dim, dtype):
    g = torch.Generator().manual_seed(bits * head_dim)
    keys = (torch.randn(2, 7, 3, 8, head_dim, generator=g) * 3).to(dtype)
    q = quantize_keys(keys, bits)
    want = _dequantized_code_by_code(q["codes"], q["kmin"], q["kstep"], bits)  # [B, n, H, T, C]
    for layout in ("bnhtc", "bhcnt", "bhntc", "hbcnt"):
        got = dequantize_keys(q["codes"], q["kmin"], q["kstep"], bits, layout)
        assert got.dtype == torch.float32 and got.is_contiguous()
        assert torch.equal(got, want.permute(["bnhtc".index(axis) for axis in layout]))
    # The first blocks of a buffer with capacity, and codes whose bytes are not contiguous.
    view = dequantize_keys(q["codes"][:, 2:5], q["kmin"][:, 2:5], q["kstep"][:, 2:5], bits, "bhcnt")
    assert torch.equal(view, want[:, 2:5].permute(0, 2, 4, 1, 3))
    strided = torch.stack([q["codes"], q["codes"]], dim=-1)[..., 0]
    assert torch.equal(dequantize_keys(strided, q["kmin"], q["kstep"], bits), want)
    with pytest.raises(ValueError, match="permutation of 'bnhtc'"):
        dequantize_keys(q["codes"], q["kmin"], q["kstep"], bits, "bnhc")


def test_reference_scores_do_not_depend_on_the_chunking(monkeypatch):
    from hf_offload.kernels import quantkey

    g = torch.Generator().manual_seed(5)
    q = quantize_keys(torch.randn(2, 19, 2, 8, 32, generator=g), 4)
    query = torch.randn(2, 2, 3, 32, generator=g)
    keys = _dequantized_code_by_code(q["codes"], q["kmin"], q["kstep"], 4)
    want = torch.einsum("bhgd,bnhtd->bhgnt", query, keys).logsumexp(dim=-1)
    args = (query, q["codes"], q["kmin"], q["kstep"], 4)
    for chunk_blocks in (512, 5, 1):
        torch.testing.assert_close(quantkey.block_lse_reference(*args, chunk_blocks), want)
    monkeypatch.setattr(quantkey, "REFERENCE_CHUNK_BYTES", 3 * 2 * 2 * 8 * 32 * 4)  # three blocks' keys
    torch.testing.assert_close(quantkey.block_lse_reference(*args), want)
    empty = quantkey.block_lse_reference(query, q["codes"][:, :0], q["kmin"][:, :0], q["kstep"][:, :0], 4)
    assert empty.shape == (2, 2, 3, 0) and empty.dtype == torch.float32


def test_eight_bits_rank_like_the_oracle():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 40, 2, 8, 16, generator=g)
    keys[0, 7, 1, 3] = 4 * torch.randn(16, generator=g)  # a few sharp blocks
    query = torch.randn(2, 2, 3, 16, generator=g)
    scaling = 16**-0.5
    oracle = OracleSelector().score(query, OracleSelector().summarize(keys), scaling)
    selector = QuantKeySelector(bits=8, chunk_blocks=7)  # several chunks
    approx = selector.score(query, selector.summarize(keys), scaling)
    assert approx.shape == oracle.shape == (2, 1, 40)
    assert torch.allclose(approx, oracle, atol=2e-3)
    assert torch.allclose(approx.sum(-1), torch.full((2, 1), 6.0), atol=1e-4)  # mass of 2 heads x 3 queries


def test_two_bits_keep_most_of_the_oracle_mass():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(4, 64, 2, 16, 32, generator=g)
    query = keys[:, 10, :, 5, :][:, :, None, :] * 2 + 0.3 * torch.randn(4, 2, 2, 32, generator=g)  # near a key
    scaling = 32**-0.5
    oracle = OracleSelector().score(query, OracleSelector().summarize(keys), scaling)[:, 0]
    selector = QuantKeySelector(bits=2)
    top = selector.score(query, selector.summarize(keys), scaling)[:, 0].topk(8, dim=-1).indices
    captured = oracle.gather(-1, top).sum(-1) / oracle.topk(8, dim=-1).values.sum(-1)
    assert (captured > 0.9).all(), captured
    assert (top == 10).any(-1).all()


def test_planted_mass_found():
    check_planted(QuantKeySelector(bits=2))


@pytest.mark.parametrize("bits", [2, 4])
def test_full_budget_token_identical(bits):
    check_full_budget_token_identical(QuantKeySelector(bits=bits))


def test_bad_settings_say_what_to_change():
    with pytest.raises(ValueError, match="bits must be 1, 2, 4 or 8"):
        QuantKeySelector(bits=3)
    with pytest.raises(ValueError, match="chunk_blocks must be a positive integer"):
        QuantKeySelector(chunk_blocks=0)


def test_selector_names_carry_settings():
    from hf_offload import OffloadCache
    from hf_offload.selectors import get_selector
    from hf_offload.selectors.union import UnionSelector

    from ..helpers import build_model

    assert get_selector("quantkey[bits=4]") == QuantKeySelector(bits=4)
    assert get_selector("quantkey[ bits = 1 , chunk_blocks=8 ]") == QuantKeySelector(bits=1, chunk_blocks=8)
    union = get_selector("union[share=0.25,head_score=quest]")
    assert isinstance(union, UnionSelector) and union.share == 0.25 and union.head_score == "quest"
    cache = OffloadCache(build_model("llama"), budget_tokens=64, selector="quantkey[bits=4]")
    assert cache.offload_layers[0].selector == QuantKeySelector(bits=4)
    for bad, message in [
        ("quantkey[bits=4", "settings go in brackets at the end"),
        ("quantkey[bits]", "write each setting as field=value"),
        ("quantkey[depth=2]", "has no setting 'depth'"),
        ("quantkey[bits=two]", "bits takes int values"),
        ("quantkey[bits=3]", "bits must be 1, 2, 4 or 8"),
        ("nokey[bits=2]", "Unknown selector 'nokey'"),
    ]:
        with pytest.raises(ValueError, match=message):
            get_selector(bad)


def test_head_dim_not_a_multiple_of_codes_per_byte_is_padded():
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 9, 2, 8, 6, generator=g)  # head_dim 6, four 2-bit codes per byte
    query = torch.randn(2, 2, 3, 6, generator=g)
    selector = QuantKeySelector(bits=2)
    summaries = selector.summarize(keys)
    assert summaries["codes"].shape == (2, 9, 2, 8, 2) and summaries["kmin"].shape == (2, 9, 2, 8)
    back = dequantize_keys(summaries["codes"], summaries["kmin"], summaries["kstep"], 2)
    assert (back[..., 6:] == 0).all()
    assert ((back[..., :6] - keys).abs() <= summaries["kstep"][:, :, :, None, :6] / 2 + 1e-5).all()
    scores = selector.score(query, summaries, 0.4)
    exact = torch.softmax(torch.einsum("bhgd,bnhtd->bhgnt", query, back[..., :6]).mul(0.4).flatten(-2), -1)
    assert torch.allclose(scores[:, 0], exact.view(2, 2, 3, 9, 8).sum(dim=(1, 2, 4)), atol=1e-5)
