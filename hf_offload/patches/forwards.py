"""Hooks on the model's own forward: the cache a forward is given prepares before it and repairs after a failure.

:func:`install_forward_hooks` puts one forward pre-hook and one forward hook (run on exceptions too) on the model. A
forward given a cache that has ``before_forward`` / ``after_failed_forward`` (an
:class:`~hf_offload.cache.OffloadCache`) calls them: before it, with the number of new tokens (the disk tier reserves
the space the forward's seals may spill, so a full disk refuses the forward before any layer changes); after an
exception escaped it, with the exception (the layers the forward reached before it stopped are rolled back). A
forward given any other cache, or none, is untouched, except that the layers a collected ``OffloadCache`` parked on the
model for its next one are freed (:mod:`hf_offload.cache.parking`). :func:`remove_forward_hooks` takes both hooks
off.
"""

from __future__ import annotations

import sys

import torch


def _given_cache(kwargs: dict):
    return kwargs.get("past_key_values", kwargs.get("cache"))


def _before(module, args, kwargs):
    cache = _given_cache(kwargs)
    prepare = getattr(cache, "before_forward", None)
    if prepare is None:
        _release_parked(module)  # another cache (or none) runs the model: a parked cache's memory goes back
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is None:
        ids = kwargs.get("inputs_embeds")
    if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
        prepare(int(ids.shape[1]), batch=int(ids.shape[0]))
    return None


def _release_parked(model) -> None:
    from . import installed

    patches = installed(model)
    if patches is not None and patches.parked is not None:
        from ..cache.parking import release_parked

        release_parked(model)


def _after(module, args, kwargs, output):
    error = sys.exc_info()[1]
    repair = getattr(_given_cache(kwargs), "after_failed_forward", None)
    if error is not None and repair is not None:
        repair(error)
    return None


def install_forward_hooks(model: torch.nn.Module) -> bool:
    """Put the two hooks on ``model`` (idempotent); returns whether they are there."""
    if _before not in model._forward_pre_hooks.values():
        model.register_forward_pre_hook(_before, with_kwargs=True)
        model.register_forward_hook(_after, with_kwargs=True, always_call=True)
    return True


def remove_forward_hooks(model: torch.nn.Module) -> None:
    """Take the hooks :func:`install_forward_hooks` put on ``model`` off (also those a copy of the model carries)."""
    for hooks, fn in ((model._forward_pre_hooks, _before), (model._forward_hooks, _after)):
        for key in [k for k, hook in hooks.items() if hook is fn]:
            del hooks[key]
            for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
                getattr(model, extra, {}).pop(key, None)
