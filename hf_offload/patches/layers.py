"""Whole-layer calls: each decoder layer of a model hands its calls to the cache it is given.

:func:`install_layer_calls` gives each decoder layer an instance forward, a :class:`DecoderLayerCall`, that passes
the call to ``cache.run_decoder_layer`` where the cache it receives has one (an
:class:`~hf_offload.cache.OffloadCache`, which may replay the call from a CUDA graph), and otherwise calls the
layer's own forward unchanged. The class is never changed, so other models of the same class are not affected.

The walk over the decoder layers (:func:`decoder_layers`) and the installation of instance forwards on the modules
inside them (:func:`install_module_forwards`, :func:`remove_module_forwards`) are shared by the fused norms,
rotary embedding and projections.
"""

from __future__ import annotations

import torch


def decoder_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """The model's decoder layers with their index: the members of a ``ModuleList`` that have a direct child with an
    integer ``layer_idx`` (the attention module transformers builds per layer)."""
    found = []
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList):
            continue
        for member in module:
            for child in member.children():
                idx = getattr(child, "layer_idx", None)
                if isinstance(idx, int) and not isinstance(idx, bool):
                    found.append((member, idx))
                    break
    return found


class DecoderLayerCall:
    """A decoder layer's forward as installed by :func:`install_layer_calls`: hands each call to the cache it is
    given (``cache.run_decoder_layer``, an :class:`~hf_offload.cache.OffloadCache`), which may replay it from a CUDA
    graph; with any other cache, or none, calls the layer's own forward unchanged.

    Args:
        original: the layer's forward before (a bound method).
        layer_idx: the layer's index (its attention's ``layer_idx``).
    """

    def __init__(self, original, layer_idx: int):
        self.original = original
        self.layer_idx = layer_idx

    def __call__(self, *args, **kwargs):
        cache = kwargs.get("cache")
        if cache is None:
            cache = kwargs.get("past_key_values")
        run = getattr(cache, "run_decoder_layer", None)
        if run is None:
            return self.original(*args, **kwargs)
        return run(self.layer_idx, self.original, args, kwargs)


def install_layer_calls(model: torch.nn.Module) -> int:
    """Route the forward of each decoder layer of ``model`` through a :class:`DecoderLayerCall` (idempotent);
    returns how many layers are routed. Undone by :func:`remove_layer_calls`."""
    routed = 0
    for module, idx in decoder_layers(model):
        if not isinstance(module.__dict__.get("forward"), DecoderLayerCall):
            module.forward = DecoderLayerCall(module.forward, idx)
        routed += 1
    return routed


def remove_layer_calls(model: torch.nn.Module) -> None:
    """Give each decoder layer of ``model`` back the forward it had before :func:`install_layer_calls`."""
    for module, _ in decoder_layers(model):
        call = module.__dict__.get("forward")
        if isinstance(call, DecoderLayerCall):
            original = call.original
            if getattr(original, "__self__", None) is module and original.__func__ is type(module).forward:
                del module.forward  # it was the class's own forward
            else:
                module.forward = original


def install_module_forwards(model: torch.nn.Module, kind: type, make) -> int:
    """Give every module inside the decoder layers of ``model`` a forward ``make(module)`` of type ``kind``
    (idempotent); ``make`` returns ``None`` for modules it does not take, and a module that already has an instance
    forward of another kind (accelerate's hooks, another fusion) is left alone. Returns how many modules have a
    ``kind`` forward. Undone by :func:`remove_module_forwards`."""
    installed = 0
    for layer, _ in decoder_layers(model):
        for module in layer.modules():
            if isinstance(module.__dict__.get("forward"), kind):
                installed += 1
            elif "forward" not in module.__dict__ and (forward := make(module)) is not None:
                module.forward = forward
                installed += 1
    return installed


def remove_module_forwards(model: torch.nn.Module, kind: type) -> None:
    """Give each module of ``model``'s decoder layers whose instance forward is of type ``kind`` its class's forward
    back."""
    for layer, _ in decoder_layers(model):
        for module in layer.modules():
            if isinstance(module.__dict__.get("forward"), kind):
                del module.forward
