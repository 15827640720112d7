"""Everything hf-offload changes in a user's model, with one install and one remove.

:func:`install` (what building an :class:`~hf_offload.cache.OffloadCache` calls) makes these changes, each on the
model's own instances (no class and no transformers module is changed: other models of the same classes stay as they
are):

- the attention switch (:mod:`~hf_offload.patches.attention`): the model's attention implementation becomes
  ``hf_offload_sdpa`` / ``hf_offload_eager``, which hands every call without the cache's handoff to the original;
- whole-layer calls (:mod:`~hf_offload.patches.layers`): each decoder layer hands its calls to the cache it is given;
- fused RMS norms and rotary embedding (:mod:`~hf_offload.patches.norms`, :mod:`~hf_offload.patches.rotary`):
  forwards that run one kernel inside the cache's layer calls where ``fused_norms`` / ``fused_rotary`` are on, and
  the module's own computation everywhere else;
- fused projections (:mod:`~hf_offload.patches.projections`), only where ``fused_projections`` would run them on the
  device of the decoder layers' weights: q / k / v and gate / up weights re-laid as row views of one tensor each;
- two hooks on the model's forward (:mod:`~hf_offload.patches.forwards`): the cache a forward is given prepares before
  it and rolls back what a failed forward left part-way.

:func:`remove` (also :meth:`ModelPatches.remove` and :func:`disable_offload_attention`) undoes all of it: the model
is then the one that was given, with the same parameter objects (each with a tensor of its own again, the same
values), the same ``state_dict``, its classes' forwards and its configs' attention implementations, so
``save_pretrained`` writes the same files. Nothing is installed at import time.

A model is patched once: installing on a patched model (a second ``OffloadCache`` of it) adds only what the new
config needs (the projections) and returns the same :class:`ModelPatches`; the patches serve every ``OffloadCache``
of the model, and :func:`remove` removes them for all of them.

Per-architecture adapters belong here too, only where the generic path (``cache.update`` followed by the registered
attention function with the same key tensor) cannot work. The architectures tested so far (Llama, Mistral, Qwen2,
Qwen3, Gemma 3, Phi-3) need none.
"""

from __future__ import annotations

import weakref

import torch

from .attention import AttentionSnapshot, original_implementation, restore_attention, switch_attention
from .forwards import install_forward_hooks, remove_forward_hooks
from .layers import decoder_layers, install_layer_calls, remove_layer_calls
from .norms import install_fused_norms, remove_fused_norms
from .projections import fused_groups, install_fused_projections, projections_on, remove_fused_projections
from .rotary import install_fused_rotary, remove_fused_rotary

__all__ = [
    "ModelPatches",
    "disable_offload_attention",
    "enable_offload_attention",
    "install",
    "installed",
    "original_implementation",
    "remove",
]

# model -> its patches; weak, so that a model nobody holds is freed with its record
_INSTALLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ModelPatches:
    """The patches of one model, shared by every :class:`~hf_offload.cache.OffloadCache` of it.

    Attributes:
        attention: the model's attention implementations before the switch.
        layer_calls: decoder layers that hand their calls to the cache.
        norm_modules: RMS norm modules with a fused forward.
        rotary_modules: attention modules with a fused rotary embedding.
        projection_groups: groups of sibling projections re-laid as one tensor.
        forward_hooks: whether the model's forward has the hooks of :mod:`~hf_offload.patches.forwards`.
        parked: the offloaded layers, buffers and graphs of a collected cache waiting for the next cache of the
            model (:mod:`hf_offload.cache.parking`), or ``None``.

    The counts are those of the last :func:`install`.
    """

    def __init__(self, model: torch.nn.Module, attention: AttentionSnapshot):
        self._model = weakref.ref(model)
        self.attention = attention
        self.layer_calls = self.norm_modules = self.rotary_modules = self.projection_groups = 0
        self.forward_hooks = False
        self.parked = None  # the parts of a collected cache waiting for the model's next one (cache.parking)

    @property
    def original_attn_implementation(self) -> str:
        """The attention implementation calls without the cache's handoff go to (``"sdpa"`` or ``"eager"``)."""
        return self.attention.original

    @property
    def active(self) -> bool:
        """Whether these are the model's patches now (not removed since)."""
        model = self._model()
        return model is not None and _INSTALLED.get(model) is self

    def remove(self) -> None:
        """Remove every patch of the model (:func:`remove`); a no-op once removed, also after the model was patched
        anew (those newer patches stay)."""
        if self.active:
            remove(self._model())

    def __deepcopy__(self, memo) -> "ModelPatches":
        return self  # one record per model: a copied cache shares its model's patches

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return (
            f"ModelPatches({state}, attention={self.original_attn_implementation!r}, layer_calls={self.layer_calls}, "
            f"norm_modules={self.norm_modules}, rotary_modules={self.rotary_modules}, "
            f"projection_groups={self.projection_groups})"
        )


