"""The fused first-prefill attention against an explicit masked softmax, and the cases it leaves to the tiles."""

import pytest
import torch
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

from hf_offload.attention import Handoff, OffloadMask, _first_prefill


def _inputs(batch=3, q_heads=6, kv_heads=2, q_len=37, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, dim, generator=g)
    k = torch.randn(batch, kv_heads, q_len, dim, generator=g)
    v = torch.randn(batch, kv_heads, q_len, dim, generator=g)
    return q, k, v


def _reference(q, k, v, padding, scaling):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scaling
    n = q.shape[-2]
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & padding[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v  # [B, H, Q, D]


def _mask(padding, mask_function=causal_mask_function):
    kwargs = dict(batch_size=padding.shape[0], kv_length=padding.shape[1], kv_offset=0, q_offset=0,
                  mask_function=mask_function, attention_mask=padding.long())  # fmt: skip
    return OffloadMask("sdpa", kwargs)


@pytest.mark.parametrize("pads", [(0, 0, 0), (0, 5, 36)])
def test_matches_masked_softmax_at_real_positions(pads):
    q, k, v = _inputs()
    n = q.shape[-2]
    padding = torch.arange(n)[None, :] >= torch.tensor(pads)[:, None]
    out = _first_prefill(Handoff(None, k, v, 0, 0), q, _mask(padding), scaling=0.3)
    assert out is not None and out.shape == (3, n, 6, 16)
    ref = _reference(q, k, v, padding, 0.3).transpose(1, 2)
    real = padding[:, :, None, None].expand_as(out)
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)
    assert torch.all(out[~real] == 0)


def test_no_mask_is_plain_causal():
    q, k, v = _inputs(batch=2)
    out = _first_prefill(Handoff(None, k, v, 0, 0), q, None, scaling=0.25)
    ref = _reference(q, k, v, torch.ones(2, q.shape[-2], dtype=torch.bool), 0.25).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_other_cases_go_to_the_tiles():
    q, k, v = _inputs()
    n = q.shape[-2]
    full = torch.ones(3, n, dtype=torch.bool)
    right_padded = full.clone()
    right_padded[1, -4:] = False
    assert _first_prefill(Handoff(None, k, v, 0, 0), q, _mask(right_padded), 0.3) is None
    sliding = _mask(full, sliding_window_causal_mask_function(8))
    assert _first_prefill(Handoff(None, k, v, 0, 0), q, sliding, 0.3) is None
    assert _first_prefill(Handoff(None, k, v, 16, 1), q, _mask(full), 0.3) is None  # earlier blocks exist
    assert _first_prefill(Handoff(None, k, v, 0, 0), q[:, :, -1:], _mask(full), 0.3) is None  # decode
