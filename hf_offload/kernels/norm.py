"""transformers' RMS norm of a decode step's hidden states in one launch.

transformers' ``LlamaRMSNorm`` (also Mistral's, Qwen2's, Qwen3's and the other norms generated from it) and
``Gemma3RMSNorm`` run about nine small kernels per call on CUDA (the cast to float32, the square, the mean, the
add of ``eps``, the reciprocal square root, the product, the cast back, the product with the weight), each a few
microseconds of launch and tail for a ``[batch, 1, hidden]`` input of a few kilobytes. Here one program normalises
one row: it loads the row in float32, sums the squares in float32, takes the inverse root of the mean plus ``eps``
and writes the row with the roundings of transformers' code.

The result is defined by :func:`rms_norm_reference`, transformers' operations in their order. The kernel computes
every elementwise step as the reference does and rounds where it rounds (see :data:`DIFFERENCE`), so it differs only
where the float32 sum of squares, added in another order, gives another mean. The tests check both on the CPU under
Triton's interpreter and on CUDA: against the reference, and bit for bit against the reference's elementwise part
(:func:`rms_norm_scale_reference`) given the kernel's own per-row inverse root.

bfloat16 is read, rounded and written as 16-bit integer patterns (round to nearest, ties to even, as torch), so
the kernel rounds the same in the interpreter, whose own float32 to bfloat16 cast truncates.
"""

from __future__ import annotations

import torch

from .gather import kernels_available, tl, triton

MAX_HIDDEN = 16384
"""Longest row (``x.shape[-1]``) the kernel takes: a row is held in registers by one program."""

DIFFERENCE = (
    "The kernel's only difference from rms_norm_reference is the order in which the float32 squares of a row are summed"
    " (a tree in one program, against torch's reduction), so the mean, and hence the row's inverse root, can differ in "
    "its last float32 bits (and, under the CPU interpreter only, its 1 / sqrt against torch's vectorised CPU rsqrt; on "
    "CUDA both are the same rsqrt). Given the same inverse root, every element is bit-identical: the squares, the mean "
    "(on CUDA the sum times float32(1 / hidden) as torch's CUDA mean, on the CPU the sum divided by hidden as torch's "
    "CPU mean), the add of eps, the products and each rounding to 16 bits are the reference's. An output element of a "
    "16-bit dtype therefore rarely differs, by one unit in the last place; in float32 outputs of float32 inputs a "
    "differing inverse root shows in the last bits of its whole row."
)
"""What the kernel's result may differ in from :func:`rms_norm_reference` (also in the module docstring)."""

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # how the kernel reads or writes a dtype


def rms_norm_scale_reference(
    x: torch.Tensor, weight: torch.Tensor, inv_rms: torch.Tensor, unit_offset: bool = False
) -> torch.Tensor:
    """The elementwise part of :func:`rms_norm_reference`: ``x`` in float32 times the given per-row inverse root,
    then the weight, with the reference's roundings.

    Args:
        x: hidden states, ``[..., hidden]``, float16, bfloat16 or float32, any device.
        weight: the norm's weight, ``[hidden]``, a floating dtype, ``x``'s device.
        inv_rms: each row's ``rsqrt(mean(x**2) + eps)``, ``[..., 1]``, float32, ``x``'s device.
        unit_offset: multiply by ``1 + weight`` in float32 and round once (Gemma3), instead of rounding to
            ``x.dtype`` and multiplying by ``weight`` (Llama).

    Returns:
        ``x``'s shape; dtype ``torch.promote_types(weight.dtype, x.dtype)`` (Llama) or ``x.dtype`` (Gemma3), on
        ``x``'s device.
    """
    h = x.to(torch.float32) * inv_rms
    if unit_offset:
        return (h * (1.0 + weight.float())).type_as(x)
    return weight * h.to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """transformers' RMS norm in torch, operation for operation.

    ``unit_offset=False`` is ``LlamaRMSNorm.forward`` (Llama, Mistral, Qwen2, Qwen3, ...): ``h = x.to(float32)``,
    ``h = h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)``, ``weight * h.to(x.dtype)``; the last product runs in
    ``promote_types(weight.dtype, x.dtype)`` (with a bfloat16 weight and input it rounds to bfloat16).
    ``unit_offset=True`` is ``Gemma3RMSNorm.forward``: the same ``h``, then ``(h * (1.0 + weight.float()))`` in
    float32, rounded once to ``x.dtype``.

    Args:
        x: hidden states, ``[..., hidden]``, float16, bfloat16 or float32, any device.
        weight: the norm's weight, ``[hidden]``, a floating dtype, ``x``'s device.
        eps: added to the mean of the squares.
        unit_offset: the Gemma3 form (``1 + weight``, one rounding) instead of the Llama form.

    Returns:
        ``x``'s shape; dtype ``torch.promote_types(weight.dtype, x.dtype)`` (Llama) or ``x.dtype`` (Gemma3), on
        ``x``'s device.
    """
    h = x.to(torch.float32)
    inv_rms = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return rms_norm_scale_reference(x, weight, inv_rms, unit_offset)


