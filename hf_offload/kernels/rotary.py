"""transformers' rotary position embedding of the query and key states in one launch.

transformers applies the rotary embedding (``apply_rotary_pos_emb`` of Llama and the models generated from it) as
about ten small kernels per attention call on CUDA: for each of the query and key states a product with ``cos``, the
halves of ``rotate_half`` (a negation and a concatenation), a product with ``sin`` and a sum: at decode sizes,
launch and tail time more than bytes. Here one launch rotates both:
a program takes one position of one sequence and a group of heads (query heads, then key heads), loads ``cos`` and
``sin`` of that position once and writes every element as

``out[i] = round(round(x[i] * cos[i]) + round(r[i] * sin[i]))``, ``r = rotate_half(x)`` (``-x[i + d/2]`` in the first
half, ``x[i - d/2]`` in the second),

rounding to the states' dtype where transformers' separate kernels round (a product of two values of 16 bits or
fewer is exact in float32, as is the sum of two such products before its rounding; float32 states are multiplied and
added in float32, without contraction into fused multiply-adds). The result is therefore bit for bit that of
:func:`rotary_reference`, transformers' operations in their order; the tests check it on the CPU under Triton's
interpreter and on CUDA. The outputs have the strides transformers' operations give them (worked out once per
input layout on the meta device), so the code after the embedding sees the same tensors.

bfloat16 is read, rounded and written as 16-bit integer patterns (round to nearest, ties to even, as torch), so the
kernel rounds the same in the interpreter, whose own float32 to bfloat16 cast truncates.
"""

from __future__ import annotations

import functools

import torch

from .gather import kernels_available, tl, triton
from .norm import as_bits

if triton is not None:
    from .norm import bf16_bits, load_f32, round_to  # the same loads and roundings as the norm kernel

MAX_HEAD_DIM = 1024
"""Largest ``head_dim`` the kernel takes (one program holds a head's row in registers)."""

HEADS_PER_PROGRAM = 8
"""Heads (query heads first, then key heads) one program rotates for its position."""

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def rotate_half_reference(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``rotate_half``: ``cat(-x2, x1)`` of the two halves of the last dimension.

    Args:
        x: ``[..., head_dim]``, any dtype and device.
    """
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` in torch, operation for operation.

    Args:
        q: query states, ``[batch, q_heads, seq, head_dim]``, any float dtype and device.
        k: key states, ``[batch, kv_heads, seq, head_dim]``, ``q``'s dtype and device.
        cos, sin: ``[batch, seq, head_dim]`` (or broadcastable to it), ``q``'s device.
        unsqueeze_dim: where ``cos`` and ``sin`` get the heads' dimension (1 for the layout above).

    Returns:
        ``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)``, shapes of ``q`` and ``k``.
    """
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half_reference(q) * sin), (k * cos) + (rotate_half_reference(k) * sin)


