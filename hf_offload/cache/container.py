"""``OffloadCache``: a transformers ``Cache`` whose full-attention layers keep their KV in host memory.

The container builds one :class:`~.layer.OffloadLayer` per full-attention layer (sliding-window layers of hybrid
models, e.g. Gemma 3, keep transformers' own dense sliding-window layer on the device: their KV is bounded by the
window), installs the model patches (:mod:`hf_offload.patches`), links each offloaded layer to the next one for
lookahead, and reports :meth:`OffloadCache.stats`.
"""

from __future__ import annotations

import copy
import numbers
import os
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from ..attention.handoff import leave_handoff, take_handoff
from ..config import OffloadConfig
from ..patches import install as install_patches
from ..patches import installed as installed_patches
from ..patches.attention import OUTPUT_ATTENTIONS
from ..patches.layers import decoder_layers
from ..patches.norms import FusedNorm
from ..patches.projections import fused_groups
from ..patches.rotary import RotaryForward
from ..selectors import Selector, get_selector
from ..store import HostMemoryBudget, writes
from ..store.disk import DiskTier
from .execution import call_fusions, fused
from .layer import OffloadLayer
from .modes import normal_tensors
from .parking import ParkSlot, park, take
from .persist import load_cache, save_cache
from .shared import DeviceResources
from .stats import summarize

_SLIDING_TYPES = ("sliding_attention", "chunked_attention")



def layer_types(config) -> list[str]:
    """The attention type of each layer of a (text) model config that holds KV: ``"full_attention"``,
    ``"sliding_attention"``, ``"chunked_attention"`` or another type (linear attention, state-space layers)."""
    types = getattr(config, "layer_types", None)
    if types is None:
        n = config.num_hidden_layers
        if getattr(config, "sliding_window", None) is not None:
            types = ["sliding_attention"] * n
        elif getattr(config, "attention_chunk_size", None) is not None:
            types = ["chunked_attention"] * n
        else:
            types = ["full_attention"] * n
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    return list(types[: len(types) - shared] if shared else types)



