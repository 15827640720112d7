"""The append kernel writes a decode token's keys and values into the open block as two ``index_copy_`` calls do,
bit for bit, at the position a device tensor holds, for views with the strides the cache's buffers and the
attention's projections have. Runs where Triton can run: on CUDA, or on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch

from hf_offload.kernels.append import append_token, append_token_reference, append_token_supported

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _case(batch, heads, tokens, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # The open block as the pool holds it: slot S of [2, batch, heads, S + 1, tokens, dim].
    pool = torch.randn(2, batch, heads, 3, tokens, dim, generator=g).to(dtype).to(DEVICE)
    # The new token as the projections give it: [batch, 1, heads, dim] viewed as [batch, heads, 1, dim].
    key = torch.randn(batch, 1, heads, dim, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    value = torch.randn(batch, 1, heads, dim, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
    return pool, key, value


@pytest.mark.triton
@pytest.mark.parametrize("batch,heads,tokens,dim,dtype", [(3, 2, 16, 64, torch.bfloat16),
                                                          (1, 8, 16, 128, torch.float16),
                                                          (2, 1, 8, 96, torch.float32)])  # fmt: skip
def test_append_matches_index_copy(batch, heads, tokens, dim, dtype):
    pool, key, value = _case(batch, heads, tokens, dim, dtype, seed=dim)
    want = pool.clone()
    for t in (0, tokens // 2, tokens - 1):
        pos = torch.tensor([t], device=DEVICE)
        assert append_token_supported(pool[0, :, :, 2], key)
        append_token(pool[0, :, :, 2], pool[1, :, :, 2], pos, key, value)
        append_token_reference(want[0, :, :, 2], want[1, :, :, 2], pos, key, value)
        assert torch.equal(pool, want)  # the token's rows, and nothing else
        assert torch.equal(pool[0, :, :, 2, t], key[:, :, 0]) and torch.equal(pool[1, :, :, 2, t], value[:, :, 0])


def test_append_rejects_mismatched_shapes():
    pool, key, value = _case(2, 2, 16, 64, torch.float32, seed=0)
    pos = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match="kv_heads, 1, head_dim"):
        append_token(pool[0, :, :, 2], pool[1, :, :, 2], pos, key[:, :1], value[:, :1])


def test_append_falls_back_without_the_kernel():
    # Channels not contiguous: the torch path, same result.
    pool, key, value = _case(2, 2, 16, 64, torch.float32, seed=1)
    open_k = pool[0, :, :, 2].transpose(-1, -2).contiguous().transpose(-1, -2)
    assert not append_token_supported(open_k, key)
    want = open_k.clone()
    pos = torch.tensor([5], device=DEVICE)
    append_token(open_k, pool[1, :, :, 2], pos, key, value)
    want.index_copy_(2, pos, key)
    assert torch.equal(open_k, want)
