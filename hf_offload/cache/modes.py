"""The grad and inference modes the cache's methods run in."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def normal_tensors(method: Callable) -> Callable:
    """Run a method of the cache outside inference mode (grad mode off, as inference mode has it) where it is called
    inside it; outside inference mode it runs as it is.

    The cache keeps its state in tensors it changes in place from call to call. Made under
    ``torch.inference_mode()`` they would be inference tensors, which no later call outside it may change
    (``generate()`` runs under ``no_grad``): a cache prefilled under inference mode and continued by ``generate()``
    would fail. Every method that makes or changes the cache's state (of :class:`~hf_offload.cache.OffloadCache`
    and :class:`~hf_offload.cache.OffloadLayer`) carries this decorator, so the cache's tensors are never inference
    tensors and it goes on in either mode, as ``DynamicCache`` does."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)

    return wrapper