def generate_cache_kwarg() -> str:
    """The keyword under which the installed transformers' ``generate()`` takes a cache: ``"cache"`` where its
    generation inputs are named so (transformers 5.24 renamed ``past_key_values`` and warns about the old name until
    6.0), else ``"past_key_values"`` (transformers 5.17)."""
    import inspect

    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword under which ``model.forward`` takes a cache: ``"cache"`` where it has that parameter (transformers
    5.24 renamed ``past_key_values``; the old name warns until it is removed), else ``"past_key_values"``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class OffloadCache(Cache):
    """A KV cache that keeps full-attention layers in host memory and attends to a budget of blocks per step.

    Building it switches ``model`` to the offload attention (idempotent); with any other cache the switched model
    behaves exactly as before.

    Args:
        model: the transformers decoder model that will use this cache.
        budget_tokens: KV tokens one decode query attends to, per sequence and layer (sink and window included).
        config: a full :class:`~hf_offload.config.OffloadConfig`; other keyword arguments override its fields.
        **overrides: any :class:`~hf_offload.config.OffloadConfig` field (``block_tokens``, ``sink_tokens``,
            ``window_tokens``, ``selector``, ``pool_tokens``, ...).

    Example:
        >>> from hf_offload import OffloadCache
        >>> cache = OffloadCache(model, budget_tokens=2048)  # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)  # doctest: +SKIP
        >>> cache.stats()["host_kv_bytes"]  # doctest: +SKIP

        ``past_key_values=`` works on every supported transformers; newer releases (5.24) renamed it ``cache=`` and
        warn about the old name. ``**cache.generate_kwargs()`` passes the cache under the name the installed
        version expects: ``model.generate(**inputs, **cache.generate_kwargs(), max_new_tokens=64)``.
    """

    def __init__(self, model: torch.nn.Module, budget_tokens: int | None = None, *, config=None, **overrides):
        if config is None:
            config = OffloadConfig(**({} if budget_tokens is None else {"budget_tokens": budget_tokens}), **overrides)
        else:
            changes = dict(overrides, **({} if budget_tokens is None else {"budget_tokens": budget_tokens}))
            config = config.replace(**changes) if changes else config
        text_config = _check_model(model)
        # What the layers share lives outside the cache, so that no layer refers back to the cache: a cache nobody
        # holds is freed at once (its pinned host pools with it), not at the next cyclic garbage collection. It
        # also holds the settings and the selector as they stand (a coarsening of the summaries changes both).
        self._shared = DeviceResources(config, get_selector(config.selector))
        if (config.decode_capacity_blocks or 1) > 1 and not self.selector.masks_invalid:
            raise ValueError(
                f"decode_capacity_blocks={config.decode_capacity_blocks} scores blocks past the sealed ones, masked, "
                f"which selector {self.selector.name!r} does not support (its scores of valid blocks depend on every "
                "block: Selector.masks_invalid is False). Use decode_capacity_blocks=None or 1, or give the selector a "
                "masked_score() (every built-in selector has one or needs none)."
            )
        _check_reselect(config, self.selector)
        _check_adaptive(config, self.selector)
        self.model_config = text_config
        self.disk = _disk_tier(config, model)
        self.host_budget = HostMemoryBudget(config.host_memory_gib, self.disk)
        self._closed = False
        self._fork_of: weakref.ref | None = None  # the cache this one was forked from (fork(into=...) checks it)
        types = layer_types(text_config)
        unsupported = sorted(set(types) - {"full_attention", *_SLIDING_TYPES})
        if unsupported:
            raise ValueError(
                f"OffloadCache serves attention layers only; {model.__class__.__name__} has layer types {unsupported} "
                "(linear attention / state-space layers) that it cannot hold."
            )
        if "full_attention" not in types:
            raise ValueError(
                f"Every attention layer of {model.__class__.__name__} is a sliding-window layer "
                f"(sliding_window={getattr(text_config, 'sliding_window', None)}); sliding layers stay on the device, "
                "so nothing would be offloaded. Load the model with config.sliding_window=None if it was trained "
                "with full attention, or use DynamicCache."
            )
        layers: list[CacheLayerMixin] = []
        for idx, kind in enumerate(types):
            if kind == "full_attention":
                first = not any(isinstance(layer, OffloadLayer) for layer in layers)
                layers.append(
                    OffloadLayer(config, self.selector, idx, self.host_budget, id(self), text_config, self._shared, first)
                )
            else:
                window = text_config.sliding_window if kind == "sliding_attention" else text_config.attention_chunk_size
                layers.append(DynamicSlidingWindowLayer(sliding_window=window))
        super().__init__(layers=layers)
        offload = self.offload_layers
        modules = dict((idx, module) for module, idx in decoder_layers(model))
        for layer, nxt in zip(offload, offload[1:]):
            layer.recaller.next = nxt.recaller  # lookahead goes from each offloaded layer to the next one
            if nxt.layer_idx == layer.layer_idx + 1:  # its query predicted from this layer's input (same layer type)
                layer.recaller.next_decoder = modules.get(nxt.layer_idx)
        # The attention switch, whole-layer calls, fused norms / rotary / projections (shared by every cache of
        # the model; hf_offload.patches.remove(model) or disable_offload_attention(model) gives the model back).
        self.patches = install_patches(model, config)
        self.original_attn_implementation = self.patches.original_attn_implementation
        self._model_ref = weakref.ref(model)
        # What garbage collection parks on the model for its next cache (parking: graphs captured once); no
        # reference back to this cache.
        self._park = ParkSlot(offload, self._shared, self.host_budget, self.patches, self._model_ref,
                              disk=self.disk is not None)  # fmt: skip
        self._parker = weakref.finalize(self, park, self._park)
        self._parker.atexit = False
        self._parking: str | None = None  # what the first forward did with a parked state (stats()["parking"])
        self._broken: str | None = None  # why the cache cannot be used until reset(), or None

    @property
    def _broken(self) -> str | None:
        return self._park.broken

    @_broken.setter
    def _broken(self, why: str | None) -> None:
        self._park.broken = why

    @property
    def config(self) -> OffloadConfig:
        """The cache's settings as they stand (:meth:`set_options` and a coarsening of the summaries change them)."""
        return self._shared.config

    @config.setter
    def config(self, config: OffloadConfig) -> None:
        self._shared.config = config

    @property
    def selector(self) -> Selector:
        """The selection policy as it stands (a coarser level once the summaries were coarsened:
        ``OffloadConfig.coarsen_summaries``)."""
        return self._shared.selector

    # ------------------------------------------------------------------------------------------------ life cycle
    @normal_tensors
    def close(self) -> None:
        """Free every tier now: the device and host memory of the cached tokens and the disk tier's files (its
        directory is removed; blocks a fork still shares stay until the fork lets go). The cache cannot be used
        afterwards. Garbage collection and the end of the process do the same; ``with OffloadCache(...) as
        cache:`` closes at the end of the block.

        >>> with OffloadCache(model, host_memory_gib=8, disk_dir="/nvme/kv") as cache:  # doctest: +SKIP
        ...     out = model.generate(**inputs, past_key_values=cache)
        """
        if self._closed:
            return
        self._parker.detach()
        self._park.closed = True
        self._release_all()
        self._closed = True

    def __enter__(self) -> "OffloadCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _release_all(self) -> None:
        """Drop every token of every layer and the disk tier's files (the broken state stays)."""
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, DynamicSlidingWindowLayer):
                self.layers[idx] = DynamicSlidingWindowLayer(sliding_window=layer.sliding_window)
            else:
                layer.reset()
        if self.disk is not None:
            self.disk.close()

    @normal_tensors
    def before_forward(self, q_len: int, batch: int | None = None) -> None:
        """Before a forward of ``q_len`` tokens (of ``batch`` sequences, where known) through this cache (called by
        the model's forward pre-hook, :mod:`hf_offload.patches.forwards`): take what a collected cache of the model
        parked for it (:meth:`_take_parked`), reserve the disk space its seals may spill (:meth:`DiskTier.reserve`),
        so that a full disk refuses the forward before any layer changes."""
        if self._closed or self._broken is not None:
            return
        if self.patches.parked is not None:
            self._take_parked(batch)
        need: dict[int, list] = {}
        for layer in self.offload_layers:
            store = layer.blocks
            if not store.is_initialized:
                continue
            host = store.host
            if host.disk is None or host.budget.limit_bytes is None:
                continue
            new = store.batch * ((store.keys.shape[-2] + q_len) // store.block_tokens)
            free = len(host.chunks) * host.chunk_blocks - host._next_id + len(host._free)
            grow = -(-max(0, new - free) // host.chunk_blocks) * host.chunk_nbytes
            entry = need.setdefault(id(host.budget), [host.budget, 0])
            entry[1] += grow
        for budget, grow in need.values():
            budget.disk.reserve(budget.reserved_bytes + grow - budget.limit_bytes)

    def _take_parked(self, batch: int | None) -> None:
        """Before the first forward (of ``batch`` sequences, where known) of a cache holding no tokens: take the
        layers, buffers and graphs that a collected cache of the same model, settings and batch parked
        (:mod:`~hf_offload.cache.parking`), emptied in place, so that its captured graphs replay here; a parked state
        that does not fit is freed before the forward allocates."""
        offload = self.offload_layers
        if any(layer.blocks.is_initialized for layer in offload):
            return
        model = self._model_ref()
        state, why = (None, None) if model is None else take(self.patches, self.config, model)
        if state is None:
            self._parking = None if why is None else f"freed a parked state: {why}"
            return
        held = state.layers[0].blocks.batch
        why = ("this cache has a disk tier" if self.disk is not None
               else "other layers" if [layer.layer_idx for layer in state.layers] != [l.layer_idx for l in offload]
               else f"batch {batch}, not {held}" if batch is not None and batch != held else None)  # fmt: skip
        if why is not None:
            state.release()
            self._parking = f"freed a parked state: {why}"
            return
        self._parking = "took a parked state"
        reserved = {layer.layer_idx: layer.blocks.reserved_blocks for layer in offload}
        self._shared, self.host_budget = state.shared, state.budget
        self._park.layers, self._park.shared, self._park.budget = list(state.layers), state.shared, state.budget
        for layer in state.layers:
            self.layers[layer.layer_idx] = layer
            layer.cache_id = id(self)
        for statics in self._shared.statics.values():
            statics.forget_last()
        if self._shared.phase_timer is not None:
            self._shared.phase_timer.reset()
        for layer in state.layers:
            layer.recycle()
            # This cache's own reservation (reserve() before its first forward), not the parked cache's; the
            # buffers keep the size they have.
            layer.blocks.reserved_blocks = 0
            if reserved[layer.layer_idx]:
                layer.reserve(reserved[layer.layer_idx] * layer.block_tokens)

    @normal_tensors
    def after_failed_forward(self, error: BaseException) -> None:
        """After ``error`` escaped a forward through this cache (called by the model's forward hook,
        :mod:`hf_offload.patches.forwards`): if it stopped part-way (its layers hold different
        numbers of tokens), roll the layers it reached back (:meth:`_roll_back`); where that cannot be exact, the
        cache is broken: free its tiers and files now (:meth:`reset` makes it usable)."""
        lengths = [] if self._closed else self._lengths()
        if len(set(lengths)) <= 1:
            return
        if self._broken is None and self._roll_back(min(lengths)):
            return
        if self._broken is None:
            self._broken = f"{type(error).__name__} raised in the middle of a forward"
        self._release_all()
        self._broken += " (its tiers and disk files were freed)"

    # --------------------------------------------------------------------------------------------- forward calls
    @normal_tensors
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Append the new keys and values of layer ``layer_idx`` (transformers calls it once per layer and forward);
        see :meth:`OffloadLayer.update`.

        Raises:
            RuntimeError: at the first layer's update, if an earlier forward stopped part-way (its layers hold
                different numbers of tokens): call :meth:`reset` or build a new ``OffloadCache``.
        """
        if layer_idx == 0:
            self._check_usable()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    @normal_tensors
    def run_decoder_layer(self, layer_idx: int, forward: Callable, args: tuple, kwargs: dict):
        """Run one call of the model's decoder layer ``layer_idx`` (its own forward ``forward`` with transformers'
        arguments): offloaded layers may replay it from a CUDA graph (:meth:`OffloadLayer.run_decoder_layer`); other
        layers call ``forward``. Called by the routing :func:`~hf_offload.patches.layers.install_layer_calls` puts in front
        of each decoder layer.

        Raises:
            ValueError: for ``output_attentions=True`` (before anything is cached): the cache never forms the
                attention weights.
            RuntimeError: if the cache is broken (:meth:`update`). An exception raised inside the call (including
                ``KeyboardInterrupt``) that leaves the layers one step apart rolls the layers ahead back, so the cache
                holds what it held before the failed forward; where a sliding-window layer makes that impossible,
                it marks the cache broken.
        """
        if layer_idx == 0:
            self._check_usable()
            if kwargs.get("output_attentions") or getattr(self.model_config, "output_attentions", False):
                raise ValueError(OUTPUT_ATTENTIONS)
        layer = self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else None
        try:
            if not isinstance(layer, OffloadLayer):  # a sliding-window layer: its norms still run the kernel
                with fused(call_fusions(self.config, args, kwargs)):
                    return forward(*args, **kwargs)
            return layer.run_decoder_layer(forward, args, kwargs)
        except BaseException as error:
            self._after_fault(error, layer_idx)
            raise

    def _after_fault(self, error: BaseException, layer_idx: int) -> None:
        """After ``error`` escaped decoder layer ``layer_idx``: forget this cache's pending handoff (another cache's
        attention must not take it) and, if its layers no longer hold the same tokens, roll the layers that took the
        failed forward's tokens back to what they held before it (:meth:`_roll_back`); where that cannot be done
        exactly, mark the cache broken."""
        pending = take_handoff()
        if pending is not None and getattr(pending.layer, "cache_id", None) != id(self):
            leave_handoff(pending)  # not ours: put it back
        lengths = self._lengths()
        if len(set(lengths)) > 1 and not self._roll_back(min(lengths)):
            self._broken = (
                f"{type(error).__name__} raised in decoder layer {layer_idx} in the middle of a forward"
            )

    def _roll_back(self, length: int) -> bool:
        """Crop every layer holding more than ``length`` tokens back to ``length`` (the tokens every layer held when
        the failed forward began: the layers it had not reached yet still hold them); ``True`` where every layer
        then holds ``length``. A sliding-window layer that reached its window has dropped old tokens for the new
        ones and cannot be rolled back exactly; nothing is cropped then."""
        layers = [layer for layer in self.layers if int(layer.get_seq_length()) > length]
        for layer in layers:
            window = getattr(layer, "sliding_window", None)
            if isinstance(layer, DynamicSlidingWindowLayer) and int(layer.get_seq_length()) >= window:
                return False
        try:
            for layer in layers:
                layer.crop(length - int(layer.get_seq_length()))
        except Exception:  # a layer the fault left inconsistent: the cache is marked broken
            return False
        return set(self._lengths()) == {length}

    def _settle(self) -> list[int]:
        """Roll back the layers that a forward stopped outside :meth:`run_decoder_layer` reached (an exception from a
        forward pre-hook of a decoder layer, say, which the cache does not see raised), or mark the cache broken where
        that cannot be exact; returns the layers' lengths."""
        lengths = self._lengths()
        if self._broken is None and len(set(lengths)) > 1:
            if self._roll_back(min(lengths)):
                lengths = self._lengths()
            else:
                self._broken = "a forward stopped in the middle"
        return lengths

    @normal_tensors
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens held by layer ``layer_idx``; after a forward that stopped part-way, what every layer held before
        it (:meth:`_settle`)."""
        self._settle()
        return super().get_seq_length(layer_idx)

    def _lengths(self) -> list[int]:
        # int(): a sliding layer cropped by a tensor (transformers 5.17's assisted decoding) counts in a tensor
        return [int(layer.get_seq_length()) for layer in self.layers]

    def _check_usable(self) -> None:
        """Raise ``RuntimeError`` if the cache was closed, or a forward stopped part-way through it and could not
        be rolled back (see :meth:`update` and :meth:`_settle`)."""
        if self._closed:
            raise RuntimeError(
                "This OffloadCache was closed (cache.close(), or the end of its with block): its tiers and files are "
                "freed. Build a new OffloadCache."
            )
        lengths = self._settle()
        if self._broken is not None:
            raise RuntimeError(
                f"This OffloadCache is unusable: {self._broken}, so its layers hold different numbers of tokens "
                f"({lengths}). Call cache.reset() or build a new OffloadCache (and prefill the prompt again)."
            )

    @normal_tensors
    def reset(self) -> None:
        """Drop every cached token of every layer (the cache serves any new batch); also clears a broken state.
        The disk tier's files go too (a later spill makes new ones)."""
        if self._closed:
            self._check_usable()
        self._release_all()  # 5.17's reset of a sliding layer keeps zeroed keys: each gets a new one
        self._broken = None
        self._shared.restore_level()

    # ------------------------------------------------------------------------------------------------- editing
    @normal_tensors
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest tokens of every layer: ``crop(-n)`` drops ``n`` (assisted and prompt-lookup decoding),
        ``crop(max_length)`` with a positive length keeps at most that many (transformers up to 5.17)."""
        self._check_usable()
        super().crop(tokens_to_remove)

    @normal_tensors
    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every sequence ``repeats`` times (``[a, b]`` -> ``[a, a, b, b]``); copies share host blocks."""
        self._check_usable()
        super().batch_repeat_interleave(repeats)

    @normal_tensors
    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the sequences ``indices`` (integers or a boolean mask over the batch), in that order."""
        self._check_usable()
        super().batch_select_indices(indices)

    @normal_tensors
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the sequences for beam search: sequence ``i`` becomes the old sequence ``beam_idx[i]``."""
        self._check_usable()
        super().reorder_cache(beam_idx)

    @normal_tensors
    def __deepcopy__(self, memo: dict) -> "OffloadCache":
        """An independent cache with the same contents for the same model (a prompt prefilled once, continued
        several ways): every tier is copied; the model, its patches and the model config are shared, not copied.
        Counters (:meth:`stats`) start at zero and graphs are captured again.

        Raises:
            RuntimeError: if the model was freed, or the cache is broken (:meth:`update`).
        """
        self._check_usable()
        model = self._model_ref()
        if model is None:
            raise RuntimeError("The model this OffloadCache was built for has been freed; a copy needs the model.")
        clone = OffloadCache(model, config=self.config)
        memo[id(self)] = clone
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, OffloadLayer):
                clone.layers[idx].load_state(layer)
            else:
                clone.layers[idx] = copy.deepcopy(layer, memo)
        return clone

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "An OffloadCache cannot be pickled: its KV lives in this process's (pinned) host pools and it is bound to "
            "its model. Write it to a file with cache.save(path) and read it back with OffloadCache.load(path, "
            "model); within a process, cache.fork() continues a prefilled prompt sharing its blocks, and "
            "copy.deepcopy(cache) copies it."
        )

    @normal_tensors
    def fork(self, batch: int | None = None, *, into: "OffloadCache | None" = None) -> "OffloadCache":
        """A new cache whose sequences continue this one's (a prefix prefilled once, continued by many requests),
        sharing its sealed blocks instead of copying them.

        Each of this cache's sequences is continued by ``batch // B`` consecutive sequences of the fork (``B``: this
        cache's batch; ``[a, b]`` forked to 4 gives ``[a, a, b, b]``). The sealed host blocks are shared by
        reference count: a fork costs no host memory until it seals blocks of its own, which go to the same host
        pools (and count against this cache's ``host_memory_gib``). The open block (fewer than ``block_tokens``
        tokens per sequence) and the block summaries are copied on the device, so that no later edit (a decode
        step, a crop, a batch edit, a reset) of the fork reaches this cache or the other way round; either may be
        dropped first. Counters (:meth:`stats`) start at zero. Settings are this cache's; change the ones that
        only affect coming steps with :meth:`set_options`.

        Args:
            batch: sequences of the fork, a positive multiple of this cache's batch; ``None``: this cache's batch.
            into: an earlier fork of this cache, of ``batch`` sequences, to reuse (a question answered, the next one
                comes): its tokens are dropped (blocks only it held go back to the pool) and it holds this cache's
                tokens again, in its own buffers, so that the CUDA graphs its decode steps captured replay instead
                of being captured again (a new fork captures its own: its first decode step costs about as much as
                the rest of a short answer). Where this cache re-encoded its summaries at a coarser level since
                that fork, or holds more blocks (or a larger reservation) than that fork's buffers take, a new
                fork is returned instead and ``into`` is left as it was.

        Returns:
            An independent :class:`OffloadCache` for the same model, holding the same tokens per sequence
            (``into``, refilled, where given).

        Raises:
            ValueError: if this cache holds no tokens yet, for a ``batch`` that is not a multiple of its batch, or
                for an ``into`` that is not a fork of this cache with ``batch`` sequences.
            RuntimeError: if the model was freed, or either cache is broken (:meth:`update`) or closed.

        Example:
            >>> prefix = OffloadCache(model, budget_tokens=2048)  # doctest: +SKIP
            >>> model(input_ids=document, past_key_values=prefix)  # the document, prefilled once  # doctest: +SKIP
            >>> cache = prefix.fork(batch=len(questions))  # doctest: +SKIP
            >>> model.generate(input_ids=torch.cat([document.expand(len(questions), -1), questions], 1),
            ...                past_key_values=cache, max_new_tokens=64)  # doctest: +SKIP
            >>> cache = prefix.fork(batch=len(questions), into=cache)  # the next questions  # doctest: +SKIP
        """
        self._check_usable()
        model = self._model_ref()
        if model is None:
            raise RuntimeError("The model this OffloadCache was built for has been freed; a fork needs the model.")
        held = [layer for layer in self.offload_layers if layer.blocks.is_initialized]
        if not held:
            raise ValueError("fork() continues the tokens a cache holds, and this one holds none yet: prefill the "
                             "prefix first (model(input_ids=prefix_ids, past_key_values=cache)).")  # fmt: skip
        have = held[0].blocks.batch
        batch = have if batch is None else batch
        if isinstance(batch, bool) or not isinstance(batch, numbers.Integral) or batch < 1 or batch % have:
            raise ValueError(f"fork(batch=...) takes a positive multiple of the cache's batch ({have}): each sequence "
                             f"is continued by batch // {have} sequences of the fork; got {batch!r}.")  # fmt: skip
        rows = torch.arange(have).repeat_interleave(int(batch) // have)
        if into is not None and self._refill(into, rows):
            return into
        clone = OffloadCache(model, config=self.config)
        clone._fork_of = weakref.ref(self)
        # Host writes of this cache that a shared block's later recall would read: done, once per device.
        rows_dev = _synced_rows({layer.device for layer in self.offload_layers if layer.blocks.is_initialized}, rows)
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, OffloadLayer):
                held = rows_dev.get(layer.device) if layer.blocks.is_initialized else None
                clone.layers[idx].share_rows(layer, rows, held, synced=True)
            else:
                clone.layers[idx] = _sliding_rows(layer, rows)
        return clone

    def _refill(self, into: "OffloadCache", rows: torch.Tensor) -> bool:
        """``fork(into=into)``: refill ``into`` with this cache's sequences ``rows`` in place; ``False`` (``into``
        untouched) where this cache's summaries are no longer laid out as ``into``'s."""
        if not isinstance(into, OffloadCache) or into is self:
            raise ValueError(f"fork(into=...) takes an earlier fork of this cache, got {type(into).__name__}.")
        into._check_usable()
        parent = into._fork_of() if into._fork_of is not None else None
        pairs = list(zip(self.layers, into.layers))
        offload = [(a, b) for a, b in pairs if isinstance(a, OffloadLayer)]
        if parent is not self or any(
            not isinstance(b, OffloadLayer) or b.blocks.is_initialized != a.blocks.is_initialized
            or (a.blocks.is_initialized and b.blocks.host is not a.blocks.host)
            for a, b in offload
        ):  # fmt: skip
            raise ValueError("fork(into=...) takes a fork of this cache (made by this cache's fork()); that cache "
                             "is not one: fork this cache anew.")  # fmt: skip
        held = [(a, b) for a, b in offload if a.blocks.is_initialized]
        if any(b.blocks.batch != len(rows) for _, b in held):
            raise ValueError(f"fork(batch={len(rows)}, into=...) refills a fork of {len(rows)} sequences; that one "
                             f"has {held[0][1].blocks.batch}: pass its batch, or fork anew.")  # fmt: skip
        if not all(b.blocks.refill_fits(a.blocks) for a, b in held):
            return False  # coarsened summaries, or more blocks than that fork's buffers take: a new fork
        for statics in into._shared.statics.values():
            statics.forget_last()
        # One synchronisation per device for the whole refill (BlockStore.refill needs it): side-stream writes and
        # prefetches of either cache, and the host writes of this one, finish first.
        rows_dev = _synced_rows({a.blocks.device for a, b in held}, rows)
        try:
            # The small device writes of every layer (tables, summaries, open blocks, slot maps, counters): launched
            # together at the end, a few launches instead of a few dozen per layer.
            with writes.gathered():
                for idx, (mine, theirs) in enumerate(pairs):
                    if isinstance(mine, OffloadLayer):
                        if mine.blocks.is_initialized:
                            theirs.refill_rows(mine, rows, rows_dev[mine.blocks.device])
                    else:
                        into.layers[idx] = _sliding_rows(mine, rows)
                into.reset_stats()
        except BaseException:
            into._broken = "fork(into=...) stopped in the middle of refilling it"
            raise
        return True

    @normal_tensors
    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> None:
        """Write this cache to one safetensors file (never pickle): every cached token of every layer, sealed blocks
        and open block, the block summaries, lengths and positions, the settings, a fingerprint of the model and
        checksums (:mod:`hf_offload.cache.persist` describes the file). Saving streams block by block from the host
        pool: no second copy of the KV is made in memory. Counters and captured graphs are not saved. Call it
        between forwards.

        Args:
            path: the file to write; it appears complete or not at all (written under a temporary name in the same
                directory, then renamed).
            overwrite: replace an existing file at ``path``.

        Raises:
            FileExistsError: if ``path`` exists and ``overwrite`` is false.
            OSError: if the directory does not exist or is not writable, or the disk is full (nothing is left behind).
            RuntimeError: if the model was freed, or the cache is broken (:meth:`update`).
            ValueError: for a selector instance no registered name rebuilds (a file names its selector).

        Example:
            >>> cache.save("document.safetensors")  # doctest: +SKIP
        """
        save_cache(self, Path(path), overwrite)

    @classmethod
    @normal_tensors
    def load(cls, path: str | os.PathLike, model: torch.nn.Module, **overrides) -> "OffloadCache":
        """A new cache for ``model`` holding the cache :meth:`save` wrote to ``path``, in this or another process:
        continuing it generates what continuing the saved cache would have. Blocks are read run by run straight into
        host memory; summaries and open blocks go to each layer's device. Continue with the same token ids
        and attention mask the saved cache was filled with (as with any cache). Counters start at zero.

        Args:
            path: a file :meth:`save` wrote.
            model: the model the cache was saved from (same checkpoint and dtype; any device).
            **overrides: settings to change (any :class:`~hf_offload.config.OffloadConfig` field but
                ``block_tokens`` and ``selector``, which fix the file's layout), e.g. ``budget_tokens``,
                ``host_memory_gib``.

        Raises:
            CacheFileError: (a ``ValueError``) for a file that is not a saved cache, is truncated or corrupted (a
                checksum differs), has an unknown format version, or was saved from another model; nothing is built.
            FileNotFoundError: if there is no file at ``path``.
            ValueError: for an override of ``block_tokens`` or ``selector``.

        Example:
            >>> cache = OffloadCache.load("document.safetensors", model)  # doctest: +SKIP
        """
        return load_cache(cls, Path(path), model, overrides)

    @normal_tensors
    def set_lookahead(self, lookahead: bool | None) -> None:
        """Switch layer-ahead lookahead on (``True``), off (``False``) or to on-where-the-kernels-run (``None``) for the coming
        decode steps, e.g. to compare both on one filled cache; see :class:`~hf_offload.config.OffloadConfig`."""
        self.set_options(lookahead=lookahead)

    @normal_tensors
    def set_options(self, **changes) -> None:
        """Change settings that only affect coming decode steps (``lookahead``, ``cuda_graphs``, ``graph_scope``,
        ``timing``, ``fused_norms``, ``fused_rotary``, ``fused_projections``, ``reselect_every``,
        ``disk_stage_near``, ``disk_stage_left_out``) on a filled cache,
        e.g. to compare them on one cache. Captured decode graphs are dropped (captured again).

        Raises:
            ValueError: for any other field, or an invalid value (nothing is changed then).
        """
        options = {"lookahead", "cuda_graphs", "graph_scope", "timing", "fused_norms", "fused_rotary",
                   "fused_projections", "reselect_every", "disk_stage_near", "disk_stage_left_out"}  # fmt: skip
        other = set(changes) - options
        if other:
            raise ValueError(
                f"set_options() changes {', '.join(sorted(options))} only; "
                f"{sorted(other)} fix the cache's layout: build a new OffloadCache for them."
            )
        config = self.config.replace(**changes)
        _check_reselect(config, self.selector)
        self.config = config
        model = self._model_ref()
        if config.fused_projections is not False and model is not None and installed_patches(model) is not None:
            install_patches(model, config)  # projection groups not built when the cache was
        for layer in self.offload_layers:
            layer.set_config(config)

    def drop_graphs(self) -> None:
        """Drop every captured decode graph; each layer captures again at its next decode step (e.g. after a
        function its decode step calls was replaced)."""
        for layer in self.offload_layers:
            layer.graphs.clear()

    @property
    def offload_layers(self) -> list[OffloadLayer]:
        """The offloaded (full-attention) layers."""
        return [layer for layer in self.layers if isinstance(layer, OffloadLayer)]

    def generate_kwargs(self) -> dict:
        """``{name: self}`` for ``model.generate(**inputs, **cache.generate_kwargs())``: ``name`` is
        :func:`generate_cache_kwarg`'s, so no deprecation warning on any supported transformers."""
        return {generate_cache_kwarg(): self}

    def forward_kwargs(self) -> dict:
        """``{name: self}`` for a forward call of the cache's model, ``model(input_ids, **cache.forward_kwargs())``
        (a prefill outside ``generate()``, e.g. of a prefix to fork): ``cache`` where the model's ``forward`` takes
        that name (transformers 5.24 renamed ``past_key_values`` there and warns about the old name), else
        ``past_key_values``."""
        model = self._model_ref()
        if model is None:
            raise RuntimeError("The model this OffloadCache was built for has been freed; forward_kwargs() reads its "
                               "forward's signature.")  # fmt: skip
        return {forward_cache_kwarg(model): self}

    def stats(self) -> dict:
        """Bytes per tier, recall counters and hit rates (overall and per offloaded layer).

        Returns:
            A dict with ``device_kv_bytes`` (slot pools, open blocks and dense sliding layers),
            ``device_summary_bytes``, ``host_kv_bytes`` (sealed blocks; a host pool shared with forks,
            :meth:`fork`, counts whole: the blocks of this cache and of every cache sharing it),
            ``host_shared_bytes`` (the part of the blocks this cache refers to that other caches refer to as well),
            ``host_reserved_bytes``,
            ``recalled_blocks``, ``recalled_bytes`` (prefill and decode), ``decode_recalled_blocks``,
            ``decode_recalled_bytes`` (decode steps only, prefetches included), ``decode_host_bytes`` (the part of
            ``decode_recalled_bytes`` read from host memory; the rest were blocks that ``admission="auto"`` keeps
            on the device), ``prefetched_blocks``,
            ``prefetched_bytes`` (speculative recalls of lookahead), ``prefetch_used_blocks`` (prefetched blocks
            that the exact plan right after attended), ``offloaded_bytes``, ``graph_captures`` and
            ``graph_replays`` (layer decode steps captured into / replayed from CUDA graphs), ``graph_capture_ms``
            (host wall time of the layer decode steps that captured: the capture, and an op-by-op run first where the
            geometry's kind had not run op by op yet; a graph is captured at the first decode step of each block
            capacity, ``decode_capacity_blocks``, so this is what graphs cost), ``graph_capture_retries`` (captures without an op-by-op run first
            that failed and were redone after one; expected 0), ``layer_graph_captures`` and ``layer_graph_replays``
            (those of them that captured / replayed the whole decoder layer, ``graph_scope="layer"``),
            ``graph_pool_bytes`` (device memory the cache's graph captures reserved, while its graphs live; not
            counted under ``device_memory_gib``), ``seal_graph_captures`` and ``seal_graph_replays``
            (seals of a full block after a replayed step captured into / replayed from a CUDA graph),
            ``question_graph_captures`` and ``question_graph_replays`` (a fork's later prefill chunks of up to 512
            tokens, questions over its prefix, captured into / replayed from a CUDA graph of their decoder layer),
            ``timing``
            (with ``timing=True``: mean ms per decode step of select, prefetch, recall, attention, rest and the whole step; else ``None``),
            ``hit_rate`` (share of selected blocks already resident during decode, prefetched ones included;
            with the paged decode attention, blocks of admitted chunks are read in place and count as resident;
            ``None`` before the first decode step), ``tail_share`` (with a selector that estimates the unselected
            blocks, ``quantkey[tail_bits=b]``: the estimated share of attention outside the selection, mean over
            decode steps, sequences and query heads; else ``None``), ``missed_mass`` (the accuracy certificate: the
            estimated share of attention decode steps left out, ``mean``, ``max``, ``last``, ``steps`` and its
            ``source``, ``"tail"``, ``"scores"`` or ``"exact"``: an estimate, not a bound, see docs/tuning.md;
            ``None`` before a step with one, or for a selector without one), ``attended_blocks`` (sealed blocks a
            decode step attended per sequence, mean), ``reused_selections`` (layer decode steps that
            attended the previous step's selection, ``reselect_every``), ``decode_steps`` and ``layers`` (the same
            counters per
            offloaded layer, keyed by layer index), ``fusions`` (``norm_modules`` and ``rotary_modules``: the
            model's RMS norm and attention modules that run one kernel where ``fused_norms`` / ``fused_rotary`` are
            on, see :mod:`hf_offload.patches.norms` and :mod:`hf_offload.patches.rotary`; ``projection_groups``: the groups of
            sibling projections computed as one product where ``fused_projections`` is on,
            :mod:`hf_offload.patches.projections`; ``norms``, ``rotary`` and ``projections``: whether the offloaded layers'
            calls run them, ``None`` before the first call), ``selector`` (the selector as it stands, by name with
            settings) and ``summary_levels`` (each re-encoding of the summaries at a coarser level since the cache
            was built or reset, ``coarsen_summaries``: ``from``, ``to``, ``tokens`` per sequence then,
            ``summary_bytes_before`` and ``summary_bytes_after``), and the disk tier's (``disk_dir``; zeros and
            ``None`` without one): ``disk_kv_bytes`` (blocks on disk), ``disk_spilled_chunks`` and
            ``disk_spilled_bytes``, ``disk_reads``, ``disk_read_bytes`` and ``disk_read_blocks`` (reads from the
            spill file), ``disk_staging_hits`` (blocks a read found staged), ``disk_staged_ahead_blocks`` (blocks read
            ahead of need: lookahead's forecast, ``disk_stage_near``), ``disk_staged_used_blocks`` (those of them a
            read then found staged), ``disk_staging_bytes`` and ``disk_direct_io``. Blocks are counted per KV head
            for per-head selectors. ``parking``: what the cache's first forward found parked on the model by a
            collected cache (:mod:`~hf_offload.cache.parking`): ``"took a parked state"`` (its graphs replay here),
            ``"freed a parked state: <why>"`` (other settings, batch or model state), or ``None`` (none parked).
        """
        timing = self._shared.phase_timer.summary() if self._shared.phase_timer is not None else None
        result = summarize(self.layers, timing, self._fusions(), self.disk)
        result["selector"] = _spec_or_repr(self.selector)
        result["summary_levels"] = [dict(entry) for entry in self._shared.coarsenings]
        result["graph_pool_bytes"] = sum(self._shared.graph_pool_bytes(device) for device in self._shared.graph_pools)
        result["parking"] = self._parking
        return result

    def _fusions(self) -> dict:
        """``stats()["fusions"]``: how many of the model's modules have a fused forward, and whether the offloaded
        layers' calls run them."""
        model = self._model_ref()
        modules = list(model.modules()) if model is not None else []
        on = next((f for layer in self.offload_layers if (f := layer.execution.fusions) is not None), None)
        return {
            "norm_modules": sum(isinstance(m.__dict__.get("forward"), FusedNorm) for m in modules),
            "rotary_modules": sum(isinstance(m.__dict__.get("forward"), RotaryForward) for m in modules),
            "projection_groups": len(fused_groups(model)) if model is not None else 0,
            "norms": None if on is None else on[0],
            "rotary": None if on is None else on[1],
            "projections": None if on is None else on[2],
        }

    @normal_tensors
    def reserve(self, tokens: int) -> None:
        """Allocate every offloaded layer's block summaries for ``tokens`` tokens per sequence up front (see
        :meth:`OffloadLayer.reserve`): useful before a chunked prefill of a known length, near the device's limit.

        >>> cache.reserve(prompt_tokens + max_new_tokens)  # doctest: +SKIP
        """
        for layer in self.offload_layers:
            layer.reserve(tokens)

    def reset_stats(self) -> None:
        """Zero the counters and the phase timing of :meth:`stats` (the cached tokens stay)."""
        for layer in self.offload_layers:
            layer.stats.reset()
        if self.disk is not None:
            self.disk.reset_counters()
        if self._shared.phase_timer is not None:
            self._shared.phase_timer.reset()

    def dense_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole KV of one offloaded layer re-assembled from all tiers; see :meth:`OffloadLayer.dense_kv`."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, OffloadLayer):
            raise ValueError(f"Layer {layer_idx} is a sliding-window layer; its KV is layers[{layer_idx}].keys.")
        return layer.dense_kv()


