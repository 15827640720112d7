"""Typed, validated settings of an :class:`~hf_offload.cache.OffloadCache`, grouped by what they change.

* :class:`Attended`: which KV tokens a decode query attends to. These settings change the outputs.
* :class:`Memory`: where blocks live and how much memory they may take.
* :class:`Execution`: how a step runs: transfer path, attention kernel, CUDA graphs, lookahead, fused kernels,
  timing.

Memory and execution settings change memory and speed, never which tokens are attended: outputs agree up to float
rounding (the fields that round differently say so).

:class:`OffloadConfig` holds all three and takes and reads them flat as well:

>>> config = OffloadConfig(budget_tokens=4096, lookahead=True)
>>> config == OffloadConfig(attended=Attended(budget_tokens=4096), execution=Execution(lookahead=True))
True
>>> config.budget_tokens == config.attended.budget_tokens == 4096
True

``docs/tuning.md`` says what each setting costs and how to choose it.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import numbers
import os
from dataclasses import dataclass

DEFAULT_SELECTOR = "quantkey[bits=4,tail_bits=2,tail_near=16]"
"""The default selector: every key on the device at 4 bits ranks the blocks, and the attention the selection leaves
out is estimated from 2-bit values (token by token for the ``16k`` best unselected blocks, by block log-sum-exps for
the rest) and joins the softmax; see :mod:`hf_offload.selectors.quantkey`."""


@dataclass(frozen=True)
class Attended:
    """What a decode query attends to: these settings change the outputs. Token counts are per sequence and layer.

    Attributes:
        budget_tokens: KV tokens one decode query attends to, sink, window and open block included; at least
            ``sink_tokens + window_tokens + block_tokens``, and at or above the context exactly dense. Default 2048.
        block_tokens: tokens per block, the unit of selection, storage and transfer; a power of two. Default 16.
        sink_tokens: first (non-padding) tokens of each sequence, always attended; a multiple of ``block_tokens``.
            ``None`` (default): ``budget_tokens // 32`` clamped to ``[block_tokens, 64]``.
        window_tokens: most recent sealed tokens, always attended (as is the open block); a multiple of
            ``block_tokens``. ``None`` (default): ``budget_tokens // 8`` clamped to ``[block_tokens, 256]``.
        selector: what fills the rest of the budget with blocks: a registered selector's name, with settings if any
            (``"quantkey[bits=4]"``), or a :class:`~hf_offload.selectors.Selector`. Default :data:`DEFAULT_SELECTOR`.
        reselect_every: decode steps per choice of blocks (a step after a seal always chooses); the steps between
            reuse it. A positive integer; above 1 needs a selector without a tail estimate. Default 1.
        transfer_cap_blocks: most blocks one decode step recalls per sequence, KV head and layer, resident blocks
            within ``transfer_cap_margin`` attended instead; ``>= 0``, or ``None`` (default): no cap.
        transfer_cap_margin: relative score margin of the transfer cap; ``>= 0``. Default 0.1.
        disk_cap_blocks: most selected blocks per sequence, KV head, layer and decode step read from disk on demand;
            the others give way to blocks in memory or staged, or to the estimate (``disk_stage_left_out``: staged).
            ``>= 0``, needs ``disk_dir``; ``None`` (default): no bound.
        max_budget_tokens: the adaptive budget's cap: with ``missed_mass_target``, a decode step attends up to this
            many tokens (sink, window and open block included); whole blocks above ``budget_tokens``. Default
            ``None``: every step attends ``budget_tokens``.
        missed_mass_target: a step whose selection leaves out more than this share of the estimated attention takes
            more blocks, best first, up to ``max_budget_tokens`` (docs/tuning.md, "Adaptive budget"); in ``(0, 1)``,
            for selectors with ``mass_scores``. Default ``None``: a fixed budget.
    """

    budget_tokens: int = 2048
    block_tokens: int = 16
    sink_tokens: int | None = None
    window_tokens: int | None = None
    selector: object = DEFAULT_SELECTOR
    reselect_every: int = 1
    transfer_cap_blocks: int | None = None
    transfer_cap_margin: float = 0.1
    disk_cap_blocks: int | None = None
    max_budget_tokens: int | None = None
    missed_mass_target: float | None = None


@dataclass(frozen=True)
class Memory:
    """Where blocks live and how much memory they may take; never which tokens are attended.

    Attributes:
        pool_tokens: device slot pool capacity per sequence and layer, whole blocks (a larger selection is attended
            in rounds). ``None`` (default): ``1.25 x budget_tokens`` (``max_budget_tokens`` where set) rounded up to
            whole blocks; for ``"streaming"`` sink + window + 2 blocks.
        prefill_chunk_tokens: queries per attention tile in prefill, which bounds its score matrix to ``batch x heads
            x prefill_chunk_tokens**2`` floats; positive. Default 1024.
        host_chunk_mib: MiB per host pool allocation (the pool grows by whole chunks); positive. Default 16.
        host_memory_gib: GiB the host pools of the whole cache may take; positive, or ``None`` (default): no bound
            beyond the machine's available memory.
        pin_memory: page-lock the host pool (asynchronous copies and the copy kernels need it). ``None`` (default):
            pin when the model runs on CUDA.
        admission: ``"auto"`` (default): sealed blocks stay on the device while the cache's bound and the process's
            room for temporaries allow, and go back to the host when that room is needed; ``"always"``: every
            block to the host. The same output either way (docs/tuning.md).
        device_memory_gib: GiB of device memory the cache's buffers may take (admitted blocks, summaries, slot
            pools, block tables; not its graph pools), ``>= 0``; too small for the coarsest summaries: ``MemoryError``.
            ``None`` (default): what the process may allocate (its memory fraction included) less temporaries.
        coarsen_summaries: summaries that would outgrow that room are re-encoded at the selector's next coarser
            level (``Selector.coarser``; docs/tuning.md) with a warning, after every admitted block went back to the
            host. ``True`` (default); ``False``: ``MemoryError`` instead (under ``device_memory_gib``).
        disk_dir: a directory for the disk tier: past ``host_memory_gib`` (which it needs), the least recently used
            host chunks spill to a file in a private directory made inside it (``hf_offload.store.disk``). ``None``
            (default): no disk tier; past the cap, ``MemoryError``.
        disk_memory_gib: GiB the spilled chunks may take on disk, positive; ``None`` (default): what the file system
            holds.
        disk_staging_chunks: chunk-sized host buffers that blocks read from disk are staged in (least recently used
            block evicted first); positive. Default 8.
        disk_read_threads: worker threads reading from disk; positive. Default 16.
        disk_stage_near: blocks per sequence (and KV head) ranked just below each decode step's selection whose
            reads from disk into staging start after the step's recall, without waiting (the likeliest next
            selections); ``>= 0``. Default 0: none.
        disk_stage_left_out: of the blocks ``disk_cap_blocks`` leaves out of a decode step, the best-scored this
            many per sequence (and KV head) are staged from disk for the next steps to attend; ``>= 0``. Default 0.
    """

    pool_tokens: int | None = None
    prefill_chunk_tokens: int = 1024
    host_chunk_mib: float = 16
    host_memory_gib: float | None = None
    pin_memory: bool | None = None
    admission: str = "auto"
    device_memory_gib: float | None = None
    coarsen_summaries: bool = True
    disk_dir: str | None = None
    disk_memory_gib: float | None = None
    disk_staging_chunks: int = 8
    disk_read_threads: int = 16
    disk_stage_near: int = 0
    disk_stage_left_out: int = 0


@dataclass(frozen=True)
class Execution:
    """How a step runs; never which tokens are attended. A switch of three values is on where it can run with
    ``None``, on with ``True`` (an error where it cannot run, unless said otherwise) and off with ``False``.

    Attributes:
        transfer: how blocks move between host and device: ``"kernel"`` (Triton reads and writes pinned memory
            directly; CUDA), ``"torch"`` (a host gather, one copy); ``"auto"`` (default): ``"kernel"`` where it runs.
        decode_attention: ``"paged"``: one Triton kernel reads each selected block where it lies (needs the kernel
            transfer path); ``"pool"``: the slot pool holds every selected block, one SDPA reads it. ``"auto"``
            (default): ``"paged"`` on CUDA with the kernel transfer path, else ``"pool"``.
        cuda_graphs: replay each offloaded layer's decode step from a CUDA graph (CUDA, kernel transfer path; not
            prefill nor ``timing``; lookahead turns graphs off under ``graph_scope="attention"``; with ``disk_dir``
            each layer step is graphs split where the host reads from disk). Default ``None``.
        graph_scope: what a replayed graph covers: ``"layer"`` (default): the whole decoder layer (a layer that
            cannot be captured warns once and keeps ``"attention"``); ``"attention"``: the offloaded attention.
        decode_capacity_blocks: a decode step scores the sealed blocks rounded up to a multiple of this (its shapes
            and graph last that many seals); above 1 only for a selector with ``masks_invalid``. Default ``None``: for
            such a selector 64, or a sixteenth of the sealed blocks (a power of two) where more; else 1.
        lookahead: prefetch the next offloaded layer's likely blocks on a side stream (its own plan still decides
            what it attends). ``False`` (default); ``None``: on where blocks move through the copy kernels on CUDA;
            ``True``: on everywhere, without CUDA synchronously.
        lookahead_query: what the lookahead plan scores with: ``"next"`` (default): the next layer's query predicted
            from this layer's input (Llama-form layers, next offloaded layer adjacent; else ``"same"``); ``"same"``:
            this layer's query.
        lookahead_blocks: most blocks per sequence (and KV head, for per-head selectors) a lookahead plan selects
            besides sink and window; ``>= 0``, or ``None`` (default): as many as the budget.
        fused_norms: the decoder layers' RMS norms as one Triton launch each (:mod:`hf_offload.patches.norms`); an element
            can move by one unit in the last place. Default ``None``; ``True`` runs Triton's CPU interpreter too.
        fused_rotary: the rotary embedding of queries and keys as one Triton launch, bit for bit
            (:mod:`hf_offload.patches.rotary`; modules calling Llama's ``apply_rotary_pos_emb``). As ``fused_norms``.
        fused_projections: each layer's sibling projections (q, k, v; gate, up) as one matrix product, no added
            memory (:mod:`hf_offload.patches.projections`); last bits can differ. Default ``None`` (on CUDA); ``True``: on
            any device.
        timing: record per-phase milliseconds of decode steps into ``cache.stats()["timing"]``. Default ``False``.
    """

    transfer: str = "auto"
    decode_attention: str = "auto"
    cuda_graphs: bool | None = None
    graph_scope: str = "layer"
    decode_capacity_blocks: int | None = None
    lookahead: bool | None = False
    lookahead_query: str = "next"
    lookahead_blocks: int | None = None
    fused_norms: bool | None = None
    fused_rotary: bool | None = None
    fused_projections: bool | None = None
    timing: bool = False


GROUPS: dict[str, type] = {"attended": Attended, "memory": Memory, "execution": Execution}
"""The settings groups of :class:`OffloadConfig`: keyword argument and attribute name -> class."""

_GROUP_OF = {f.name: group for group, cls in GROUPS.items() for f in dataclasses.fields(cls)}
# Sizes that None derives from the others; replace() derives them again from its new values.
_DERIVED = ("sink_tokens", "window_tokens", "pool_tokens")
_UNSET = object()


def _round_to_block(tokens: int, block_tokens: int) -> int:
    return max(block_tokens, (tokens // block_tokens) * block_tokens)


def _values(group) -> dict:
    """A settings group's fields as a flat dict (no copies: a selector instance stays the same object)."""
    return {f.name: getattr(group, f.name) for f in dataclasses.fields(group)}


def _checked_group(name: str, group):
    cls = GROUPS[name]
    if not isinstance(group, cls):
        raise TypeError(
            f"{name}= takes a {cls.__name__} (hf_offload.config.{cls.__name__}), got {type(group).__name__}; single "
            f"settings go in as flat keywords, e.g. OffloadConfig({dataclasses.fields(cls)[0].name}=...)."
        )
    return group


def _unknown_settings(names) -> TypeError:
    """The error for keyword arguments that name no setting: a ``TypeError``, as Python's own, with the closest
    names, or every name where none is close."""
    known = [*_GROUP_OF, *GROUPS]
    hints, unmatched = [], False
    for name in sorted(names):
        close = difflib.get_close_matches(name, known, n=3)
        unmatched |= not close
        hints.append(f"{name!r} (did you mean {_either(close)}?)" if close else repr(name))
    what = "an unexpected keyword argument" if len(hints) == 1 else "unexpected keyword arguments"
    message = f"OffloadConfig.__init__() got {what} {', '.join(hints)}."
    if unmatched:
        names = (f"{group}: {', '.join(f.name for f in dataclasses.fields(cls))}" for group, cls in GROUPS.items())
        message += f" The settings are, by group, {'; '.join(names)}."
    return TypeError(message)


def _either(names: list[str]) -> str:
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"


def _flat_fields(cls):
    """Give ``cls`` every field of the settings groups as a dataclass field of its own (same type and default), so
    that flat keywords, flat attributes, class-level defaults and :func:`dataclasses.fields` see every setting by
    name."""
    cls.__annotations__ = {f.name: f.type for group in GROUPS.values() for f in dataclasses.fields(group)}
    for group in GROUPS.values():
        for f in dataclasses.fields(group):
            setattr(cls, f.name, f.default)
    return cls


@dataclass(frozen=True, init=False, repr=False)
@_flat_fields
class OffloadConfig:
    """Settings of an offloaded KV cache: what is attended (:class:`Attended`), memory (:class:`Memory`) and
    execution (:class:`Execution`). Sizes carry their unit in the name; token counts are per sequence and layer.

    Built from groups, from flat keyword arguments (any field of any group), or both; flat keywords apply over the
    groups. ``budget_tokens`` may come first without its name. Every setting reads flat (``config.pool_tokens``) or
    through its group (``config.memory.pool_tokens``). Sizes left at ``None`` are derived on construction, and the
    whole config is validated once, then immutable: :meth:`replace` makes a changed copy. It is plain data: equal
    when the settings are, hashable when its selector is (a name always is), and it copies and pickles.

    >>> config = OffloadConfig(budget_tokens=2048, lookahead=True)
    >>> config == OffloadConfig(attended=Attended(budget_tokens=2048), execution=Execution(lookahead=True))
    True
    >>> config.window_tokens, config.attended.window_tokens, config.replace(budget_tokens=512).window_tokens
    (256, 256, 64)

    Raises:
        TypeError: for a keyword that names no setting (with the closest names), or a group of the wrong class.
        ValueError: for an invalid value, saying what to change (see :meth:`validate`).
    """

    def __init__(self, budget_tokens=_UNSET, *, attended: Attended | None = None, memory: Memory | None = None,
                 execution: Execution | None = None, **settings):  # fmt: skip
        if budget_tokens is not _UNSET:
            settings["budget_tokens"] = budget_tokens
        unknown = settings.keys() - _GROUP_OF.keys()
        if unknown:
            raise _unknown_settings(unknown)
        values = {}
        for name, group in (("attended", attended), ("memory", memory), ("execution", execution)):
            values.update(_values(GROUPS[name]() if group is None else _checked_group(name, group)))
        values.update(settings)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_derived", tuple(name for name in _DERIVED if values[name] is None))
        self.validate()

    @property
    def attended(self) -> Attended:
        """The settings that decide what a decode query attends to (derived sizes filled in)."""
        return Attended(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Attended)})

    @property
    def memory(self) -> Memory:
        """The settings of where blocks live (derived sizes filled in)."""
        return Memory(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Memory)})

    @property
    def execution(self) -> Execution:
        """The settings of how a step runs."""
        return Execution(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Execution)})

    def __repr__(self) -> str:
        return f"OffloadConfig(attended={self.attended!r}, memory={self.memory!r}, execution={self.execution!r})"

    def validate(self) -> None:
        """Fill the ``None`` defaults and raise ``ValueError`` with what to change if a setting is invalid."""

        def fill(name: str, value) -> None:  # the config is frozen; only validation fills in derived sizes
            object.__setattr__(self, name, value)

        # Any integer type (numpy.int64, ...) is an integer setting; any real number type a number.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                fill(field.name, int(value))
            elif isinstance(value, numbers.Real) and not isinstance(value, (numbers.Integral, float)):
                fill(field.name, float(value))

        if isinstance(self.host_chunk_mib, bool) or not isinstance(self.host_chunk_mib, (int, float)) or not self.host_chunk_mib > 0:
            raise ValueError(f"host_chunk_mib must be a positive number, got {self.host_chunk_mib!r}.")
        for name in ("budget_tokens", "block_tokens", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        block = self.block_tokens
        if block & (block - 1):
            raise ValueError(
                f"block_tokens must be a positive power of two (e.g. 16 or 32), got {block}: blocks are the unit of "
                "selection and transfer, and power-of-two blocks keep host chunks and kernels aligned."
            )
        if self.sink_tokens is None:
            fill("sink_tokens", min(64, _round_to_block(self.budget_tokens // 32, block)))
        if self.window_tokens is None:
            fill("window_tokens", min(256, _round_to_block(self.budget_tokens // 8, block)))
        for name in ("sink_tokens", "window_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % block:
                raise ValueError(
                    f"{name} must be a non-negative multiple of block_tokens={block}, got {value!r}; "
                    f"try {_round_to_block(max(int(value or 0), 0), block)}."
                )
        # The open block (up to block_tokens - 1 tokens) is always attended besides sink and window.
        needed = self.sink_tokens + self.window_tokens + block
        if self.budget_tokens < needed:
            raise ValueError(
                f"budget_tokens={self.budget_tokens} is smaller than sink_tokens + window_tokens + block_tokens = "
                f"{self.sink_tokens} + {self.window_tokens} + {block} = {needed}. Raise budget_tokens to at least "
                f"{needed}, or lower sink_tokens / window_tokens."
            )
        self._validate_adaptive()
        if self.pool_tokens is None:
            if self.selector == "streaming":  # reads only the sink and the window (plus the block being sealed)
                fill("pool_tokens", self.sink_tokens + self.window_tokens + 2 * block)
            else:
                attended = self.budget_tokens if self.max_budget_tokens is None else self.max_budget_tokens
                fill("pool_tokens", -(-attended * 5 // 4 // block) * block)
        if isinstance(self.pool_tokens, bool) or not isinstance(self.pool_tokens, int) or self.pool_tokens < block:
            raise ValueError(f"pool_tokens must be an integer >= block_tokens={block}, got {self.pool_tokens!r}.")
        if self.pool_tokens % block:
            raise ValueError(f"pool_tokens must be a multiple of block_tokens={block}, got {self.pool_tokens}.")
        if self.host_memory_gib is not None and not self.host_memory_gib > 0:
            raise ValueError(f"host_memory_gib must be positive or None, got {self.host_memory_gib!r}.")
        if self.disk_dir is not None:
            if not isinstance(self.disk_dir, (str, os.PathLike)):
                raise ValueError(f"disk_dir must be a directory path or None, got {self.disk_dir!r}.")
            fill("disk_dir", os.fspath(self.disk_dir))
            if self.host_memory_gib is None:
                raise ValueError(
                    f"disk_dir={self.disk_dir!r} spills blocks past host_memory_gib, which is None (no cap): set "
                    "host_memory_gib to the GiB of host memory the KV may take (e.g. host_memory_gib=64), or leave "
                    "disk_dir None."
                )
        if self.disk_memory_gib is not None:
            if self.disk_dir is None:
                raise ValueError(f"disk_memory_gib={self.disk_memory_gib!r} bounds the disk tier; set disk_dir too.")
            if isinstance(self.disk_memory_gib, bool) or not self.disk_memory_gib > 0:
                raise ValueError(f"disk_memory_gib must be positive or None, got {self.disk_memory_gib!r}.")
        for name in ("disk_staging_chunks", "disk_read_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        for name in ("disk_stage_near", "disk_stage_left_out"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer (blocks per sequence), got {value!r}.")
        bound = self.disk_cap_blocks
        if bound is not None:
            if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
                raise ValueError(
                    f"disk_cap_blocks must be a non-negative integer (blocks per sequence, KV head and layer read "
                    f"from disk in a decode step) or None, got {bound!r}."
                )
            if self.disk_dir is None:
                raise ValueError(f"disk_cap_blocks={bound!r} bounds the reads from the disk tier; set disk_dir too "
                                 "(with host_memory_gib), or leave it None.")  # fmt: skip
        if self.transfer not in ("auto", "kernel", "torch"):
            raise ValueError(f"transfer must be 'auto', 'kernel' or 'torch', got {self.transfer!r}.")
        cap = self.transfer_cap_blocks
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(f"transfer_cap_blocks must be a non-negative integer or None, got {cap!r}.")
        if not self.transfer_cap_margin >= 0:
            raise ValueError(f"transfer_cap_margin must be >= 0, got {self.transfer_cap_margin!r}.")
        every = self.reselect_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"reselect_every must be a positive integer (1: every decode step chooses its blocks; 2: every "
                f"second step, the others reuse that choice), got {every!r}."
            )
        if self.admission not in ("always", "auto"):
            raise ValueError(f"admission must be 'always' or 'auto', got {self.admission!r}.")
        if self.device_memory_gib is not None and not self.device_memory_gib >= 0:
            raise ValueError(f"device_memory_gib must be >= 0 or None, got {self.device_memory_gib!r}.")
        if not isinstance(self.coarsen_summaries, bool):
            raise ValueError(f"coarsen_summaries must be True or False, got {self.coarsen_summaries!r}.")
        if self.lookahead is not None and not isinstance(self.lookahead, bool):
            raise ValueError(
                f"lookahead must be True, False or None (None: on where blocks move through the copy kernels on "
                f"CUDA), got {self.lookahead!r}."
            )
        if self.lookahead_query not in ("next", "same"):
            raise ValueError(
                f"lookahead_query must be 'next' (the next layer's query predicted from this layer's input) or 'same' "
                f"(this layer's query), got {self.lookahead_query!r}."
            )
        ahead = self.lookahead_blocks
        if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0):
            raise ValueError(
                f"lookahead_blocks must be a non-negative integer (blocks per sequence beyond sink and window) or "
                f"None (as many as the budget selects), got {ahead!r}."
            )
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise ValueError(
                f"cuda_graphs must be True, False or None (None: on where it can run), got {self.cuda_graphs!r}."
            )
        if self.cuda_graphs and self.timing:
            raise ValueError(
                "cuda_graphs=True cannot be combined with timing=True (it runs per-phase host work inside the decode "
                "step); set cuda_graphs=None to use graphs only where timing is off."
            )
        if self.cuda_graphs and self.lookahead and self.graph_scope != "layer":
            raise ValueError(
                "cuda_graphs=True cannot be combined with lookahead=True under graph_scope='attention' (lookahead runs "
                "inside graphs of whole decoder layers only); use graph_scope='layer' or cuda_graphs=None."
            )
        if self.graph_scope not in ("layer", "attention"):
            raise ValueError(
                f"graph_scope must be 'layer' (the whole decoder layer) or 'attention' (the offloaded attention only), "
                f"got {self.graph_scope!r}."
            )
        capacity = self.decode_capacity_blocks
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0):
            raise ValueError(
                f"decode_capacity_blocks must be a positive integer (blocks a decode step's scored blocks are rounded "
                f"up to) or None (64 with CUDA graphs, else 1), got {capacity!r}."
            )
        for name in ("fused_norms", "fused_rotary", "fused_projections"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                where = "on CUDA" if name == "fused_projections" else "where Triton runs on CUDA"
                raise ValueError(f"{name} must be True, False or None (None: on {where}), got {value!r}.")
        if self.decode_attention not in ("auto", "paged", "pool"):
            raise ValueError(f"decode_attention must be 'auto', 'paged' or 'pool', got {self.decode_attention!r}.")
        if not isinstance(self.selector, str) and not hasattr(self.selector, "select"):
            raise TypeError(
                f"selector must be a selector name or a Selector instance, got {type(self.selector).__name__}."
            )

    def _validate_adaptive(self) -> None:
        """Raise ``ValueError`` with what to change if the adaptive budget's settings do not fit together."""
        cap, target = self.max_budget_tokens, self.missed_mass_target
        budget, block = self.budget_tokens, self.block_tokens
        if cap is None and target is None:
            return
        if target is None:
            raise ValueError(
                f"max_budget_tokens={cap!r} caps the adaptive budget, which missed_mass_target turns on: set "
                f"missed_mass_target too (e.g. missed_mass_target=0.05: a step leaving out more than 5% of the "
                f"estimated attention takes more blocks), or leave max_budget_tokens None."
            )
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < 1:
            raise ValueError(
                f"missed_mass_target must be a share strictly between 0 and 1 (e.g. 0.05: at most 5% of the estimated "
                f"attention left out), got {target!r}."
            )
        if cap is None:
            raise ValueError(
                f"missed_mass_target={target} needs max_budget_tokens, the most tokens a step may attend: set it above "
                f"budget_tokens={budget}, e.g. max_budget_tokens={2 * budget - 2 * budget % block}."
            )
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < budget + block:
            raise ValueError(
                f"max_budget_tokens must be an integer of at least budget_tokens + block_tokens = {budget} + {block} = "
                f"{budget + block} (room for one more block), got {cap!r}."
            )
        # Whole blocks: a step's extra blocks are then (max_budget_tokens - budget_tokens) / block_tokens whatever
        # the open block holds, so the blocks a step selects stay the same over a block's steps (one CUDA graph).
        for name, value in (("budget_tokens", budget), ("max_budget_tokens", cap)):
            if value % block:
                down, up = value - value % block, value - value % block + block
                raise ValueError(
                    f"With an adaptive budget (missed_mass_target), {name} must be a multiple of block_tokens={block}, "
                    f"got {value}; use {down} or {up}."
                )

    @property
    def adaptive(self) -> bool:
        """Whether decode steps choose their budget between ``budget_tokens`` and ``max_budget_tokens``."""
        return self.missed_mass_target is not None

    @property
    def sink_blocks(self) -> int:
        """Sink size in blocks."""
        return self.sink_tokens // self.block_tokens

    @property
    def window_blocks(self) -> int:
        """Window size in blocks (sealed blocks only)."""
        return self.window_tokens // self.block_tokens

    @property
    def pool_blocks(self) -> int:
        """Device slot pool capacity in blocks, per sequence and layer."""
        return self.pool_tokens // self.block_tokens

    def replace(self, **changes) -> OffloadConfig:
        """Return a validated copy with ``changes`` applied: flat settings, whole groups (``execution=...``), or
        both, flat ones over the groups. Sizes that were derived (sink, window, pool left at ``None``) are derived
        again from the new values."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values.update(dict.fromkeys(self._derived))
        for name in GROUPS:
            if name in changes:
                values.update(_values(_checked_group(name, changes.pop(name))))
        if changes.keys() - _GROUP_OF.keys():
            raise _unknown_settings(changes.keys() - _GROUP_OF.keys())
        return OffloadConfig(**{**values, **changes})


def _signature() -> inspect.Signature:
    """``OffloadConfig(budget_tokens=2048, *, attended=None, memory=None, execution=None, block_tokens=16, ...)``:
    the keywords it takes, for ``help()`` and the API reference (the ``__init__`` itself takes ``**settings``)."""
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params.append(inspect.Parameter("budget_tokens", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=2048))
    params += [inspect.Parameter(name, keyword, default=None, annotation=f"{cls.__name__} | None")
               for name, cls in GROUPS.items()]  # fmt: skip
    for group in GROUPS.values():
        params += [inspect.Parameter(f.name, keyword, default=f.default, annotation=f.type)
                   for f in dataclasses.fields(group) if f.name != "budget_tokens"]  # fmt: skip
    return inspect.Signature(params, return_annotation=None)


OffloadConfig.__init__.__signature__ = _signature()
