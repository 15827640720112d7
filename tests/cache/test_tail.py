"""The estimate of the unselected blocks' attention (``QuantKeySelector(tail_bits=...)``): the reference against a
direct computation, the log-sum-exp merge, and end to end on tiny models, where an 8-bit estimate brings a small
budget's output close to dense attention."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache

from hf_offload import OffloadCache, OffloadConfig
from hf_offload.kernels import OnlineSoftmax
from hf_offload.kernels.tail import attention_lse, attention_lse_reference, merge_attention, tail_attention_reference
from hf_offload.selectors import get_selector
from hf_offload.selectors.base import Selector
from hf_offload.kernels.quant import dequantize_keys, quantize_keys

from ..helpers import TINY_BLOCKS, build_model, left_padded


def _direct(q, k, v, ok):
    """Masked softmax attention over explicit keys: q [B,H,G,D] (scaled), k/v [B,n,H,T,D], ok [B,n,T]."""
    logits = torch.einsum("bhgd,bnhtd->bhgnt", q, k).masked_fill(~ok[:, None, None], float("-inf")).flatten(-2)
    lse = logits.logsumexp(-1)
    out = torch.einsum("bhgx,bxhd->bhgd", torch.exp(logits - lse[..., None]), v.transpose(2, 3).flatten(1, 2))
    return out, lse


@pytest.mark.parametrize("key_bits,value_bits", [(2, 2), (4, 2), (8, 4), (1, 8)])
@pytest.mark.parametrize("chunk_blocks", [1, 3, 64])
def test_reference_equals_attention_over_the_dequantized_tokens(key_bits, value_bits, chunk_blocks):
    g = torch.Generator().manual_seed(key_bits * 10 + value_bits)
    B, n, H, T, D, G = 2, 7, 2, 4, 8, 3
    keys = torch.randn(B, n, H, T, D, generator=g)
    values = torch.randn(B, n, H, T, D, generator=g)
    q = torch.randn(B, H, G, D, generator=g)
    ok = torch.rand(B, n, T, generator=g) > 0.4
    kq, vq = quantize_keys(keys, key_bits), quantize_keys(values, value_bits)
    out, lse = tail_attention_reference(q, kq, key_bits, vq, value_bits, ok, chunk_blocks=chunk_blocks)
    k_deq = dequantize_keys(kq["codes"], kq["kmin"], kq["kstep"], key_bits)
    v_deq = dequantize_keys(vq["codes"], vq["kmin"], vq["kstep"], value_bits)
    want_out, want_lse = _direct(q, k_deq, v_deq, ok)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_reference_with_nothing_to_attend_gives_zero_and_minus_infinity():
    B, n, H, T, D = 1, 3, 2, 4, 8
    kq = quantize_keys(torch.randn(B, n, H, T, D), 2)
    out, lse = tail_attention_reference(torch.randn(B, H, 2, D), kq, 2, kq, 2, torch.zeros(B, n, T, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(lse).all()


def test_merge_of_two_halves_equals_one_softmax_and_ignores_an_empty_half():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 2, 3, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g)

    def attend(lo, hi):
        logits = torch.einsum("bhgd,bhnd->bhgn", q, k[:, :, lo:hi])
        lse = logits.logsumexp(-1)
        return torch.einsum("bhgn,bhnd->bhgd", torch.exp(logits - lse[..., None]), v[:, :, lo:hi]), lse

    out, lse = merge_attention(*attend(0, 7), *attend(7, 20))
    want_out, want_lse = attend(0, 20)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    empty_out, empty_lse = torch.zeros_like(want_out), torch.full_like(want_lse, float("-inf"))
    out, lse = merge_attention(want_out, want_lse, empty_out, empty_lse)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


def _attention_lse_case(device, dtype, n, mask_heads, seed=5):
    g = torch.Generator().manual_seed(seed)
    B, H, G, D = 2, 3, 4, 64
    q, k, v = (torch.randn(B, H, rows, D, generator=g).to(device, dtype) for rows in (G, n, n))
    allowed = torch.rand(B, mask_heads, 1, n, generator=g) > 0.5
    allowed[..., -1] = True  # every row allows a key
    return q, k, v, allowed.to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [48, 37])  # a whole number of 16-element rows, and not
@pytest.mark.parametrize("mask_heads", [1, 3])
def test_fused_attention_lse_matches_the_float32_reference(dtype, n, mask_heads):
    q, k, v, allowed = _attention_lse_case("cpu", dtype, n, mask_heads)
    out, lse = attention_lse(q, k, v, allowed, 0.125)
    want_out, want_lse = attention_lse_reference(q, k, v, allowed, 0.125)
    assert out.dtype == lse.dtype == torch.float32 and out.shape == want_out.shape and lse.shape == want_lse.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the fused output is rounded to the inputs' dtype
    torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)


def test_attention_lse_falls_back_to_the_reference_where_no_fused_kernel_takes_the_shape():
    q, k, v, allowed = _attention_lse_case("cpu", torch.float32, 20, 1)
    q, k, v = q[..., :12], k[..., :12], v[..., :12]  # head_dim 12: not a multiple of 8
    out, lse = attention_lse(q, k, v, allowed, 0.3)
    want_out, want_lse = attention_lse_reference(q, k, v, allowed, 0.3)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


def test_attention_lse_falls_back_to_the_reference_once_the_fused_kernel_fails(monkeypatch):
    import hf_offload.kernels.tail as tail

    def broken(*args):
        raise RuntimeError("no kernel image for this device")

    monkeypatch.setattr(tail, "_fused_attention_lse", broken)
    monkeypatch.setattr(tail, "_FUSED_LSE_FAILED", set())
    q, k, v, allowed = _attention_lse_case("cpu", torch.float32, 20, 1)
    with pytest.warns(RuntimeWarning, match="using the float32 reference"):
        out, lse = attention_lse(q, k, v, allowed, 0.3)
    want_out, want_lse = attention_lse_reference(q, k, v, allowed, 0.3)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: later calls go straight to the reference
        attention_lse(q, k, v, allowed, 0.3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2576, 37])
@pytest.mark.parametrize("mask_heads", [1, 3])
def test_fused_attention_lse_on_cuda_matches_the_float32_reference(dtype, n, mask_heads):
    q, k, v, allowed = _attention_lse_case("cuda", dtype, n, mask_heads)
    out, lse = attention_lse(q, k, v, allowed, 0.125)
    want_out, want_lse = attention_lse_reference(q, k, v, allowed, 0.125)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
    graph = torch.cuda.CUDAGraph()  # no host synchronisation: it can be captured
    with torch.cuda.graph(graph):
        captured = attention_lse(q, k, v, allowed, 0.125)
    graph.replay()
    torch.testing.assert_close(captured[0], out)
    torch.testing.assert_close(captured[1], lse)


def test_online_softmax_add_partial_equals_adding_the_keys():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 3, 1, 8, generator=g)
    k, v = torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    ok = torch.ones(1, 1, 1, 1, 12, dtype=torch.bool)
    a, b = OnlineSoftmax(q, 0.5), OnlineSoftmax(q, 0.5)
    a.add(k, v, ok)
    b.add(k[:, :, :5], v[:, :, :5], ok[..., :5])
    logits = torch.einsum("bhgqd,bhnd->bhgqn", q, k[:, :, 5:]) * 0.5
    lse = logits.logsumexp(-1)
    b.add_partial(torch.einsum("bhgqn,bhnd->bhgqd", torch.exp(logits - lse[..., None]), v[:, :, 5:]), lse)
    torch.testing.assert_close(b.result(), a.result())


def test_tail_bits_is_validated_and_other_selectors_do_not_estimate():
    with pytest.raises(ValueError, match="tail_bits must be 0"):
        get_selector("quantkey[tail_bits=3]")
    assert get_selector("quantkey[tail_bits=2]").estimates_tail
    assert not get_selector("quantkey").estimates_tail
    assert get_selector("quantkey").summarize_values(torch.zeros(1, 1, 1, 4, 8)) == {}
    for name in ("solohead", "meanbound", "oracle"):
        assert not get_selector(name).estimates_tail
    with pytest.raises(NotImplementedError):
        Selector().tail_attention(None, {}, 1.0, None)


# Tiny models: small blocks and budget, a context of 10-20 blocks, so most blocks are outside the selection.
SMALL = dict(TINY_BLOCKS, budget_tokens=32)


def _logits(model, ids, mask, cache, new_tokens=6):
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )
    return torch.stack(out.logits, dim=1), out.sequences


def _forced_logits(model, ids, mask, cache, tokens):
    """Next-token logits of the prompt and of each of ``tokens`` (``[batch, steps]``) fed one at a time (teacher
    forcing, so that every cache sees the same inputs), ``[batch, steps + 1, vocab]``."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = [model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache).logits[:, -1]]
        for step in range(tokens.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out.append(model(input_ids=tokens[:, step : step + 1], attention_mask=mask, position_ids=positions,
                             past_key_values=cache).logits[:, -1])  # fmt: skip
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("pool_tokens", [None, 16])  # the fused decode step; rounds through a pool of 2 blocks
def test_eight_bit_estimate_brings_a_small_budget_close_to_dense(arch, pool_tokens):
    model = build_model(arch)
    ids, mask = left_padded([150, 97], seed=5)  # left padding: padded tokens must stay out of the estimate
    tokens = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(5))
    dense = _forced_logits(model, ids, mask, DynamicCache(config=model.config), tokens)
    kw = dict(SMALL, pool_tokens=pool_tokens)
    sparse = _forced_logits(model, ids, mask, OffloadCache(model, selector="quantkey[bits=8]", **kw), tokens)
    tail_cache = OffloadCache(model, selector="quantkey[bits=8,tail_bits=8]", **kw)
    tail = _forced_logits(model, ids, mask, tail_cache, tokens)
    assert tail_cache.stats()["host_kv_bytes"] > 0 and tail_cache.stats()["decode_steps"] == 6
    err_sparse = (sparse - dense).abs().amax().item()
    err_tail = (tail - dense).abs().amax().item()
    assert err_tail < 0.1 * err_sparse, (err_tail, err_sparse)