if triton is not None:

    @triton.jit
    def load_f32(ptr, offs, mask, KIND: tl.constexpr):
        # A row of KIND (0 float32, 1 float16, 2 bfloat16 as int16 patterns) in float32; exact.
        if KIND == 2:
            bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32) << 16
            return bits.to(tl.float32, bitcast=True)
        else:
            return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def bf16_bits(v):
        # float32 -> int32 whose upper 16 bits are the nearest bfloat16 (ties to even, overflow to inf, NaN to the
        # quiet NaN 0x7FC0), as torch rounds; the lower 16 bits are zero.
        u = v.to(tl.int32, bitcast=True)
        nan = (u & 0x7FFFFFFF) > 0x7F800000
        u = (u + 0x7FFF + ((u >> 16) & 1)) & -65536
        return tl.where(nan, 0x7FC00000, u)

    @triton.jit
    def round_to(v, KIND: tl.constexpr):
        # float32 -> the float32 value of its rounding to KIND.
        if KIND == 2:
            return bf16_bits(v).to(tl.float32, bitcast=True)
        elif KIND == 1:
            return v.to(tl.float16).to(tl.float32)
        else:
            return v

    @triton.jit
    def store_as(ptr, offs, y, mask, KIND: tl.constexpr):
        # float32 y rounded to KIND (0 float32, 1 float16, 2 bfloat16 as int16 patterns, as torch rounds) and stored.
        if KIND == 2:
            tl.store(ptr + offs, (bf16_bits(y) >> 16).to(tl.int16), mask=mask)
        elif KIND == 1:
            tl.store(ptr + offs, y.to(tl.float16), mask=mask)
        else:
            tl.store(ptr + offs, y, mask=mask)

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,  # [rows, hidden] of X_KIND, rows stride_row apart, unit stride along hidden
        w_ptr,  # [hidden] of W_KIND, stride_w apart
        out_ptr,  # [rows, hidden] of O_KIND, contiguous: out
        inv_ptr,  # float32 [rows]: out, each row's inverse root (only with STORE_INV)
        hidden,
        stride_row,
        stride_w,
        eps,
        inv_n,  # float32(1 / hidden), for MEAN_MUL
        X_KIND: tl.constexpr,  # 0 float32, 1 float16, 2 bfloat16 (pointer to int16)
        W_KIND: tl.constexpr,
        O_KIND: tl.constexpr,
        UNIT_OFFSET: tl.constexpr,
        MEAN_MUL: tl.constexpr,  # the mean as sum * inv_n (torch's CUDA mean), else sum / hidden (its CPU mean)
        STORE_INV: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK)
        live = i < hidden
        x = load_f32(x_ptr + row * stride_row, i, live, X_KIND)
        # Launched with fp fusion off: the squares are rounded before the sum, and sum * inv_n before + eps, as in
        # torch's separate kernels.
        total = tl.sum(x * x, axis=0)
        if MEAN_MUL:
            mean = total * inv_n
        else:
            mean = total / hidden
        inv = tl.rsqrt(mean + eps)
        if STORE_INV:
            tl.store(inv_ptr + row, inv)
        h = x * inv
        w = load_f32(w_ptr, i.to(tl.int64) * stride_w, live, W_KIND)
        if UNIT_OFFSET:
            y = h * (1.0 + w)  # then rounded once to x's dtype (O_KIND == X_KIND)
        else:
            # h rounded to x's dtype, times the weight in float32: the product of two values of 16 bits or fewer is
            # exact in float32, so rounding it once to O_KIND is torch's product in the promoted dtype.
            y = round_to(h, X_KIND) * w
        store_as(out_ptr + row * hidden, i, y, live, O_KIND)


