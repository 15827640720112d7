"""Graph capture paid once per model and shapes: the offloaded layers of a cache nobody holds any more wait, with
their buffers and captured CUDA graphs, for the next cache of the same model and settings.

A decode step's graphs read the cache's buffers at fixed addresses (slot pool, summaries, block and chunk tables,
the step's shared inputs), so a new cache cannot replay the graphs of another one: it captures its own, which costs
its first decode steps about as much as the rest of a short ``generate()``. Instead, when a cache with captured
graphs is garbage collected (``model.generate(..., past_key_values=OffloadCache(model, ...))`` lets go of it when
the call returns), its offloaded layers, the per-device resources they share and its host memory budget are
*parked* on the model (one state per model; :func:`park`). The next cache of that model whose settings are equal
takes them at its first forward (:func:`take`): every buffer is emptied in place (``OffloadLayer.recycle``), so the
graphs captured for them replay in the new cache wherever its steps have the same geometry (batch, blocks scored and
selected, where the blocks lie), and its first decode step replays instead of capturing.

What parks: a cache with graphs (CUDA, ``cuda_graphs`` not ``False``) whose every offloaded layer holds tokens, with
no disk tier, no block shared with another cache (``fork``), summaries at the level it was built with, not broken
and not closed. ``close()`` frees every tier at once and parks nothing. Parking frees the KV itself (host and
admitted chunks; the next cache grows them again through the same chunk tables); a parked state holds the device
slot pools, summaries, block and chunk tables and graph pools until it is taken, replaced by a newer one, or
released: by :func:`release_parked` (also through ``hf_offload.cache.release_graph_pools``), by a
forward of the model with any other cache (a ``DynamicCache`` run gets the memory back), by a cache of other settings
(before it allocates anything), by removing the model's patches, or with the model. A taken state whose batch, head
shapes or dtype do not match the new forward's is freed layer by layer before that layer allocates.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from dataclasses import dataclass, field

import torch

# Re-entrant: a cache collected while this thread holds it (inside release_parked, say) parks through it too.
_LOCK = threading.RLock()


def model_fingerprint(model: torch.nn.Module) -> tuple:
    """What the captured whole-layer graphs depend on of the model besides their arguments: every parameter's and
    buffer's address, shape, dtype and device (weights loaded anew, moved, cast or re-laid change it), and what
    decides which Python runs inside the layers while a graph is captured: each module's training flag, its forward
    (an instance override: the library's own patches, or another library's) and its hooks, the global module hooks,
    and autocast. Python state a module reads in its own forward (an adapter switched by an attribute) is not seen:
    call :func:`release_parked` after changing it."""
    from torch.nn.modules import module as module_hooks

    tensors = tuple(
        (t.data_ptr(), tuple(t.shape), t.dtype, t.device)
        for t in itertools.chain(model.parameters(), model.buffers())
    )
    modules = tuple(
        (m.training, id(m.__dict__.get("forward")),
         *(tuple((k, id(f)) for k, f in getattr(m, name).items()) for name in _HOOK_DICTS))
        for m in model.modules()
    )  # fmt: skip
    global_hooks = tuple(
        tuple((k, id(f)) for k, f in getattr(module_hooks, name, {}).items()) for name in _GLOBAL_HOOKS
    )
    autocast = tuple(torch.is_autocast_enabled(kind) for kind in ("cuda", "cpu"))
    return tensors, modules, global_hooks, autocast


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")


@dataclass
class ParkSlot:
    """What a cache's finalizer parks: the cache keeps it current (its offloaded layers, shared resources and host
    budget) and marks it closed or broken; it holds no reference to the cache."""

    layers: list = field(default_factory=list)
    shared: object = None
    budget: object = None
    patches: object = None
    model_ref: object = None
    closed: bool = False
    broken: str | None = None
    disk: bool = False


@dataclass
class ParkedState:
    """The parts of a collected cache waiting on its model for the next cache (:func:`take`)."""

    layers: list
    shared: object
    budget: object
    config: object
    fingerprint: tuple

    def release(self) -> None:
        """Free every tier and graph now (side-stream work finished first)."""
        for layer in self.layers:
            layer.reset()

    def device_bytes(self) -> int:
        """Device bytes the parked layers' own buffers hold (slot pools, summaries, the device block table, admitted
        chunks); the graphs' memory pool, the step's shared and static inputs and the small per-layer buffers come on
        top (``stats()["graph_pool_bytes"]`` of the cache that parked them)."""
        stores = [layer.blocks for layer in self.layers if layer.blocks.is_initialized]
        return sum(s.device_buffer_bytes() + s.host.admitted_chunks * s.host.chunk_nbytes for s in stores)


def parkable(slot: ParkSlot) -> bool:
    """Whether the cache behind ``slot`` may park (see the module docstring); reads host state only."""
    if slot.closed or slot.broken is not None or slot.disk or slot.patches is None or not slot.layers:
        return False
    if not slot.patches.active or slot.model_ref() is None or slot.shared.coarsenings:
        return False
    for layer in slot.layers:
        store = layer.blocks
        if not store.is_initialized or store.host.holders != 1 or store.host.disk is not None:
            return False
        if not layer.execution.graphs:
            return False
    return any(layer.graphs.graphs for layer in slot.layers)


def park(slot: ParkSlot) -> None:
    """The finalizer of a cache: park its parts on its model where :func:`parkable` (replacing, and freeing, an
    earlier parked state of that model). Host work only, except for freeing a replaced state outside a capture:
    collection may run anywhere."""
    if not parkable(slot):
        return
    model = slot.model_ref()
    state = ParkedState(list(slot.layers), slot.shared, slot.budget, slot.shared.config, model_fingerprint(model))
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        # The KV goes now (the chunk tables stay): a parked state holds slot pools, summaries and tables, not blocks.
        for device in {layer.blocks.device for layer in slot.layers if layer.execution.streams is not None}:
            torch.cuda.synchronize(device)
        for layer in slot.layers:
            layer.blocks.drop_chunks()
    with _LOCK:
        old, slot.patches.parked = slot.patches.parked, state
    if old is not None:
        _release(old)


def _release(state: ParkedState) -> None:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return  # freed by reference counting once the capture is over (no synchronisation inside a capture)
    state.release()


def take(patches, config, model: torch.nn.Module) -> tuple[ParkedState | None, str | None]:
    """``(state, None)``: the state parked on ``model`` (``patches``: its :class:`~hf_offload.patches.ModelPatches`),
    which a cache of ``config`` can use; else ``(None, why)``, a parked state that does not fit freed here (before
    the caller allocates), or ``(None, None)`` where none was parked."""
    with _LOCK:
        state, patches.parked = patches.parked, None
    if state is None:
        return None, None
    why = None
    if state.config != config:
        changed = sorted(f.name for f in dataclasses.fields(config)
                         if getattr(config, f.name) != getattr(state.config, f.name))  # fmt: skip
        why = f"other settings ({', '.join(changed)})"
    elif state.fingerprint != model_fingerprint(model):
        why = "the model changed (weights, hooks, training flag, forward overrides or autocast)"
    if why is not None:
        state.release()
        return None, why
    return state, None


def release_parked(model: torch.nn.Module | None = None) -> int:
    """Free the layers, buffers and graphs parked for the next cache of ``model`` (every patched model's where
    ``None``); returns how many states were freed. Their graph memory pool goes to the process's idle pools:
    :func:`~hf_offload.cache.shared.release_graph_pools` (which calls this first) and then
    ``torch.cuda.empty_cache()`` give every byte back to the device."""
    from ..patches import _INSTALLED, installed

    with _LOCK:
        if model is None:
            records = list(_INSTALLED.values())
        else:
            record = installed(model)
            records = [] if record is None else [record]
        states = []
        for record in records:
            if record.parked is not None:
                states.append(record.parked)
                record.parked = None
    for state in states:
        state.release()
    from ..store.transfer import forget_sequence_order

    forget_sequence_order()  # the kept recall indices of later prefill chunks (a few MiB at most)
    return len(states)


def parked_bytes(model: torch.nn.Module | None = None) -> int:
    """Device bytes held by parked states' buffers (``model``'s, or every patched model's;
    :meth:`ParkedState.device_bytes`)."""
    from ..patches import _INSTALLED, installed

    records = list(_INSTALLED.values()) if model is None else [r for r in [installed(model)] if r is not None]
    return sum(r.parked.device_bytes() for r in records if r.parked is not None)