if triton is not None:

    @triton.jit(do_not_specialize=["seq", "q_heads", "heads", "sq_b", "sq_h", "sq_t", "sk_b", "sk_h", "sk_t",
                                   "oq_b", "oq_h", "oq_t", "ok_b", "ok_h", "ok_t", "sc_b", "sc_t", "ss_b", "ss_t"])
    def _rotary_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, oq_ptr, ok_ptr,  # states, embeddings, outputs (int16 for bfloat16)
        seq, q_heads, heads,  # positions per sequence; query heads; query + key heads
        sq_b, sq_h, sq_t, sk_b, sk_h, sk_t,  # element strides of q and k (batch, head, position; last is 1)
        oq_b, oq_h, oq_t, ok_b, ok_h, ok_t,  # and of the outputs
        sc_b, sc_t, ss_b, ss_t,  # of cos and sin (batch, position; 0 where broadcast)
        KIND: tl.constexpr,
        HALF: tl.constexpr,  # head_dim // 2
        BLOCK_HALF: tl.constexpr,  # HALF rounded up to a power of two
        HEADS: tl.constexpr,  # heads per program
    ):
        pos = tl.program_id(0).to(tl.int64)
        b, t = pos // seq, pos % seq
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]  # [HEADS, 1]
        i = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]: channel i of the first half, HALF + i of the second
        live = (h < heads) & (i < HALF)
        is_q = h < q_heads
        hq = tl.where(is_q, h, 0).to(tl.int64)
        hk = tl.where(is_q, 0, h - q_heads).to(tl.int64)
        src = tl.where(is_q, q_ptr + b * sq_b + hq * sq_h + t * sq_t, k_ptr + b * sk_b + hk * sk_h + t * sk_t)
        dst = tl.where(is_q, oq_ptr + b * oq_b + hq * oq_h + t * oq_t, ok_ptr + b * ok_b + hk * ok_h + t * ok_t)
        c_row, s_row = cos_ptr + b * sc_b + t * sc_t, sin_ptr + b * ss_b + t * ss_t
        ci = tl.arange(0, BLOCK_HALF)
        c_live = ci < HALF
        c1 = load_f32(c_row, ci, c_live, KIND)[None, :]
        c2 = load_f32(c_row + HALF, ci, c_live, KIND)[None, :]
        s1 = load_f32(s_row, ci, c_live, KIND)[None, :]
        s2 = load_f32(s_row + HALF, ci, c_live, KIND)[None, :]
        x1 = load_f32(src, i, live, KIND)
        x2 = load_f32(src + HALF, i, live, KIND)
        # rotate_half: -x2 in the first half, x1 in the second; each product and the sum rounded as torch rounds.
        y1 = round_to(round_to(x1 * c1, KIND) + round_to(-x2 * s1, KIND), KIND)
        y2 = round_to(round_to(x2 * c2, KIND) + round_to(x1 * s2, KIND), KIND)
        if KIND == 2:
            tl.store(dst + i, (bf16_bits(y1) >> 16).to(tl.int16), mask=live)
            tl.store(dst + HALF + i, (bf16_bits(y2) >> 16).to(tl.int16), mask=live)
        elif KIND == 1:
            tl.store(dst + i, y1.to(tl.float16), mask=live)
            tl.store(dst + HALF + i, y2.to(tl.float16), mask=live)
        else:
            tl.store(dst + i, y1, mask=live)
            tl.store(dst + HALF + i, y2, mask=live)


def _unsupported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim) -> str | None:
    """Why :func:`rotary` cannot run the kernel for these inputs, or ``None`` where it can."""
    if not kernels_available(q.device):
        return (f"rotary needs Triton on q's device, got {q.device} (CUDA with Triton installed, or the CPU under "
                "TRITON_INTERPRET=1); use rotary_reference there")  # fmt: skip
    if unsqueeze_dim != 1:
        return f"rotary takes states laid out [batch, heads, seq, head_dim] (unsqueeze_dim=1), got {unsqueeze_dim}"
    if q.dtype not in FLOAT_DTYPES or any(t.dtype != q.dtype for t in (k, cos, sin)):
        return (f"rotary needs q, k, cos and sin of one dtype among float16, bfloat16 and float32, got "
                f"{q.dtype}, {k.dtype}, {cos.dtype}, {sin.dtype}; use rotary_reference")  # fmt: skip
    if any(t.device != q.device for t in (k, cos, sin)):
        return "rotary needs q, k, cos and sin on one device"
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3:
        return (f"rotary needs q and k of 4 dimensions and cos and sin of 3, got {q.dim()}, {k.dim()}, {cos.dim()}, "
                f"{sin.dim()}")  # fmt: skip
    batch, _, seq, head_dim = q.shape
    if k.shape[0] != batch or k.shape[2:] != q.shape[2:]:
        return f"rotary needs k of q's batch, positions and head_dim, got q {tuple(q.shape)} and k {tuple(k.shape)}"
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape[0] not in (1, batch) or t.shape[1:] != (seq, head_dim):
            return f"rotary needs {name} of shape [{batch} or 1, {seq}, {head_dim}], got {tuple(t.shape)}"
    if head_dim % 2 or not 0 < head_dim <= MAX_HEAD_DIM:
        return f"rotary needs an even head_dim of at most MAX_HEAD_DIM = {MAX_HEAD_DIM}, got {head_dim}"
    if any(t.stride(-1) != 1 for t in (q, k, cos, sin)):
        return "rotary needs the last dimension of q, k, cos and sin contiguous (stride 1)"
    return None