def _synced_rows(devices: set[torch.device], rows: torch.Tensor) -> dict[torch.device, torch.Tensor]:
    """``rows`` copied to each of ``devices`` after one synchronisation of each CUDA one: what a fork does once per
    device instead of once per layer."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return {device: rows.to(device) for device in devices}


def _sliding_rows(layer: DynamicSlidingWindowLayer, rows: torch.Tensor) -> DynamicSlidingWindowLayer:
    """A new dense sliding-window layer holding the sequences ``rows`` (``[batch]``, ``torch.int64``, CPU) of
    ``layer``."""
    fork = DynamicSlidingWindowLayer(sliding_window=layer.sliding_window)
    if layer.is_initialized:
        dev = rows.to(layer.keys.device)
        keys, values = layer.keys[dev], layer.values[dev]
        fork.lazy_initialization(keys, values)
        fork.keys, fork.values = keys, values
        fork.cumulative_length = int(layer.cumulative_length)
    return fork


def _disk_tier(config: OffloadConfig, model) -> DiskTier | None:
    """The disk tier of a new cache (``config.disk_dir``; its files are made at the first spill), or ``None``."""
    if config.disk_dir is None:
        return None
    if not os.path.isdir(config.disk_dir):
        raise ValueError(f"disk_dir={config.disk_dir!r} is not an existing directory; create it or name another one.")
    if not os.access(config.disk_dir, os.W_OK | os.X_OK):
        raise ValueError(f"disk_dir={config.disk_dir!r} is not writable by this process; name another directory.")
    param = next(model.parameters(), None)
    pin = config.pin_memory
    if pin is None:
        pin = param is not None and param.device.type == "cuda"
    limit = None if config.disk_memory_gib is None else int(config.disk_memory_gib * (1 << 30))
    return DiskTier(config.disk_dir, limit, config.disk_staging_chunks, config.disk_read_threads, bool(pin),
                    int(config.host_chunk_mib * (1 << 20)))  # fmt: skip


def _spec_or_repr(selector: Selector) -> str:
    """The selector by registered name with settings, else its repr (an unregistered instance)."""
    from .persist import selector_spec

    try:
        return selector_spec(selector)
    except ValueError:
        return repr(selector)


def _check_reselect(config: OffloadConfig, selector: Selector) -> None:
    """Raise ``ValueError`` where ``config.reselect_every`` above 1 meets a selector whose estimate of the unselected
    blocks needs every step's scores."""
    if config.reselect_every > 1 and selector.estimates_tail:
        raise ValueError(
            f"reselect_every={config.reselect_every} reuses a selection without scoring, but selector "
            f"{selector.name!r} estimates the attention outside its selection from every step's scores "
            "(tail_bits). Use reselect_every=1 with it, or a selector without the estimate (e.g. 'quantkey')."
        )


