"""The attention switch: a model's attention implementation becomes ``hf_offload_<original>``, and back.

:func:`switch_attention` registers, on first use, an attention function and a mask function under
``hf_offload_<original>`` (``hf_offload_sdpa``, ``hf_offload_flash_attention_2``...: ``AttentionInterface``,
``AttentionMaskInterface``: a mask function under the same name, or transformers would drop the padding) and sets
the model's implementation to it. The
attention function takes the handoff the cache's ``update()`` left (:mod:`hf_offload.attention`); a call without
one (another cache, no cache, a sliding layer) is handed to the original function with the original mask, so a
switched model behaves exactly as before with any other cache. The registered names stay registered: they serve
every switched model and change nothing for the others.

:func:`restore_attention` gives every config of the model back the implementation it had before the switch
(:class:`AttentionSnapshot`), its sub-configs included.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from .. import attention as offload  # its functions looked up at call time (benchmarks wrap them there)
from ..attention import OffloadMask

PREFIX = "hf_offload_"
PAGED = "paged"
"""Implementations whose name holds this (``sdpa_paged``, ``paged|flash_attention_2``...) are those of
continuous batching, which attend over its own paged cache."""
OUTPUT_ATTENTIONS = (
    "OffloadCache does not return attention weights (output_attentions=True): each decode step attends to selected "
    "blocks and never forms the attention matrix. Drop output_attentions (and config.output_attentions), or use "
    "DynamicCache with attn_implementation='eager' for attention weights."
)


def _make_mask_function(original: str):
    def offload_mask(**kwargs) -> OffloadMask:
        return OffloadMask(original, kwargs)

    offload_mask.__name__ = f"{PREFIX}{original}_mask"
    return offload_mask


def _original_attention(original: str, module: torch.nn.Module):
    if original == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to hand over to.")
        return fn
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[original]


def _make_attention_function(original: str):
    def offload_attention(module, query, key, value, attention_mask, **kwargs):
        handoff = offload.take_handoff()
        if handoff is None:
            mask = attention_mask.materialize() if isinstance(attention_mask, OffloadMask) else attention_mask
            return _original_attention(original, module)(module, query, key, value, mask, **kwargs)
        if handoff.key is not key:
            raise RuntimeError(
                f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) changed the key states between "
                "cache.update() and the attention call, which the offload attention cannot follow. This architecture "
                "needs an adapter in hf_offload/patches/."
            )
        layer = handoff.layer
        if kwargs.get("output_attentions"):
            raise ValueError(OUTPUT_ATTENTIONS)
        if getattr(module, "config", None) is not None and module.config is not layer.model_config:
            raise RuntimeError(
                f"This OffloadCache was built for {layer.model_name} and is being used by another model. Build one "
                "OffloadCache(model) per model."
            )
        if attention_mask is not None and not isinstance(attention_mask, OffloadMask):
            raise NotImplementedError(
                "OffloadCache received a ready-made attention mask (e.g. a custom 4D mask); pass a 2D attention_mask "
                "(padding) instead."
            )
        if original not in OWN_FIRST_PREFILL and _is_first_prefill(handoff, query):
            # Nothing cached before this forward: the attention is the model's own over the prompt, so a fast kernel
            # the model was loaded with (flash attention, a Hub kernel) computes it, with the mask it would get.
            mask = attention_mask.materialize() if isinstance(attention_mask, OffloadMask) else attention_mask
            out = _original_attention(original, module)(module, query, key, value, mask, **kwargs)
            layer.finish_step()
            return out
        out = offload.offload_attention_forward(
            handoff,
            query,
            attention_mask,
            scaling=kwargs.get("scaling"),
            softcap=kwargs.get("softcap"),
            sink_logits=kwargs.get("s_aux"),
        )
        return out, None

    offload_attention.__name__ = f"{PREFIX}{original}"
    return offload_attention


OWN_FIRST_PREFILL = ("eager", "sdpa", "flex_attention")
"""Implementations whose first prefill the library computes itself (``scaled_dot_product_attention`` per sequence's
unpadded span, or tiles): no faster there, and lighter on memory than their materialized masks. Under any other
(``flash_attention_2`` / ``_3`` / ``_4``, a Hub kernel, a user's function) a prompt's first forward runs the model's
own function."""


def _is_first_prefill(handoff, query: torch.Tensor) -> bool:
    """Whether this call is a prompt's first forward: several queries, nothing cached before them."""
    q_len = query.shape[-2]
    return q_len > 1 and not handoff.n_blocks_before and not handoff.first_recent_pos and handoff.key.shape[-2] == q_len


def _register(original: str) -> str:
    """Register the offload attention and mask functions for ``original`` (once); returns their name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = PREFIX + original
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make_attention_function(original))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, _make_mask_function(original))
    return name


def _current(model: torch.nn.Module) -> str:
    return model.config.get_text_config(decoder=True)._attn_implementation or ""


def _unswitched(implementation):
    """``implementation`` without the offload prefix (any other value as it is)."""
    switched = isinstance(implementation, str) and implementation.startswith(PREFIX)
    return implementation[len(PREFIX) :] if switched else implementation


def original_implementation(model: torch.nn.Module) -> str:
    """The attention implementation the model had before it was switched (or has now, if never switched)."""
    return _unswitched(_current(model) or "eager")


def _configs(model: torch.nn.Module) -> list:
    """Every config of ``model`` that holds an attention implementation: its own, the sub-configs below it (at any
    depth) and those of the transformers models inside it; each once."""
    from transformers import PreTrainedModel

    found, queue = {}, [model.config]
    queue += [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while queue:
        config = queue.pop(0)
        if config is None or id(config) in found:
            continue
        found[id(config)] = config
        queue += [getattr(config, key, None) for key in getattr(config, "sub_configs", {})]
    return list(found.values())


@dataclass(frozen=True)
class AttentionSnapshot:
    """A model's attention implementations before the switch.

    Attributes:
        original: the implementation the offload attention hands calls without a handoff to (``"sdpa"``, ``"eager"``,
            ``"flash_attention_2"``...).
        values: ``(config, _attn_implementation)`` of every config of the model (:func:`_configs`).
    """

    original: str
    values: tuple


def supported_implementations() -> tuple[str, ...]:
    """The attention implementations a model may run when an OffloadCache is built for it: ``eager`` and every one
    registered with transformers' ``AttentionInterface`` (``sdpa``, ``flash_attention_2`` / ``_3`` / ``_4``,
    ``flex_attention``, a Hub kernel loaded by name, a user's own), except the paged ones of continuous batching.

    The cache's layers attend through the library's own attention (decode and later prefill chunks; a first
    prefill too under ``eager``, ``sdpa`` and ``flex_attention``: :data:`OWN_FIRST_PREFILL`); the model's
    implementation serves a first prefill under the others (flash attention, Hub kernels) and the calls the cache
    does not take (another cache, no cache, sliding layers)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = {"eager", *ALL_ATTENTION_FUNCTIONS.keys()}
    return tuple(sorted(n for n in names if not n.startswith(PREFIX) and PAGED not in n))


def switch_attention(model: torch.nn.Module) -> AttentionSnapshot:
    """Switch ``model`` to the offload attention (idempotent); returns what :func:`restore_attention` restores.

    Raises:
        ValueError: the model runs an implementation not among :func:`supported_implementations` (continuous
            batching's paged attention, or a name transformers does not know).
    """
    original = original_implementation(model)
    supported = supported_implementations()
    if original not in supported:
        if PAGED in original:
            raise ValueError(
                f"This model runs {original!r}, the paged attention of transformers' continuous batching "
                "(generate_batch, transformers serve), which keeps its own paged cache on the device. OffloadCache "
                "serves generate(): load the model with attn_implementation='sdpa' (or call "
                "model.set_attn_implementation('sdpa')) and pass the cache to generate()."
            )
        raise ValueError(
            f"This model runs attn_implementation={original!r}, which transformers has no attention function "
            f"registered for. OffloadCache works with any of {supported}: load the model with one of them, e.g. "
            "attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))."
        )
    # A model switched before (a copy of a switched model) gives the unswitched names.
    values = tuple((c, _unswitched(c._attn_implementation)) for c in _configs(model))
    snapshot = AttentionSnapshot(original, values)
    name = _register(original)
    if _current(model) != name:
        model.set_attn_implementation(name)
    return snapshot


def restore_attention(model: torch.nn.Module, snapshot: AttentionSnapshot | None = None) -> None:
    """Switch ``model`` back: every config to its value in ``snapshot``; without one (a model switched by a copy
    of itself, say), the model to its original implementation."""
    current = _current(model)
    if current.startswith(PREFIX):
        model.set_attn_implementation(current[len(PREFIX) :])
    if snapshot is None:
        return
    for config, value in snapshot.values:
        if config._attn_implementation != value:
            # Only where transformers' own setter gave a sub-config another value than it had (it sets one value
            # for the whole tree): the stored field, as the setter writes it, without touching the sub-configs.
            config._attn_implementation_internal = value