def rotary_supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim=1) -> bool:
    """Whether :func:`rotary` runs the kernel for these inputs: Triton on their device, one dtype among float16,
    bfloat16 and float32, ``q`` ``[batch, q_heads, seq, head_dim]`` and ``k`` ``[batch, kv_heads, seq, head_dim]``,
    ``cos`` and ``sin`` ``[batch or 1, seq, head_dim]``, ``unsqueeze_dim`` 1, an even ``head_dim`` up to
    :data:`MAX_HEAD_DIM`, every last dimension contiguous (any other strides)."""
    return _unsupported(q, k, cos, sin, unsqueeze_dim) is None


@functools.lru_cache(maxsize=256)
def _out_strides(shape: tuple, stride: tuple, emb_shape: tuple, emb_stride: tuple, dtype: torch.dtype) -> tuple:
    """The strides transformers' operations give ``x * cos + rotate_half(x) * sin`` for states of this layout
    (worked out on the meta device: no data, no device work)."""
    x = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    e = torch.empty_strided(emb_shape, emb_stride, dtype=dtype, device="meta").unsqueeze(1)
    return ((x * e) + (rotate_half_reference(x) * e)).stride()


def _emb_strides(t: torch.Tensor) -> tuple[int, int]:
    """Element strides of ``cos`` / ``sin`` along batch (0 where it is broadcast) and position."""
    return (t.stride(0) if t.shape[0] > 1 else 0), t.stride(1)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_reference` in one launch, bit for bit.

    Allocates only its two results and never waits for the device, so it can be captured in a CUDA graph once it has
    run outside one (one compiled kernel per dtype and ``head_dim``). No autograd.

    Args:
        q: query states, ``[batch, q_heads, seq, head_dim]``, float16, bfloat16 or float32, last dimension
            contiguous, any other strides, CUDA (or the CPU under Triton's interpreter).
        k: key states, ``[batch, kv_heads, seq, head_dim]``, ``q``'s dtype, device and layout rules.
        cos, sin: ``[batch or 1, seq, head_dim]``, ``q``'s dtype and device, last dimension contiguous.
        unsqueeze_dim: must be 1 (the layout above).

    Returns:
        ``(q_embed, k_embed)``: the shapes, dtype and strides transformers' ``apply_rotary_pos_emb`` gives.

    Raises:
        ValueError: not :func:`rotary_supported`; the message says what to change.
    """
    reason = _unsupported(q, k, cos, sin, unsqueeze_dim)
    if reason is not None:
        raise ValueError(reason)
    batch, q_heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    emb = (tuple(cos.shape), tuple(cos.stride()))
    oq = torch.empty_strided(q.shape, _out_strides(tuple(q.shape), tuple(q.stride()), *emb, q.dtype),
                             dtype=q.dtype, device=q.device)  # fmt: skip
    ok = torch.empty_strided(k.shape, _out_strides(tuple(k.shape), tuple(k.stride()), *emb, k.dtype),
                             dtype=k.dtype, device=k.device)  # fmt: skip
    if oq.numel() == 0 and ok.numel() == 0:
        return oq, ok
    heads = q_heads + kv_heads
    half = head_dim // 2
    grid = (batch * seq, triton.cdiv(heads, HEADS_PER_PROGRAM))
    _rotary_kernel[grid](
        as_bits(q), as_bits(k), as_bits(cos), as_bits(sin), as_bits(oq), as_bits(ok),
        seq, q_heads, heads,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        oq.stride(0), oq.stride(1), oq.stride(2), ok.stride(0), ok.stride(1), ok.stride(2),
        *_emb_strides(cos), *_emb_strides(sin),
        KIND=DTYPE_KIND[q.dtype], HALF=half, BLOCK_HALF=triton.next_power_of_2(half), HEADS=HEADS_PER_PROGRAM,
        num_warps=1 if half <= 64 else 2, enable_fp_fusion=False,
    )  # fmt: skip
    return oq, ok
