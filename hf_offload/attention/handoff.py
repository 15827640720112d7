"""The attention function and mask function that an :class:`~hf_offload.cache.OffloadCache` switches a model to.

transformers calls ``cache.update(k, v, layer_idx)`` and then the attention function with the same key tensor, but
never passes the cache to the attention function. ``OffloadLayer.update`` therefore leaves a :class:`Handoff` (the
layer, and the key tensor it returned) that the next attention call takes. A call without a handoff (a
``DynamicCache``, no cache, a sliding layer) is handed to the model's original attention function with the
original mask, so a switched model behaves exactly as before whenever the cache is not an ``OffloadCache``.

The registered mask function returns an :class:`OffloadMask`: the arguments transformers prepared, kept lazily.
The original mask is built from them only if the original attention function needs it (once per forward, shared by
the layers); the offload path evaluates the same mask function only at the positions it attends to, so no
``q_len x context`` mask is ever built.

Nothing here is registered at import time; :func:`enable_offload_attention` registers on first use.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS


# ----------------------------------------------------------------------------------------------------------- handoff
@dataclass
class Handoff:
    """What ``OffloadLayer.update`` leaves for the attention call that follows it.

    Attributes:
        layer: the cache layer that was updated.
        key: the key tensor ``update`` returned (the attention call must receive this very object).
        recent_values: the value tensor ``update`` returned.
        first_recent_pos: cache position of the first token of ``key`` (the device-resident recent tokens).
        n_blocks_before: sealed blocks before this update (the blocks this call selects from).
        n_recent: recent tokens that may be attended; ``None``: all of ``key`` (a decode step being captured with
            its whole decoder layer hands over the whole open block, only its first ``n_recent`` tokens filled).
    """

    layer: Any
    key: torch.Tensor
    recent_values: torch.Tensor
    first_recent_pos: int
    n_blocks_before: int
    n_recent: int | None = None

    @property
    def recent_tokens(self) -> int:
        """Recent tokens that may be attended (the open block, this step's tokens included)."""
        return self.key.shape[-2] if self.n_recent is None else self.n_recent


_local = threading.local()


def leave_handoff(handoff: Handoff) -> None:
    """Record the handoff of an update; raises if the previous update of the same cache was never attended."""
    stale = getattr(_local, "pending", None)
    if stale is not None and stale.layer.cache_id == handoff.layer.cache_id:
        if stale.layer.layer_idx == handoff.layer.layer_idx - 1:
            raise RuntimeError(
                "An OffloadCache was updated but the model's attention never used it: the model running this cache "
                "does not use the offload attention. An OffloadCache serves only the model it was built with "
                f"(built for {handoff.layer.model_name}); build one OffloadCache(model) per model."
            )
    _local.pending = handoff


def take_handoff() -> Handoff | None:
    """Remove and return the pending handoff of this thread, if any."""
    handoff = getattr(_local, "pending", None)
    _local.pending = None
    return handoff


# -------------------------------------------------------------------------------------------------------------- mask
class OffloadMask:
    """The arguments of one mask construction, evaluated lazily.

    Args:
        original: the original attention implementation whose mask function builds the dense mask.
        kwargs: the keyword arguments transformers passed to the mask function (``batch_size``, ``q_length``,
            ``kv_length``, ``q_offset``, ``kv_offset``, ``mask_function``, ``attention_mask`` (2D padding mask,
            ``[batch, >= kv_length]``, ``torch.bool``), ...).
    """

    def __init__(self, original: str, kwargs: dict[str, Any]):
        self.original = original
        self.kwargs = kwargs
        self._dense: Any = None
        self._built = False
        self._block_valid: dict[tuple[int, int, int], torch.Tensor] = {}
        self._memo: dict[tuple, Any] = {}
        padding = kwargs.get("attention_mask")
        if padding is not None:
            needed = kwargs["kv_length"] + kwargs.get("kv_offset", 0)
            if padding.shape[-1] < needed:
                padding = torch.nn.functional.pad(padding, (0, needed - padding.shape[-1]))
            padding = padding.bool()
        self.padding = padding

    def materialize(self) -> Any:
        """The mask the original implementation would have received (built once): its mask function's, or, for an
        implementation without one (a user's own attention function), the 2D padding mask as given, as transformers
        passes it to such an implementation."""
        if not self._built:
            if self.original in ALL_MASK_ATTENTION_FUNCTIONS:
                self._dense = ALL_MASK_ATTENTION_FUNCTIONS[self.original](**self.kwargs)
            else:
                self._dense = self.kwargs.get("attention_mask")
            self._built = True
        return self._dense

    def to(self, *args, **kwargs) -> "OffloadMask":
        """Move the padding mask (used by accelerate's device hooks)."""
        moved = dict(self.kwargs)
        if moved.get("attention_mask") is not None:
            moved["attention_mask"] = moved["attention_mask"].to(*args, **kwargs)
        return OffloadMask(self.original, moved)

    def allowed(self, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """Which (query, key) pairs may attend.

        Args:
            q_pos: absolute query positions, shape ``[q]``, ``torch.int64``, compute device.
            kv_pos: absolute key positions, shape ``[batch or 1, heads or 1, n]``, ``torch.int64``.

        Returns:
            Shape ``[batch or 1, heads or 1, q, n]``, ``torch.bool``.
        """
        batch = self.kwargs.get("batch_size", kv_pos.shape[0])
        b = torch.arange(batch, device=kv_pos.device).view(-1, 1, 1, 1)
        q = q_pos.view(1, 1, -1, 1)
        kv = kv_pos[:, :, None, :]
        mask_function = self.kwargs.get("mask_function")
        ok = torch.as_tensor(mask_function(b, 0, q, kv), device=kv.device) if mask_function else kv <= q
        if self.padding is not None:
            ok = ok & self.padding.to(kv.device)[b, kv]
        return ok

    def block_valid(self, q_pos: int, n_blocks: int, block_tokens: int, device) -> torch.Tensor:
        """Blocks with at least one token that query position ``q_pos`` may attend, ``[batch, n_blocks]`` bool."""
        key = (q_pos, n_blocks, block_tokens)
        if key not in self._block_valid:
            kv = torch.arange(n_blocks * block_tokens, device=device).view(1, 1, -1)
            ok = self.allowed(torch.full((1,), q_pos, device=device), kv)[:, 0, 0]  # no host-to-device copy
            batch = self.kwargs.get("batch_size", ok.shape[0])
            self._block_valid[key] = ok.expand(batch, -1).reshape(batch, n_blocks, block_tokens).any(-1)
        return self._block_valid[key]


    def memo(self, key: tuple, build: Callable[[], Any]) -> Any:
        """``build()``, computed once per key for this mask (one forward): what every layer of the forward would
        compute alike, e.g. a decode step's forced blocks."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]


def plain_causal(mask: OffloadMask | None) -> bool:
    """Whether ``mask`` is transformers' plain causal mask (with or without a padding mask) over keys from position
    0 whose last ``q_length`` positions are the queries (a prompt, a later prefill chunk or a decode step)."""
    if mask is None:
        return True
    from transformers.masking_utils import causal_mask_function

    kwargs = mask.kwargs
    if kwargs.get("mask_function") is not causal_mask_function or kwargs.get("kv_offset", 0):
        return False
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    if q_length is None or kv_length is None:
        return False
    return int(kwargs.get("q_offset", 0)) + int(q_length) == int(kv_length)
