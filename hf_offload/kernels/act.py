"""The gated MLP's activation and product, ``silu(gate) * up``, in one launch from the fused ``[gate | up]`` product.

transformers' gated MLPs (Llama, Mistral, Qwen2, Qwen3, ...) compute ``act_fn(gate_proj(x)) * up_proj(x)``: two
elementwise kernels after the products, each a few microseconds of launch and tail at decode sizes. Here one program reads a piece of a
row of the ``[..., 2 * intermediate]`` output of :mod:`hf_offload.projections`' fused product and writes
``silu(gate) * up`` with torch's roundings: the SiLU in float32 as torch's CUDA kernel computes it (``x / (1 +
exp(-x))``, with the same ``expf`` and an IEEE division), rounded to the dtype, then the product in float32 (exact for
16-bit inputs) rounded once. On CUDA the result is torch's bit for bit; under Triton's CPU interpreter ``exp`` is
NumPy's, which may differ from torch's CPU ``exp`` in the last float32 bit (and so, rarely, the result by one unit in
its last place).
"""

from __future__ import annotations

import torch

from .gather import kernels_available, tl, triton
from .norm import FLOAT_DTYPES, DTYPE_KIND

BLOCK = 1024
"""Elements of a row per program."""


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' ``act_fn(gate) * up`` for the SiLU, from the concatenated product.

    Args:
        gate_up: ``[..., 2 * intermediate]``, ``[gate | up]`` along the last dimension, float16, bfloat16 or float32,
            any device.

    Returns:
        ``[..., intermediate]``, ``gate_up``'s dtype and device.
    """
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


if triton is not None:
    from triton.language.extra import libdevice

    from .norm import load_f32, round_to, store_as

    @triton.jit
    def _silu_mul_kernel(
        gu_ptr,  # [rows, 2 * inter] of KIND, rows stride_row apart, unit stride along the last dimension
        out_ptr,  # [rows, inter] of KIND, contiguous
        inter,
        stride_row,
        KIND: tl.constexpr,  # 0 float32, 1 float16, 2 bfloat16 (pointers to int16)
        PRECISE: tl.constexpr,  # libdevice's expf and an IEEE division (CUDA); else tl.exp and / (interpreter)
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = i < inter
        base = gu_ptr + row * stride_row
        g = load_f32(base, i, live, KIND)
        u = load_f32(base + inter, i, live, KIND)
        if PRECISE:
            a = tl.math.div_rn(g, 1.0 + libdevice.exp(-g))
        else:
            a = g / (1.0 + tl.exp(-g))
        y = round_to(a, KIND) * u  # two values of 16 bits or fewer: exact in float32, so one rounding is torch's
        store_as(out_ptr + row * inter, i, y, live, KIND)


def silu_mul_supported(gate_up: torch.Tensor) -> bool:
    """Whether :func:`silu_mul` runs the kernel: Triton on ``gate_up``'s device, float16, bfloat16 or float32, at
    least one dimension, an even last dimension with unit stride."""
    return (
        kernels_available(gate_up.device)
        and gate_up.dtype in FLOAT_DTYPES
        and gate_up.dim() >= 1
        and gate_up.shape[-1] % 2 == 0
        and gate_up.shape[-1] > 0
        and gate_up.stride(-1) == 1
    )


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`silu_mul_reference` in one launch where :func:`silu_mul_supported`, else the reference.

    Args:
        gate_up: ``[..., 2 * intermediate]``, ``[gate | up]`` along the last dimension, float16, bfloat16 or float32.

    Returns:
        ``[..., intermediate]``, contiguous, ``gate_up``'s dtype and device.
    """
    if not silu_mul_supported(gate_up):
        return silu_mul_reference(gate_up)
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)  # a view wherever the leading dimensions allow one
    out = torch.empty((rows.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        kind = DTYPE_KIND[gate_up.dtype]
        as_int = (lambda t: t.view(torch.int16)) if kind == 2 else (lambda t: t)  # noqa: E731
        grid = (rows.shape[0], triton.cdiv(inter, BLOCK))
        _silu_mul_kernel[grid](as_int(rows), as_int(out), inter, rows.stride(0), KIND=kind,
                               PRECISE=gate_up.is_cuda, BLOCK=BLOCK)  # fmt: skip
    return out.view(*gate_up.shape[:-1], inter)