def _switched(model: torch.nn.Module) -> ModelPatches:
    """The model's record, its attention switched (made on first use, before anything else changes)."""
    patches = _INSTALLED.get(model)
    snapshot = switch_attention(model)  # raises for an unsupported implementation before anything changes
    if patches is None:
        patches = _INSTALLED[model] = ModelPatches(model, snapshot)
    return patches


def install(model: torch.nn.Module, config) -> ModelPatches:
    """Install every patch on ``model`` (idempotent; see the module docstring).

    Args:
        model: a transformers decoder model.
        config: the :class:`~hf_offload.config.OffloadConfig` of the cache (``fused_projections`` decides whether
            the projections are re-laid).

    Returns:
        The model's :class:`ModelPatches` (the same object for every install until :func:`remove`).

    Raises:
        ValueError: the model's attention implementation is not one the offload attention can hand over to
            (nothing is changed then).
    """
    patches = _switched(model)
    patches.forward_hooks = install_forward_hooks(model)  # the cache prepares before a forward, repairs after one fails
    patches.layer_calls = install_layer_calls(model)  # each decoder layer hands its calls to the cache it is given
    patches.norm_modules = install_fused_norms(model)  # their norms run one kernel inside those calls where asked
    patches.rotary_modules = install_fused_rotary(model)  # and their rotary embedding
    layers = decoder_layers(model)
    weight = next((p for layer, _ in layers for p in layer.parameters()), None)
    if weight is not None and projections_on(config, weight.device):
        install_fused_projections(model)
    patches.projection_groups = len(fused_groups(model))
    return patches


def installed(model: torch.nn.Module) -> ModelPatches | None:
    """The patches of ``model``, or ``None`` where none are installed."""
    return _INSTALLED.get(model)


def remove(model: torch.nn.Module) -> None:
    """Remove every patch from ``model``, whichever cache installed it (idempotent): the model is then exactly the
    one given to the first install (see the module docstring)."""
    patches = _INSTALLED.pop(model, None)
    if patches is not None and patches.parked is not None:
        parked, patches.parked = patches.parked, None
        parked.release()  # its graphs read the fused weights about to be re-laid
    remove_forward_hooks(model)
    remove_fused_projections(model)
    remove_fused_rotary(model)
    remove_fused_norms(model)
    remove_layer_calls(model)
    restore_attention(model, None if patches is None else patches.attention)


def enable_offload_attention(model: torch.nn.Module) -> str:
    """Switch ``model`` to the offload attention (idempotent); returns the original implementation's name.

    The switched model behaves exactly as before with any cache other than an ``OffloadCache``. Building an
    ``OffloadCache`` does this (and installs the rest, :func:`install`); :func:`disable_offload_attention` undoes it.
    """
    return _switched(model).original_attn_implementation


def disable_offload_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` back to its original attention implementation and remove every other patch
    (:func:`remove`)."""
    remove(model)
