"""A decode token's keys and values into the open block in one launch.

In a decode step of a whole decoder layer replayed from a CUDA graph, the step's new token is written into the
open block at a position that a device tensor holds (the graph is replayed for every position of the block). Two
``index_copy_`` calls, one for the keys and one for the values, are two kernels per layer; here one program per
(sequence, KV head) copies both rows. The result is the two ``index_copy_`` calls' bit for bit (:func:`append_token_reference`),
which the tests check on the CPU under Triton's interpreter and on CUDA.
"""

from __future__ import annotations

import torch

from .gather import kernels_available, tl, triton


def append_token_reference(
    open_k: torch.Tensor, open_v: torch.Tensor, pos: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Write ``key`` and ``value`` into ``open_k`` and ``open_v`` at token ``pos`` (in place, in torch).

    Args:
        open_k, open_v: the open block's keys and values, ``[batch, kv_heads, block_tokens, head_dim]``, any float
            dtype, any device (views with any strides).
        pos: the token position in the block, ``[1]``, ``torch.int64``, same device.
        key, value: the new token's keys and values, ``[batch, kv_heads, 1, head_dim]``, the open block's dtype and
            device (any strides).
    """
    open_k.index_copy_(2, pos, key)
    open_v.index_copy_(2, pos, value)


if triton is not None:

    @triton.jit
    def _append_token_kernel(
        ok_ptr, ov_ptr,  # the open block's keys and values, [B, H, T, D] with strides (sb, sh, st, 1)
        pos_ptr,  # int64 [1]
        k_ptr, v_ptr,  # [B, H, 1, D] with strides (kb, kh, ., 1)
        heads, osb, osh, ost, ovb, ovh, ovt, kb, kh, vb, vh,
        D: tl.constexpr,
        DP: tl.constexpr,
    ):
        bh = tl.program_id(0).to(tl.int64)
        b = bh // heads
        h = bh % heads
        d = tl.arange(0, DP)
        live = d < D
        t = tl.load(pos_ptr)
        tl.store(ok_ptr + b * osb + h * osh + t * ost + d, tl.load(k_ptr + b * kb + h * kh + d, mask=live), mask=live)
        tl.store(ov_ptr + b * ovb + h * ovh + t * ovt + d, tl.load(v_ptr + b * vb + h * vh + d, mask=live), mask=live)


def append_token_supported(open_k: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether :func:`append_token` runs the kernel (Triton on the device; the last dimension contiguous in the open
    block and in the new token's tensors)."""
    return kernels_available(open_k.device) and open_k.stride(-1) == 1 and key.stride(-1) == 1


def append_token(
    open_k: torch.Tensor, open_v: torch.Tensor, pos: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """:func:`append_token_reference` in one launch where the kernel runs (no host synchronisation, so a CUDA graph
    can hold it once it has run outside one); arguments as the reference's."""
    batch, heads, _, head_dim = open_k.shape
    if key.shape != (batch, heads, 1, head_dim) or value.shape != key.shape or open_v.shape != open_k.shape:
        raise ValueError(f"append_token: keys {tuple(key.shape)} and values {tuple(value.shape)} must both be "
                         f"[batch, kv_heads, 1, head_dim] of the open block {tuple(open_k.shape)}")  # fmt: skip
    if not (append_token_supported(open_k, key) and open_v.stride(-1) == 1 and value.stride(-1) == 1):
        append_token_reference(open_k, open_v, pos, key, value)
        return
    _append_token_kernel[(batch * heads,)](
        open_k, open_v, pos, key, value, heads, *open_k.stride()[:3], *open_v.stride()[:3], *key.stride()[:2],
        *value.stride()[:2], D=head_dim, DP=triton.next_power_of_2(head_dim), num_warps=1,
    )  # fmt: skip