def _unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why :func:`rms_norm` cannot run the kernel for ``x`` and ``weight``, or ``None`` where it can."""
    if not kernels_available(x.device):
        return (f"rms_norm needs Triton on x's device, got {x.device} (CUDA with Triton installed, or the CPU under "
                "TRITON_INTERPRET=1); use rms_norm_reference there")  # fmt: skip
    if x.dtype not in FLOAT_DTYPES:
        return f"rms_norm needs x of float16, bfloat16 or float32, got {x.dtype}; cast x or use rms_norm_reference"
    if x.dim() == 0:
        return "rms_norm needs x of shape [..., hidden], got a 0-d tensor"
    hidden = x.shape[-1]
    if not 0 < hidden <= MAX_HIDDEN:
        return f"rms_norm needs 0 < x.shape[-1] <= MAX_HIDDEN = {MAX_HIDDEN}, got {hidden}; use rms_norm_reference"
    if weight.dim() != 1 or weight.shape[0] != hidden:
        return f"rms_norm needs a 1-d weight of length x.shape[-1] = {hidden}, got weight shape {tuple(weight.shape)}"
    if weight.dtype not in FLOAT_DTYPES:
        return f"rms_norm needs a weight of float16, bfloat16 or float32, got {weight.dtype}; cast the weight"
    if weight.device != x.device:
        return f"rms_norm needs weight on x's device {x.device}, got {weight.device}; move the weight there"
    if hidden > 1 and x.stride(-1) != 1:
        return (f"rms_norm needs x's last dimension contiguous (stride 1), got stride {x.stride(-1)}; pass "
                "x.contiguous()")  # fmt: skip
    return None


def rms_norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rms_norm` runs the kernel for ``x`` and ``weight``: Triton on ``x``'s device, ``x`` float16,
    bfloat16 or float32 with at least one dimension, ``0 < x.shape[-1] <= MAX_HIDDEN`` and its last dimension
    contiguous (any strides elsewhere), ``weight`` 1-d of length ``x.shape[-1]``, float16, bfloat16 or float32, on
    ``x``'s device."""
    return _unsupported(x, weight) is None


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 as its int16 patterns (the kernel rounds bfloat16 itself), other dtypes as they are."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool, store_inv: bool):
    reason = _unsupported(x, weight)
    if reason is not None:
        raise ValueError(reason)
    hidden = x.shape[-1]
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rows = out.numel() // hidden
    inv = torch.empty((*x.shape[:-1], 1) if store_inv else (0,), dtype=torch.float32, device=x.device)
    if rows == 0:
        return out, inv
    try:
        x2 = x.view(rows, hidden)  # a view wherever the rows are evenly strided
    except RuntimeError:
        x2 = x.reshape(rows, hidden)  # a copy (one more kernel) otherwise
    block = triton.next_power_of_2(hidden)
    # float32(1 / hidden) from the double 1 / hidden is the float32 quotient for every hidden <= MAX_HIDDEN.
    _rms_norm_kernel[(rows,)](
        as_bits(x2), as_bits(weight), as_bits(out), inv if store_inv else out, hidden, x2.stride(0),
        weight.stride(0),
        float(eps), 1.0 / hidden, X_KIND=DTYPE_KIND[x.dtype], W_KIND=DTYPE_KIND[weight.dtype], O_KIND=DTYPE_KIND[out_dtype],
        UNIT_OFFSET=bool(unit_offset), MEAN_MUL=x.device.type == "cuda", STORE_INV=store_inv, BLOCK=block,
        num_warps=max(1, min(16, block // 512)), enable_fp_fusion=False,
    )  # fmt: skip
    return out, inv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """:func:`rms_norm_reference` in one launch (one program per row), up to :data:`DIFFERENCE`.

    Allocates only its result (plus a copy of ``x`` where its rows cannot be viewed as ``[rows, hidden]`` with one
    row stride) and never waits for the device, so it can be captured in a CUDA graph once it has run outside one
    (one compiled kernel per power of two of ``hidden``, dtypes and form). No autograd.

    Args:
        x: hidden states, ``[..., hidden]``, float16, bfloat16 or float32, last dimension contiguous, any other
            strides, CUDA (or the CPU under Triton's interpreter).
        weight: the norm's weight, ``[hidden]``, float16, bfloat16 or float32, any stride, ``x``'s device.
        eps: added to the mean of the squares (as a float32).
        unit_offset: the Gemma3 form (``1 + weight``, one rounding) instead of the Llama form.

    Returns:
        ``x``'s shape, contiguous; dtype ``torch.promote_types(weight.dtype, x.dtype)`` (Llama) or ``x.dtype``
        (Gemma3), on ``x``'s device.

    Raises:
        ValueError: not :func:`rms_norm_supported`; the message says what to change.
    """
    return _launch(x, weight, eps, unit_offset, store_inv=False)[0]


def rms_norm_with_inv_rms(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rms_norm`, also returning the kernel's inverse root per row (for tests: ``rms_norm_scale_reference(x,
    weight, inv_rms, unit_offset)`` equals the result bit for bit).

    Returns:
        ``(out, inv_rms)``: ``out`` as :func:`rms_norm`'s; ``inv_rms`` ``[..., 1]``, float32, on ``x``'s device.

    Raises:
        ValueError: not :func:`rms_norm_supported`.
    """
    return _launch(x, weight, eps, unit_offset, store_inv=True)