@pytest.mark.parametrize("pool_tokens", [None, 16])
def test_bounded_estimate_decodes_between_the_selection_alone_and_the_full_estimate(pool_tokens):
    """``tail_near=2``: the estimate over twice as many unselected blocks as are selected (6 of 15), plus the others'
    mass; left padding in the batch (padded tokens stay out of both parts). Mean logit error against dense (a
    random tiny model attends almost uniformly: the far blocks' values are far from the near estimate's output, so
    the bounded estimate gains less than it does on real models)."""
    model = build_model("llama")
    ids, mask = left_padded([150, 97], seed=5)
    tokens = torch.randint(3, 90, (2, 6), generator=torch.Generator().manual_seed(5))
    dense = _forced_logits(model, ids, mask, DynamicCache(config=model.config), tokens)
    kw = dict(SMALL, pool_tokens=pool_tokens)
    errors = {}
    for spec in ("quantkey[bits=8]", "quantkey[bits=8,tail_bits=8,tail_near=2]", "quantkey[bits=8,tail_bits=8]"):
        cache = OffloadCache(model, selector=spec, **kw)
        errors[spec] = (_forced_logits(model, ids, mask, cache, tokens) - dense).abs().mean().item()
        assert cache.stats()["decode_steps"] == 6
    alone, bounded, full = errors.values()
    assert full < bounded < alone, errors


