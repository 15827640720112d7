"""The rotary embedding of the attention modules in one kernel launch, inside the cache's layer calls.

transformers' attention forwards (Llama, Mistral, Qwen2, Qwen3, Gemma 3 and the other classes generated from them)
apply the rotary embedding through ``apply_rotary_pos_emb``, a function of their modeling module that runs about
ten small kernels per call on CUDA. The cache cannot reach that call through any argument, and changing the modeling
module would change every model of the class in the process. :func:`install_fused_rotary` instead gives each such
attention module of the decoder layers its own forward: a copy of its class's forward (the same code, through the
decorators transformers wraps it in) whose global ``apply_rotary_pos_emb`` is :class:`FusedRotary`. While
:func:`fused_rotary_active` is on (the cache turns it on around the decoder layer calls it runs, see
:attr:`~hf_offload.config.OffloadConfig.fused_rotary`), that computes the embedding with
:func:`~hf_offload.kernels.rotary.rotary`, bit for bit as transformers does; otherwise it calls the module's own
function. Outside the cache's layer calls (another cache, no cache) nothing changes.

A module is taken only when its class's forward calls a global ``apply_rotary_pos_emb`` that has exactly the code of
Llama's, whose ``rotate_half`` has exactly the code of Llama's (the same bytecode, names and constants: Phi-3's
partial rotary, for one, keeps its own), and when every decorator around the forward keeps the function it wraps in
its closure and as ``__wrapped__`` (``functools.wraps``), so the copy runs the same decorators.
"""

from __future__ import annotations

import contextlib
import contextvars
import types

import torch

from ..kernels.rotary import rotary, rotary_supported
from .layers import install_module_forwards, remove_module_forwards
from .norms import same_code

_ACTIVE = contextvars.ContextVar("hf_offload_fused_rotary", default=False)
_NAME = "apply_rotary_pos_emb"


@contextlib.contextmanager
def fused_rotary_active(on: bool):
    """Within this context, the attention modules given a forward by :func:`install_fused_rotary` run the kernel
    (``on``) or transformers' own function (``not on``); nests, and restores the previous state on exit."""
    token = _ACTIVE.set(bool(on))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _innermost(fn):
    """The function at the end of ``fn``'s ``__wrapped__`` chain."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def plain_function(fn) -> types.FunctionType | None:
    """The Python function behind a modeling module's function ``fn``: ``fn`` itself (through ``__wrapped__``), or,
    where transformers made it a Hub-kernel layer (transformers 5.25 with the ``kernels`` package turns
    ``@use_kernel_forward_from_hub`` functions into an ``nn.Module`` whose forward calls the function unless a Hub
    kernel replaced it), the one function its class's forward closes over; ``None`` for anything else."""
    if isinstance(fn, types.FunctionType):
        return _innermost(fn)
    if not isinstance(fn, torch.nn.Module) or "forward" in vars(fn):  # an instance forward: a Hub kernel took it
        return None
    held = []
    for cell in getattr(getattr(type(fn), "forward", None), "__closure__", None) or ():
        try:
            if isinstance(cell.cell_contents, types.FunctionType):
                held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return _innermost(held[0]) if len(held) == 1 else None


def _reference():
    """Llama's ``apply_rotary_pos_emb`` and ``rotate_half``: the forms the kernel computes."""
    from transformers.models.llama import modeling_llama

    return plain_function(modeling_llama.apply_rotary_pos_emb), modeling_llama.rotate_half


def rotary_function(module: torch.nn.Module):
    """The ``apply_rotary_pos_emb`` the forward of ``module``'s class calls (a function, or the Hub-kernel layer
    :func:`plain_function` sees through), where the kernel computes it exactly (see the module docstring), or
    ``None``."""
    forward = getattr(type(module), "forward", None)
    inner = _innermost(forward) if isinstance(forward, types.FunctionType) else None
    if not isinstance(inner, types.FunctionType) or _NAME not in inner.__code__.co_names:
        return None
    function = inner.__globals__.get(_NAME)
    plain = plain_function(function)
    apply_ref, rotate_ref = _reference()
    if plain is None or apply_ref is None or not same_code(plain, apply_ref):
        return None
    if not same_code(plain.__globals__.get("rotate_half"), rotate_ref):
        return None
    return function


