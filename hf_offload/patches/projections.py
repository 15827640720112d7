"""Sibling projections of a decoder layer as one matrix product: attention's q, k and v, the MLP's gate and up.

At decode batch sizes a projection is a matrix-vector product bound by reading its weight, and each one launches its
own kernel (and, for thin products, its own split-K reduction); one larger product over the same weights reads them
at a higher rate and launches once.

:func:`install_fused_projections` takes each group of sibling ``torch.nn.Linear`` modules inside the decoder layers
that transformers' forwards call with the same input tensor, first one first (``q_proj``, ``k_proj``, ``v_proj``;
``gate_proj``, ``up_proj``), copies their weights (and biases) into one tensor and makes each module's weight a view
of its rows: the parameters stay the same objects with the same names, shapes, dtypes and values, and no memory is
added (the old tensors are freed); :func:`remove_fused_projections` gives each parameter a tensor of its own again.
The first module's forward then computes the product with all the rows at once while :func:`fused_projections_active`
is on (the cache turns it on around the decoder layer calls it runs, see
:attr:`~hf_offload.config.OffloadConfig.fused_projections`), returns its own columns and keeps the others for its
siblings, which return them when they are called next with that same input tensor; any other call computes its own
product. Outside the cache's layer calls (another cache, no cache) nothing changes. A gated MLP of
transformers' ``LlamaMLP`` form with a SiLU (Llama, Mistral, Qwen2, Qwen3) also gets its own forward there: the gate
and up product, ``silu(gate) * up`` in one launch where Triton runs (:mod:`hf_offload.kernels.act`, two elementwise
kernels fewer), then ``down_proj``.

The products are the same sums in another kernel: the matrix library may split and order the sum over the input
features differently for the wider product, so an output element can differ in its last bits from the separate
product's (as between any two batch sizes). A group is taken only where every module is exactly ``torch.nn.Linear``
(no subclass, no quantized layer), has no hooks and no forward of its own (accelerate's offloading, another
library's patch), and all weights share one device (not ``meta``), dtype and number of input features, with biases
on all or none. Each call checks that the weights are still views of the group's tensor (``model.to(...)`` or a
newly assigned parameter makes them separate again, and the group then computes separate products).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from .layers import decoder_layers
from .norms import same_code

_ACTIVE = contextvars.ContextVar("hf_offload_fused_projections", default=False)

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of sibling projections, in the order transformers' forwards call them (Llama, Mistral, Qwen2, Qwen3,
Gemma 3, Phi-3's MLP has its own fused ``gate_up_proj`` and is left as it is)."""


def projections_on(config, device: torch.device) -> bool:
    """Whether decoder layers on ``device`` compute their sibling projections as one product
    (``config.fused_projections``, an :class:`~hf_offload.config.OffloadConfig`'s: ``None`` means on CUDA)."""
    setting = config.fused_projections
    return bool(device.type == "cuda" if setting is None else setting)