def test_fused_and_round_paths_give_the_same_estimate():
    model = build_model("llama")
    ids, mask = left_padded([170, 121], seed=6)
    fused, fused_ids = _logits(model, ids, mask, OffloadCache(model, selector="quantkey[tail_bits=2]", **SMALL))
    rounds, rounds_ids = _logits(
        model, ids, mask, OffloadCache(model, selector="quantkey[tail_bits=2]", pool_tokens=16, **SMALL)
    )
    assert torch.equal(fused_ids, rounds_ids)
    torch.testing.assert_close(fused, rounds, atol=2e-4, rtol=1e-4)


def test_budget_covering_the_context_stays_exact_with_the_estimate_on():
    model = build_model("llama")
    ids, mask = left_padded([61, 40], seed=7)
    expected = _logits(model, ids, mask, DynamicCache(config=model.config))[1]
    got = _logits(model, ids, mask, OffloadCache(model, selector="quantkey[tail_bits=2]", budget_tokens=4096,
                                                 block_tokens=8, sink_tokens=8, window_tokens=8, pool_tokens=16))[1]
    assert torch.equal(got, expected)


def test_value_summaries_are_kept_and_counted():
    model = build_model("llama")
    ids, mask = left_padded([90], seed=8)
    plain = OffloadCache(model, selector="quantkey", **SMALL)
    tail = OffloadCache(model, selector="quantkey[tail_bits=4]", **SMALL)
    _logits(model, ids, mask, plain)
    _logits(model, ids, mask, tail)
    layer = tail.offload_layers[0]
    assert {"vcodes", "vmin", "vstep"} <= set(layer.blocks.summaries)
    assert layer.blocks.summaries["vcodes"].shape[1] == layer.n_blocks
    # 4-bit values, 8-token blocks, head_dim 16: codes 8 * 16 / 2 bytes plus min and step per channel (float32).
    per_block_head = 8 * 16 // 2 + 2 * 16 * 4
    extra = tail.stats()["device_summary_bytes"] - plain.stats()["device_summary_bytes"]
    layers, (batch, _, heads, _, _) = len(tail.offload_layers), layer.blocks.summaries["vcodes"].shape
    capacity = layer.blocks.summary_store["vcodes"].shape[1]
    assert extra == layers * batch * capacity * heads * per_block_head
    assert OffloadConfig(selector="quantkey[tail_bits=4]").selector == "quantkey[tail_bits=4]"


def test_stats_report_the_estimated_share_outside_the_selection():
    model = build_model("llama")
    ids, mask = left_padded([150, 120], seed=9)
    tokens = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(9))
    shares = {}
    for pool_tokens in (None, 16):
        cache = OffloadCache(model, selector="quantkey[tail_bits=4]", pool_tokens=pool_tokens, **SMALL)
        _forced_logits(model, ids, mask, cache, tokens)
        stats = cache.stats()
        assert 0 < stats["tail_share"] < 1
        assert all(0 < layer["tail_share"] < 1 for layer in stats["layers"].values())
        shares[pool_tokens] = stats["tail_share"]
    assert abs(shares[None] - shares[16]) < 1e-4  # the fused step and the rounds estimate the same share
    plain = OffloadCache(model, selector="quantkey", **SMALL)
    _forced_logits(model, ids, mask, plain, tokens)
    assert plain.stats()["tail_share"] is None
