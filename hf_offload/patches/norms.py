"""RMS norms of the decoder layers in one kernel launch each, inside the cache's decode steps.

transformers' RMS norm runs about nine small kernels per call (casts, square, mean, add, reciprocal square root and
two products), whose cost at decode sizes is launch and tail time more than bytes.
:func:`install_fused_norms` gives each RMS norm module of the decoder layers a forward that, while
:func:`fused_norms_active` is on (the cache turns it on around the decoder layer calls it runs, see
:attr:`~hf_offload.config.OffloadConfig.fused_norms`), computes the norm with
:func:`~hf_offload.kernels.norm.rms_norm`, and otherwise calls the module's own forward. Outside the cache's layer
calls (another cache, no cache, the final norm of the model) nothing changes.

A module is taken only when its class's ``forward`` has exactly the code of transformers' ``LlamaRMSNorm.forward``
(Llama, Mistral, Qwen2, Qwen3, Phi-3 and the other classes generated from it) or of ``Gemma3RMSNorm`` (``1 +
weight``, the product in float32): the same bytecode, names and constants, so a subclass or a norm of another
definition keeps its own forward. The kernel rounds as those forwards do; only the float32 sum of squares is
added in another order, which can move an output element by one unit in the last place.
"""

from __future__ import annotations

import contextlib
import contextvars
import types

import torch

from ..kernels.norm import rms_norm, rms_norm_supported
from .layers import install_module_forwards, remove_module_forwards

_ACTIVE = contextvars.ContextVar("hf_offload_fused_norms", default=False)


@contextlib.contextmanager
def fused_norms_active(on: bool):
    """Within this context, the norms installed by :func:`install_fused_norms` run the kernel (``on``) or their own
    forward (``not on``); nests, and restores the previous state on exit."""
    token = _ACTIVE.set(bool(on))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def same_code(a, b) -> bool:
    """``a`` and ``b`` are plain functions with the same bytecode, names, constants and local names."""
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if ca is None or cb is None:
        return False
    return all(getattr(ca, f) == getattr(cb, f) for f in ("co_code", "co_names", "co_consts", "co_varnames"))


def _forms() -> list[tuple[type, bool]]:
    """transformers' reference norm classes and whether each adds one to the weight (``unit_offset``)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return [(LlamaRMSNorm, False), (Gemma3RMSNorm, True)]


def norm_form(module: torch.nn.Module) -> tuple[bool, float] | None:
    """``(unit_offset, eps)`` of an RMS norm module whose forward the kernel computes exactly as its class does (see
    the module docstring), or ``None``."""
    cls = type(module)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    for reference, unit_offset in _forms():
        if not same_code(cls.forward, reference.forward):
            continue
        if unit_offset and not same_code(getattr(cls, "_norm", None), reference._norm):
            continue
        eps = getattr(module, "eps" if unit_offset else "variance_epsilon", None)
        if isinstance(eps, (int, float)) and not isinstance(eps, bool):
            return unit_offset, float(eps)
    return None


class FusedNorm:
    """The forward :func:`install_fused_norms` gives an RMS norm module: the kernel while :func:`fused_norms_active`
    is on, autograd would not record the call and :func:`~hf_offload.kernels.norm.rms_norm_supported` holds for the
    input, else the module's own forward.

    Args:
        module: the norm module.
        original: its forward before (a bound method).
        unit_offset: the norm multiplies by ``1 + weight`` (Gemma 3's form).
        eps: the module's epsilon.
    """

    def __init__(self, module: torch.nn.Module, original, unit_offset: bool, eps: float):
        self.module, self.original, self.unit_offset, self.eps = module, original, unit_offset, eps
        self.calls = 0  # calls that ran the kernel (for tests and benchmarks)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.module.weight
        # The kernel has no backward: where autograd would record the norm, the module's own forward runs.
        grad = torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad)
        if _ACTIVE.get() and not grad and rms_norm_supported(hidden_states, weight):
            self.calls += 1
            return rms_norm(hidden_states, weight, self.eps, unit_offset=self.unit_offset)
        return self.original(hidden_states)


def install_fused_norms(model: torch.nn.Module) -> int:
    """Give every RMS norm module inside the decoder layers of ``model`` whose form :func:`norm_form` knows a
    :class:`FusedNorm` forward (idempotent); returns how many modules have one. Undone by
    :func:`remove_fused_norms`."""

    def make(module):
        form = norm_form(module)
        return None if form is None else FusedNorm(module, module.forward, *form)

    return install_module_forwards(model, FusedNorm, make)


def remove_fused_norms(model: torch.nn.Module) -> None:
    """Give each norm module of ``model`` that :func:`install_fused_norms` changed its class's forward back."""
    remove_module_forwards(model, FusedNorm)
