"""Switching a model to the offload attention and back."""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..layer_calls import remove_layer_calls
from ..norms import remove_fused_norms
from ..projections import remove_fused_projections
from ..rotary import remove_fused_rotary
from .forward import make_attention_function, make_mask_function
from .handoff import PREFIX

SUPPORTED_IMPLEMENTATIONS = ("sdpa", "eager")


# ---------------------------------------------------------------------------------------------------- model switching
def _register(original: str) -> str:
    name = PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, make_attention_function(original))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, make_mask_function(original))
    return name


def original_implementation(model: torch.nn.Module) -> str:
    """The attention implementation the model had before it was switched (or has now, if never switched)."""
    current = model.config.get_text_config(decoder=True)._attn_implementation or "eager"
    return current[len(PREFIX) :] if current.startswith(PREFIX) else current


def enable_offload_attention(model: torch.nn.Module) -> str:
    """Switch ``model`` to the offload attention (idempotent); returns the original implementation's name.

    The switched model behaves exactly as before with any cache other than an ``OffloadCache``.
    """
    original = original_implementation(model)
    if original not in SUPPORTED_IMPLEMENTATIONS:
        raise ValueError(
            f"OffloadCache supports models running attn_implementation in {SUPPORTED_IMPLEMENTATIONS}; this model "
            f"uses {original!r}. Load it with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))."
        )
    name = _register(original)
    if model.config.get_text_config(decoder=True)._attn_implementation != name:
        model.set_attn_implementation(name)
    return original


def disable_offload_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` back to its original attention implementation."""
    current = model.config.get_text_config(decoder=True)._attn_implementation or ""
    if current.startswith(PREFIX):
        model.set_attn_implementation(current[len(PREFIX) :])
    remove_layer_calls(model)
    remove_fused_norms(model)
    remove_fused_rotary(model)
    remove_fused_projections(model)