def _copy(fn: types.FunctionType, globals_: dict, closure) -> types.FunctionType:
    """``fn`` with other globals and closure cells, its name, defaults, annotations and attributes kept."""
    new = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    new.__dict__.update(fn.__dict__)
    return new


def _with_global(fn: types.FunctionType, name: str, value) -> types.FunctionType | None:
    """A copy of ``fn`` whose innermost function (through ``__wrapped__``) sees ``value`` as the global ``name``;
    each decorator level is copied with the copy below it in place of the function it held. ``None`` where a level
    does not hold the function it wraps in exactly one closure cell."""
    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is None:
        return _copy(fn, {**fn.__globals__, name: value}, fn.__closure__)
    inner = _with_global(wrapped, name, value) if isinstance(wrapped, types.FunctionType) else None
    if inner is None:
        return None
    cells = fn.__closure__ or ()
    held = []
    for i, cell in enumerate(cells):
        try:
            if cell.cell_contents is wrapped:
                held.append(i)
        except ValueError:  # an empty cell
            continue
    if len(held) != 1:
        return None
    closure = tuple(types.CellType(inner) if i == held[0] else c for i, c in enumerate(cells))
    new = _copy(fn, fn.__globals__, closure)
    new.__wrapped__ = inner
    return new


class FusedRotary:
    """What the forward :func:`install_fused_rotary` gives an attention module calls as ``apply_rotary_pos_emb``:
    the kernel while :func:`fused_rotary_active` is on, autograd would not record the call and
    :func:`~hf_offload.kernels.rotary.rotary_supported` holds for the inputs, else transformers' function.

    Args:
        original: the modeling module's ``apply_rotary_pos_emb``.
    """

    def __init__(self, original):
        self.original = original
        self.calls = 0  # calls that ran the kernel (for tests and benchmarks)

    def __call__(self, q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        extra = len(args) > 1 or set(kwargs) - {"unsqueeze_dim"}
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))
        if _ACTIVE.get() and not extra and not grad and rotary_supported(q, k, cos, sin, unsqueeze_dim):
            self.calls += 1
            return rotary(q, k, cos, sin, unsqueeze_dim)
        return self.original(q, k, cos, sin, *args, **kwargs)


class RotaryForward:
    """An attention module's own forward from :func:`install_fused_rotary`: its class's forward with
    :class:`FusedRotary` as ``apply_rotary_pos_emb``, bound to the module.

    Attributes:
        module: the attention module.
        function: the copied forward (unbound).
        rotary: its :class:`FusedRotary`.
    """

    def __init__(self, module: torch.nn.Module, function: types.FunctionType, rotary: FusedRotary):
        self.module, self.function, self.rotary = module, function, rotary

    def __call__(self, *args, **kwargs):
        if _compiling():
            # torch.compile traces the class's own forward: the copy runs with globals of its own, where the compiled
            # code dynamo installs in the module's globals is not found (and inductor fuses the rotation anyway).
            return type(self.module).forward(self.module, *args, **kwargs)
        return self.function(self.module, *args, **kwargs)


def _compiling() -> bool:
    """Whether torch.compile is tracing the current call."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling())


def install_fused_rotary(model: torch.nn.Module) -> int:
    """Give every attention module inside the decoder layers of ``model`` whose rotary embedding
    :func:`rotary_function` knows a :class:`RotaryForward` (idempotent); returns how many modules have one. Undone
    by :func:`remove_fused_rotary`."""

    def make(module):
        function = rotary_function(module)
        if function is None:
            return None
        fused = FusedRotary(function)
        forward = _with_global(type(module).forward, _NAME, fused)
        return None if forward is None else RotaryForward(module, forward, fused)

    return install_module_forwards(model, RotaryForward, make)


def remove_fused_rotary(model: torch.nn.Module) -> None:
    """Give each attention module of ``model`` that :func:`install_fused_rotary` changed its class's forward back."""
    remove_module_forwards(model, RotaryForward)