@contextlib.contextmanager
def fused_projections_active(on: bool):
    """Within this context, the groups :func:`install_fused_projections` built compute one product each (``on``) or
    their modules' own products (``not on``); nests, and restores the previous state on exit."""
    token = _ACTIVE.set(bool(on))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class ProjectionGroup:
    """Sibling ``torch.nn.Linear`` modules whose weights are row blocks of one tensor.

    Attributes:
        modules: the modules, in call order.
        weight: ``[sum of out_features, in_features]``, the modules' dtype and device; module ``i``'s weight (the
            same ``Parameter`` object as before, its data replaced) is rows ``offsets[i] : offsets[i + 1]``.
        bias: ``[sum of out_features]`` or ``None``, laid out as ``weight``.
        sizes: each module's ``out_features``.
        calls: products computed for the whole group (for tests and benchmarks).
    """

    def __init__(self, modules: list[torch.nn.Linear]):
        self.modules = modules
        self.sizes = [m.out_features for m in modules]
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in modules])
            self.bias = torch.cat([m.bias for m in modules]) if modules[0].bias is not None else None
        start = 0
        for m, size in zip(modules, self.sizes):
            # The data, not the Parameter: the model keeps its parameter objects (optimizers, tied weights and
            # anything else holding them see the same tensors), and the old storage is freed.
            m.weight.data = self.weight[start : start + size]
            if self.bias is not None:
                m.bias.data = self.bias[start : start + size]
            start += size
        self.calls = 0
        self._input: torch.Tensor | None = None  # the input of the last fused product, while a sibling waits
        self._parts: list[torch.Tensor | None] = []

    def intact(self) -> bool:
        """Whether every module's weight (and bias) is still its view of the group's tensors."""
        start = 0
        item = self.weight.element_size()
        for m, size in zip(self.modules, self.sizes):
            w = m.weight
            if w.data_ptr() != self.weight.data_ptr() + start * self.weight.stride(0) * item or w.shape[0] != size:
                return False
            if self.bias is not None and (m.bias is None or m.bias.data_ptr() != self.bias.data_ptr() + start * item):
                return False
            start += size
        return True

    def separate(self) -> None:
        """Give every module's weight (and bias) that is still a view of the group's tensors a tensor of its own,
        with the same values (the parameter objects stay)."""
        shared = {t.untyped_storage().data_ptr() for t in (self.weight, self.bias) if t is not None}
        with torch.no_grad():
            for m in self.modules:
                for p in (m.weight, m.bias):  # a parameter replaced since (model.to(...), say) is left as it is
                    if p is not None and p.untyped_storage().data_ptr() in shared:
                        p.data = p.data.clone(memory_format=torch.contiguous_format)
        self._input, self._parts = None, []

    def first(self, x: torch.Tensor) -> torch.Tensor:
        """The first module's forward: the whole group's product where the fusion is on (the siblings' columns kept
        for them), else its own."""
        module = self.modules[0]
        grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad or module.weight.requires_grad)
        if not _ACTIVE.get() or grad or not self.intact():
            self._input, self._parts = None, []
            return F.linear(x, module.weight, module.bias)
        out = F.linear(x, self.weight, self.bias)
        parts = list(out.split(self.sizes, dim=-1))
        self._input, self._parts = x, [None, *parts[1:]]
        self.calls += 1
        return parts[0]

    def sibling(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Module ``index``'s forward: its columns of the product the first module computed with this same input,
        else its own product."""
        if x is self._input and self._parts[index] is not None:
            part, self._parts[index] = self._parts[index], None
            if all(p is None for p in self._parts):
                self._input, self._parts = None, []  # nothing held past the group's last call
            return part
        module = self.modules[index]
        return F.linear(x, module.weight, module.bias)


class GatedMLPForward:
    """A gated MLP's own forward from :func:`install_fused_projections`, for MLPs of transformers' ``LlamaMLP``
    form (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, the same code) with a SiLU: where the fusion is on,
    the gate and up product of its :class:`ProjectionGroup`, then ``silu(gate) * up`` in one launch
    (:func:`~hf_offload.kernels.act.silu_mul`, torch's roundings), then ``down_proj``; otherwise the class's
    forward.

    Attributes:
        module: the MLP.
        group: its gate and up :class:`ProjectionGroup`.
        calls: calls that ran the fused path (for tests and benchmarks).
    """

    def __init__(self, module: torch.nn.Module, group: ProjectionGroup):
        self.module, self.group, self.calls = module, group, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.act import silu_mul
        from ..kernels.gather import kernels_available

        group, module = self.group, self.module
        grad = torch.is_grad_enabled() and (x.requires_grad or any(m.weight.requires_grad for m in group.modules))
        # silu_mul checks the product itself (and falls back to torch's operations where it must).
        if _ACTIVE.get() and not grad and group.intact() and kernels_available(x.device):
            self.calls += 1
            group.calls += 1
            return module.down_proj(silu_mul(F.linear(x, group.weight, group.bias)))
        return type(module).forward(module, x)


def _gated_silu_mlp(module: torch.nn.Module) -> bool:
    """Whether ``module``'s class forward has the code of ``LlamaMLP.forward`` and its activation is the SiLU."""
    from transformers import activations
    from transformers.models.llama.modeling_llama import LlamaMLP

    silu = tuple(c for c in (getattr(activations, "SiLUActivation", None), torch.nn.SiLU) if c is not None)
    act = getattr(module, "act_fn", None)
    if not same_code(getattr(type(module), "forward", None), LlamaMLP.forward) or type(act) not in silu:
        return False
    if "forward" in act.__dict__ or "forward" in module.__dict__:  # another library's forward in its place
        return False
    return type(getattr(module, "down_proj", None)) is torch.nn.Linear


class ProjectionForward:
    """A projection module's own forward from :func:`install_fused_projections`.

    Attributes:
        group: its :class:`ProjectionGroup`.
        index: its place in the group (0: the one that computes the product).
    """

    def __init__(self, group: ProjectionGroup, index: int):
        self.group, self.index = group, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.index == 0:
            return self.group.first(x)
        return self.group.sibling(self.index, x)


def _takes(modules: list) -> bool:
    """Whether these modules can form a group (see the module's docstring)."""
    if not all(type(m) is torch.nn.Linear for m in modules):
        return False
    for m in modules:
        if "forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks:
            return False
    w = [m.weight for m in modules]
    if w[0].device.type == "meta" or any(x.device != w[0].device or x.dtype != w[0].dtype for x in w):
        return False
    if len({m.in_features for m in modules}) != 1 or len({m.bias is None for m in modules}) != 1:
        return False
    return all(m.bias is None or m.bias.dtype == w[0].dtype for m in modules)


def install_fused_projections(model: torch.nn.Module) -> int:
    """Build a :class:`ProjectionGroup` for every group of :data:`GROUPS` inside the decoder layers of ``model``
    that can form one (idempotent); returns how many groups have fused forwards. Undone by
    :func:`remove_fused_projections`."""
    groups = 0
    for layer, _ in decoder_layers(model):
        for parent in layer.modules():
            for names in GROUPS:
                modules = [getattr(parent, n, None) for n in names]
                if any(m is None for m in modules):
                    continue
                forwards = [m.__dict__.get("forward") for m in modules]
                if all(isinstance(f, ProjectionForward) for f in forwards):
                    groups += 1
                    continue
                if not _takes(modules):
                    continue
                group = ProjectionGroup(modules)
                for i, m in enumerate(modules):
                    m.forward = ProjectionForward(group, i)
                if names == ("gate_proj", "up_proj") and _gated_silu_mlp(parent):
                    parent.forward = GatedMLPForward(parent, group)
                groups += 1
    return groups


def remove_fused_projections(model: torch.nn.Module) -> None:
    """Give each projection (and gated MLP) of ``model`` that :func:`install_fused_projections` changed its class's
    forward back, and each of their parameters a tensor of its own with the same values (the group's tensor is
    freed)."""
    for group in fused_groups(model):
        group.separate()
    for layer, _ in decoder_layers(model):
        for module in layer.modules():
            if isinstance(module.__dict__.get("forward"), (ProjectionForward, GatedMLPForward)):
                del module.forward


def fused_mlps(model: torch.nn.Module) -> list[GatedMLPForward]:
    """The :class:`GatedMLPForward` of every MLP of ``model`` that has one."""
    return [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), GatedMLPForward)]


def fused_groups(model: torch.nn.Module) -> list[ProjectionGroup]:
    """The :class:`ProjectionGroup` of every group of ``model`` with fused forwards."""
    seen = {}
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, ProjectionForward):
            seen[id(forward.group)] = forward.group
    return list(seen.values())