def _check_adaptive(config: OffloadConfig, selector: Selector) -> None:
    """Raise ``ValueError`` where the adaptive budget (``missed_mass_target``) meets a selector whose scores are not
    block masses, from which it reads what a selection leaves out."""
    if config.adaptive and (not selector.mass_scores or selector.per_head):
        raise ValueError(
            f"missed_mass_target={config.missed_mass_target} widens a selection by the attention it leaves out, read "
            f"from the selector's block masses, which selector {selector.name!r} does not give "
            "(Selector.mass_scores is False, or it selects per KV head). Use a selector that does (quantkey, the "
            "default, solohead, meanbound, meanvar, union, oracle), or leave missed_mass_target and "
            "max_budget_tokens None."
        )


def _check_model(model) -> object:
    """Return the decoder text config of ``model`` or raise a clear error if the cache cannot serve it."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "_orig_mod", None), PreTrainedModel):
        raise TypeError(
            "OffloadCache(model, ...) takes the transformers model itself, not the module torch.compile returned: "
            "build the cache with the model (compiled._orig_mod), e.g. OffloadCache(compiled._orig_mod, ...). "
            "OffloadCache's decode step runs eagerly; torch.compile of a model used with other caches is unaffected."
        )
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"OffloadCache(model, ...) takes the transformers model itself (it switches the model's attention), "
            f"got {type(model).__name__}."
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"{model.__class__.__name__} is an encoder-decoder model; OffloadCache serves decoder-only models."
        )
    if not model.can_generate():
        raise ValueError(
            f"{model.__class__.__name__} is not a generative decoder model with a KV cache (it cannot generate); "
            "load it with AutoModelForCausalLM."
        )
    sharded = _sharded_parameter(model)
    if sharded is not None:
        raise ValueError(
            f"{model.__class__.__name__} is sharded by tensor parallelism (parameter {sharded!r} is a DTensor, as "
            "from_pretrained(tp_plan='auto') under torchrun makes it): each rank would hold a slice of the heads, "
            "which OffloadCache does not split. Load the model with device_map='auto' instead (its layers spread "
            "over the GPUs, each layer's cache on that layer's device), or with one process per GPU."
        )
    return model.config.get_text_config(decoder=True)


def _sharded_parameter(model) -> str | None:
    """The name of a parameter of ``model`` that is a DTensor (tensor parallelism), or ``None``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    for name, parameter in model.named_parameters():
        if isinstance(parameter, DTensor) or isinstance(getattr(parameter, "data", None), DTensor):
            return name
    return None
