"""Counters of one offloaded layer, and the ``stats()`` dict of a cache built from them."""

from __future__ import annotations

import torch

from ..kernels import certificate
from ..store import writes


class LayerStats:
    """Counters of one layer.

    Counters are Python ints or 0-d device tensors. Device counts of decode steps may be queued with
    :meth:`add_later` (no operation per step) and are summed when a counter is read, or when the queue is long.
    The accuracy certificate of the decode steps (:meth:`record_step`) goes into persistent device tensors (pooled
    over the batch, and per sequence), the same in steps run op by op and in replayed graphs.
    Counts added while a CUDA graph is being captured go into a persistent device tensor instead, one entry per
    distinct ``(fields, factor)`` of :meth:`add_later` (one in-place add per call, recorded in the graph; the factor
    and the fields are applied when a counter is read), so that every replay of the graph counts; masks counted with
    :meth:`count_later` go into a persistent count per element instead (one launch per replay).
    """

    FIELDS = (
        "lookups",  # kept (sequence, head, block) entries looked up in decode
        "hits",
        "recalled_blocks",  # host-to-device transfers (whole blocks or single-head pieces)
        "recalled_bytes",
        "decode_recalled_blocks",  # the part of the two above recalled by decode steps
        "decode_recalled_bytes",
        "decode_host_bytes",  # the part of decode_recalled_bytes read from host memory (the rest: admitted blocks)
        "offloaded_bytes",
        "decode_steps",
        "prefetched_blocks",  # speculative recalls (lookahead); included in the recall counters above
        "prefetched_bytes",
        "prefetch_used_blocks",  # prefetched blocks that the exact plan that followed attended
        "graph_captures",  # decode steps captured into a CUDA graph (op by op first unless their geometry was warm)
        "graph_replays",  # decode steps replayed from a captured graph
        "graph_capture_us",  # host wall time of the decode steps that captured (any op-by-op run + the capture)
        "graph_capture_retries",  # captures of a warm geometry that failed; the step then ran op by op
        "layer_graph_captures",  # decode steps of a whole decoder layer captured into a CUDA graph
        "layer_graph_replays",  # decode steps of a whole decoder layer replayed (included in graph_replays)
        "seal_graph_captures",  # seals of a full block after a replayed step, captured into a CUDA graph
        "seal_graph_replays",  # seals of a full block after a replayed step, replayed from that graph
        "reused_selections",  # decode steps that attended the previous step's selection (reselect_every)
        "question_graph_captures",  # later prefill chunks of a fork (questions) captured with their decoder layer
        "question_graph_replays",  # later prefill chunks of a fork replayed from such a graph
    )
    _QUEUE = 256  # queued counts summed at once in the decode loop (bounds the tensors kept alive)
    _CAPTURE_SLOTS = 64  # distinct (fields, factor) counts that captured graphs may add into

    def __init__(self) -> None:
        # (fields, factor, mask shape) -> per-element counts of the masks captured graphs add (count_later)
        self._captured_masks: dict[tuple[tuple[str, ...], int, tuple[int, ...]], torch.Tensor] = {}
        # meanings -> the counts kernels add into (kernel_counts)
        self._kernel_counts: dict[tuple, torch.Tensor] = {}
        self.reset()

    def reset(self) -> None:
        """Zero every counter."""
        self._totals = dict.fromkeys(self.FIELDS, 0)
        self._queued: dict[tuple[tuple[str, ...], int], list[torch.Tensor]] = {}
        self._n_queued = 0
        with torch.inference_mode():  # made in whatever mode the decode ran; in place, as graphs add into them
            if getattr(self, "_captured", None) is not None:
                writes.zero_(self._captured)
            for buffer in (*self._captured_masks.values(), *self._kernel_counts.values()):
                writes.zero_(buffer)
            if getattr(self, "_steps", None) is not None:
                writes.zero_(self._steps)
            if getattr(self, "_rows", None) is not None:
                writes.zero_(self._rows)

    def prepare_capture(self, device: torch.device, batch: int | None = None) -> None:
        """Allocate the device counters that captured graphs add into (before the first capture; idempotent).
        ``batch``: the sequences of the steps to come (the per-sequence certificate's buffer)."""
        self._step_buffers(device)
        if batch is not None:
            self._row_buffer(device, batch)
        if getattr(self, "_captured", None) is None:
            self._captured = torch.zeros(self._CAPTURE_SLOTS, dtype=torch.int64, device=device)
            self._capture_slots: dict[tuple[tuple[str, ...], int], int] = {}  # (fields, factor) -> entry

    def totals_snapshot(self) -> dict:
        """The counters added now (not those queued on the device), to put back with :meth:`restore_totals`."""
        return dict(self._totals)

    def totals_delta(self, snapshot: dict) -> dict:
        """What was added to each counter since ``snapshot`` (:meth:`totals_snapshot`): the counters that changed,
        by name (ints, or 0-d device tensors)."""
        delta = {name: self._totals[name] - snapshot[name] for name in self.FIELDS
                 if self._totals[name] is not snapshot[name]}  # fmt: skip
        return {name: value for name, value in delta.items() if isinstance(value, torch.Tensor) or value}

    def restore_totals(self, snapshot: dict) -> None:
        """Put the counters added now back to ``snapshot`` (work that ran only to be captured)."""
        self._totals = dict(snapshot)

    def add(self, fields: tuple[str, ...], value) -> None:
        """Add ``value`` (an int or a 0-d device tensor) to each of ``fields`` now."""
        for name in fields:
            self._totals[name] = self._totals[name] + value

    def add_later(self, fields: tuple[str, ...], value: torch.Tensor, factor: int = 1) -> None:
        """Add ``factor * value`` to each of ``fields`` when the counters are next read (an int: now).

        Args:
            fields: counter names.
            value: a 0-d integer tensor on the compute device, or an int.
            factor: a constant multiplier (e.g. bytes per block, or ``-1``).
        """
        if not isinstance(value, torch.Tensor):
            self.add(fields, value * factor)
            return
        if value.is_cuda and torch.cuda.is_current_stream_capturing():
            slot = self._capture_slots.get((fields, factor))
            if slot is None:
                if len(self._capture_slots) == self._CAPTURE_SLOTS:
                    raise RuntimeError(
                        f"LayerStats: more than {self._CAPTURE_SLOTS} distinct counts in captured graphs"
                    )
                slot = self._capture_slots[(fields, factor)] = len(self._capture_slots)
            self._captured.select(0, slot).add_(value)
            return
        self._queued.setdefault((fields, factor), []).append(value)
        self._n_queued += 1
        if self._n_queued >= self._QUEUE:
            self.settle()

    def kernel_counts(self, device: torch.device, meanings: tuple) -> torch.Tensor | None:
        """Persistent device counts that kernels add into (in steps run op by op and in replayed graphs alike):
        ``[len(meanings)]``, ``torch.int64``; entry ``i`` adds ``factor`` times its value to each of ``fields`` for
        every ``(fields, factor)`` of ``meanings[i]`` when a counter is read. The same ``meanings`` give the same
        tensor. Made outside a capture: a capture that finds none gets ``None`` (the caller counts otherwise).

        Args:
            device: the compute device.
            meanings: per entry, a tuple of ``(fields, factor)`` pairs.
        """
        counts = self._kernel_counts.get(meanings)
        if counts is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            with torch.inference_mode(False), torch.no_grad():
                counts = self._kernel_counts[meanings] = torch.zeros(len(meanings), dtype=torch.int64, device=device)
        return counts

    def count_later(self, fields: tuple[str, ...], mask: torch.Tensor, factor: int = 1) -> None:
        """Add ``factor`` times the number of ``True`` elements of ``mask`` to each of ``fields`` when the counters
        are next read. While a CUDA graph is being captured, the mask itself is added into a persistent per-element
        count of its shape (one launch per replay, where a sum and an add would take three), summed when read; that
        count is allocated at the first call outside a capture (an allocation inside one would be the graph's, its
        zeros replayed), so a capture that finds none counts through :meth:`add_later`.

        Args:
            fields: counter names.
            mask: ``torch.bool``, any shape, on the compute device.
            factor: a constant multiplier.
        """
        key = (fields, factor, tuple(mask.shape))
        if mask.is_cuda and torch.cuda.is_current_stream_capturing():
            buffer = self._captured_masks.get(key)
            if buffer is not None:
                buffer.add_(mask)
                return
        elif mask.is_cuda and key not in self._captured_masks:  # made in the decode's own mode, as the graphs' adds
            self._captured_masks[key] = torch.zeros(mask.shape, dtype=torch.int64, device=mask.device)
        self.add_later(fields, mask.sum(), factor)

    # Entries of the step buffer (float64, so that sums over many steps stay exact enough).
    _MISSED_SUM, _MISSED_MAX, _MISSED_LAST, _MISSED_STEPS, _TAIL_SUM, _TAIL_STEPS, _KEPT_SUM, _KEPT_STEPS = range(8)
    _EXACT_STEPS, _N_STEP_ENTRIES = 8, 9
    _SOURCES = ("tail", "scores", "exact", None)

    def _step_buffers(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The step buffer ``[9]`` and, per source of :meth:`record_step`, what one step adds to it: ``[4, 3, 9]``
        (per unit of the missed share, per kept entry, and constant), float64, on ``device``; made once."""
        if getattr(self, "_steps", None) is None:
            with torch.inference_mode(False), torch.no_grad():
                # Made on the device by fill kernels: an item assigned from a Python number, like a copy from
                # pageable host memory, synchronises with the host (CUDA's sync debug mode raises on it).
                patterns = torch.zeros((len(self._SOURCES), 3, self._N_STEP_ENTRIES), dtype=torch.float64,
                                       device=device)  # fmt: skip
                ones = [(1, self._KEPT_SUM), (2, self._KEPT_STEPS)]
                for i, source in enumerate(self._SOURCES):
                    entries = list(ones)
                    if source is not None:
                        entries.append((2, self._MISSED_STEPS))
                    if source in ("tail", "scores"):
                        entries.append((0, self._MISSED_SUM))
                    if source == "exact":
                        entries.append((2, self._EXACT_STEPS))
                    if source == "tail":
                        entries += [(0, self._TAIL_SUM), (2, self._TAIL_STEPS)]
                    for row, entry in entries:
                        patterns[i, row, entry].fill_(1)
                self._steps = torch.zeros(self._N_STEP_ENTRIES, dtype=torch.float64, device=device)
                self._patterns = patterns
        return self._steps, self._patterns

    _ROW_SUM, _ROW_MAX, _ROW_STEPS, _N_ROW_ENTRIES = 0, 1, 2, 3

    def _row_buffer(self, device: torch.device, batch: int) -> torch.Tensor | None:
        """The per-sequence certificate ``[3, batch]`` float64 (sum and max of the share, and the steps that recorded
        one, per sequence), made outside a capture (``None`` inside one that finds none of this batch: that
        step is not recorded per sequence). A batch edit takes its rows (:meth:`take_rows`); a buffer of another
        batch is made anew."""
        rows = getattr(self, "_rows", None)
        if rows is not None and rows.shape[1] == batch:
            return rows
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        with torch.inference_mode(False), torch.no_grad():
            self._rows = torch.zeros((self._N_ROW_ENTRIES, batch), dtype=torch.float64, device=device)
        return self._rows

    def take_rows(self, rows: torch.Tensor) -> None:
        """After a batch edit (beam search's reorder, a selection or repetition of sequences): sequence ``i``'s
        certificate becomes that of the old sequence ``rows[i]``."""
        old = getattr(self, "_rows", None)
        if old is not None:
            with torch.inference_mode(False), torch.no_grad():
                self._rows = old.index_select(1, rows.to(old.device))

    def record_step(
        self,
        keep: torch.Tensor,
        missed: torch.Tensor | None,
        source: str | None,
        tail_lse: torch.Tensor | None = None,
        selection_lse: torch.Tensor | None = None,
    ) -> None:
        """Record one decode step's kept entries and estimated share of attention left out (device operations only,
        in place on persistent buffers: no host synchronisation, and a captured graph's replays record too). One
        launch where Triton runs (:mod:`hf_offload.kernels.certificate`), else :meth:`record_step_reference`.

        Args:
            keep: the step's kept entries, ``[batch, 1 or kv_heads, k]``, ``torch.bool``, compute device.
            missed: the share per sequence, ``[batch]`` float64 on that device (pooled as its mean), or ``None``
                (``source`` ``"exact"``: 0; ``"tail"``: from ``tail_lse`` and ``selection_lse``).
            source: ``"tail"`` (the selector's estimate of the unselected blocks), ``"scores"`` (the selector's
                block masses), ``"exact"`` (every sealed block attended) or ``None`` (no estimate).
            tail_lse, selection_lse: with ``source`` ``"tail"`` and no ``missed``: the log-sum-exps of the estimate
                and of the exact attention over the selection, ``[batch, kv_heads, group]``, float32; a sequence's
                share is the mean of ``sigmoid(tail_lse - selection_lse)`` over its query heads.
        """
        if keep.is_cuda and torch.cuda.is_current_stream_capturing() and getattr(self, "_steps", None) is None:
            raise RuntimeError("LayerStats.record_step inside a capture needs prepare_capture() before it.")
        lse = missed is None and tail_lse is not None
        per_seq = tail_lse[0].numel() if lse else 1
        if not certificate.record_step_supported(keep.device, keep.shape[0], per_seq):
            if lse:
                missed = torch.sigmoid(tail_lse - selection_lse).mean(dim=tuple(range(1, tail_lse.dim())),
                                                                      dtype=torch.float64)  # fmt: skip
            self.record_step_reference(keep, missed, source)
            return
        steps, patterns = self._step_buffers(keep.device)
        rows = self._row_buffer(keep.device, keep.shape[0])
        if lse:
            mode = certificate.LSE
        elif missed is not None:
            mode = certificate.GIVEN
        else:
            mode = certificate.EXACT if source == "exact" else certificate.NONE
        certificate.record_step(steps, patterns[self._SOURCES.index(source)], rows, keep, mode, self._MISSED_MAX,
                                self._MISSED_LAST, missed=missed, tail_lse=tail_lse,
                                selection_lse=selection_lse)  # fmt: skip

    def record_step_reference(self, keep: torch.Tensor, missed: torch.Tensor | None, source: str | None) -> None:
        """:meth:`record_step` in torch (about thirteen operations), with the share per sequence given."""
        if keep.is_cuda and torch.cuda.is_current_stream_capturing() and getattr(self, "_steps", None) is None:
            raise RuntimeError("LayerStats.record_step inside a capture needs prepare_capture() before it.")
        steps, patterns = self._step_buffers(keep.device)
        pattern = patterns[self._SOURCES.index(source)]
        entries = keep.numel() // max(keep.shape[-1], 1)  # sequences (x KV heads): kept entries per row are averaged
        steps.addcmul_(pattern[1], keep.sum(dtype=torch.float64), value=1 / max(entries, 1)).add_(pattern[2])
        rows = self._row_buffer(keep.device, keep.shape[0])
        if missed is not None:
            pooled = missed.mean()
            steps.addcmul_(pattern[0], pooled)
            torch.maximum(steps[self._MISSED_MAX], pooled, out=steps[self._MISSED_MAX])
            steps[self._MISSED_LAST].copy_(pooled)
            if rows is not None:
                rows[self._ROW_SUM].add_(missed)
                torch.maximum(rows[self._ROW_MAX], missed, out=rows[self._ROW_MAX])
                rows[self._ROW_STEPS].add_(1)
        elif source == "exact":
            steps[self._MISSED_LAST].zero_()
            if rows is not None:
                rows[self._ROW_STEPS].add_(1)

    def step_summary(self) -> dict:
        """The recorded steps, read once (one host synchronisation): ``missed_sum``, ``missed_max``,
        ``missed_last``, ``missed_steps``, ``tail_sum``, ``tail_steps``, ``kept_sum``, ``kept_steps``,
        ``exact_steps``; per sequence, lists: ``rows_missed_sum``, ``rows_missed_max``, ``rows_missed_steps``
        (empty before the first step of the cache, zeros after :meth:`reset`)."""
        names = ("missed_sum", "missed_max", "missed_last", "missed_steps", "tail_sum", "tail_steps", "kept_sum",
                 "kept_steps", "exact_steps")  # fmt: skip
        steps, rows = getattr(self, "_steps", None), getattr(self, "_rows", None)
        empty = {"rows_missed_sum": [], "rows_missed_max": [], "rows_missed_steps": []}
        if steps is None:
            return {**dict.fromkeys(names, 0.0), **empty}
        values = (steps if rows is None else torch.cat([steps, rows.flatten()])).tolist()
        out = {**dict(zip(names, values[: len(names)])), **empty}
        if rows is not None:
            n = rows.shape[1]
            per_row = [values[len(names) + i * n : len(names) + (i + 1) * n] for i in range(self._N_ROW_ENTRIES)]
            out["rows_missed_sum"], out["rows_missed_max"] = per_row[self._ROW_SUM], per_row[self._ROW_MAX]
            out["rows_missed_steps"] = per_row[self._ROW_STEPS]
        return out

    def settle(self) -> None:
        """Sum the queued device counts into the counters (device operations only, no host synchronisation)."""
        queued, self._queued, self._n_queued = self._queued, {}, 0
        for (fields, factor), values in queued.items():
            total = torch.stack(values).sum() * factor
            self.add(fields, total)


def _counter(name: str) -> property:
    def get(self: LayerStats):
        if self._n_queued:
            self.settle()
        total = self._totals[name]
        for (fields, factor), slot in getattr(self, "_capture_slots", {}).items():
            if name in fields:
                total = total + self._captured[slot] * factor
        for (fields, factor, _), buffer in getattr(self, "_captured_masks", {}).items():
            if name in fields:
                total = total + buffer.sum() * factor
        for meanings, counts in getattr(self, "_kernel_counts", {}).items():
            for i, meaning in enumerate(meanings):
                for fields, factor in meaning:
                    if name in fields:
                        total = total + counts[i] * factor
        return total

    def set(self: LayerStats, value) -> None:
        self._totals[name] = value

    return property(get, set)


for _name in LayerStats.FIELDS:
    setattr(LayerStats, _name, _counter(_name))


def count_recall(stats: LayerStats, count, unit: int, decode: bool, prefetch: bool = False, host_count=None) -> None:
    """Add ``count`` recalled blocks (or pieces) of ``unit`` bytes each to ``stats``.

    Args:
        count: an int, or a 0-d integer tensor on the compute device (queued, no host synchronisation).
        unit: bytes per block or piece.
        decode: recalled by a decode step (else by a prefill chunk).
        prefetch: a speculative recall (lookahead).
        host_count: how many of them were read from host memory (the rest from blocks admitted to the device);
            ``None``: all of them.
    """
    blocks = ("recalled_blocks",) + (("decode_recalled_blocks",) if decode else ()) + (
        ("prefetched_blocks",) if prefetch else ()
    )
    stats.add_later(blocks, count)
    stats.add_later(tuple(name.replace("_blocks", "_bytes") for name in blocks), count, unit)
    if decode:
        stats.add_later(("decode_host_bytes",), count if host_count is None else host_count, unit)


DISK_KEYS = ("disk_kv_bytes", "disk_spilled_chunks", "disk_spilled_bytes", "disk_reads", "disk_read_bytes",
             "disk_read_blocks", "disk_staging_hits", "disk_staged_ahead_blocks", "disk_staged_used_blocks",
             "disk_staging_bytes")


def _disk_stats(offload: list, disk) -> dict:
    """The ``disk_*`` keys of ``stats()``: the bytes of the layers' blocks on disk, and the counters of the disk tiers
    their pools spill to (this cache's; for a fork, the tier of the cache it shares its pools with, counted whole)."""
    tiers = {id(disk): disk} if disk is not None else {}
    for layer in offload:
        if layer.blocks.is_initialized and layer.blocks.host.disk is not None:
            tiers.setdefault(id(layer.blocks.host.disk), layer.blocks.host.disk)
    out = {**dict.fromkeys(DISK_KEYS, 0), "disk_direct_io": None}
    for tier in tiers.values():
        for name, value in tier.stats().items():
            if name == "disk_direct_io":
                out[name] = value if out[name] is None else out[name] and value
            else:
                out[name] += value
    out["disk_kv_bytes"] = sum(layer.blocks.disk_kv_bytes() for layer in offload)
    return out


def _ratio(steps, numerator: str, denominator: str) -> float | None:
    """Sum of ``numerator`` over sum of ``denominator`` of layers' :meth:`LayerStats.step_summary`; ``None`` at 0."""
    steps = list(steps)
    below = sum(s[denominator] for s in steps)
    return sum(s[numerator] for s in steps) / below if below else None


def _missed_mass(steps) -> dict | None:
    """``stats()["missed_mass"]`` of one layer or of all (their steps pooled): the estimated share of attention that
    decode steps left out, mean and max over the steps (and layers) that have one, ``last`` the mean of the layers'
    last steps, ``steps`` how many; ``source`` says where it came from: ``"tail"`` (the selector's estimate of the
    unselected blocks), ``"scores"`` (its block masses), ``"exact"`` (every step attended every sealed block: 0).
    ``None`` before a step with an estimate."""
    steps = [s for s in steps if s["missed_steps"]]
    if not steps:
        return None
    n = sum(s["missed_steps"] for s in steps)
    tail, exact = sum(s["tail_steps"] for s in steps), sum(s["exact_steps"] for s in steps)
    out = {
        "mean": sum(s["missed_sum"] for s in steps) / n,
        "max": max(s["missed_max"] for s in steps),
        "last": sum(s["missed_last"] for s in steps) / len(steps),
        "steps": int(n),
        "source": "tail" if tail else "scores" if n > exact else "exact",
    }
    widths = {len(s.get("rows_missed_sum", ())) for s in steps}
    if len(widths) == 1 and 0 not in widths:  # every layer recorded the same sequences
        sums = [sum(r) for r in zip(*(s["rows_missed_sum"] for s in steps))]
        counts = [sum(r) for r in zip(*(s["rows_missed_steps"] for s in steps))]
        out["per_sequence"] = {
            "mean": [x / c if c else None for x, c in zip(sums, counts)],
            "max": [max(r) if c else None for r, c in zip(zip(*(s["rows_missed_max"] for s in steps)), counts)],
        }
    return out


def summarize(layers: list, timing: dict | None, fusions: dict, disk=None) -> dict:
    """The ``OffloadCache.stats()`` dict of a cache's layers (see that method for the keys).

    Args:
        layers: the cache's layers: offloaded ones (with ``stats`` and ``blocks``) and dense sliding-window ones.
        timing: the phase timer's summary, or ``None``.
        fusions: ``stats()["fusions"]``.
        disk: the cache's :class:`~hf_offload.store.disk.DiskTier`, or ``None``.
    """
    per_layer, step_summaries = {}, {}
    device = summaries = host = shared = reserved = 0
    offload = [layer for layer in layers if isinstance(getattr(layer, "stats", None), LayerStats)]
    for layer in layers:
        if layer in offload:
            s, blocks = layer.stats, layer.blocks
            steps = step_summaries[layer.layer_idx] = s.step_summary()
            lookups, hits = int(s.lookups), int(s.hits)
            per_layer[layer.layer_idx] = {
                "device_kv_bytes": blocks.device_kv_bytes(),
                "host_kv_bytes": blocks.host_kv_bytes(),
                "disk_kv_bytes": blocks.disk_kv_bytes(),
                "host_shared_bytes": blocks.shared_host_bytes(),
                "recalled_blocks": int(s.recalled_blocks),
                "recalled_bytes": int(s.recalled_bytes),
                "decode_recalled_bytes": int(s.decode_recalled_bytes),
                "decode_host_bytes": int(s.decode_host_bytes),
                "prefetched_blocks": int(s.prefetched_blocks),
                "prefetch_used_blocks": int(s.prefetch_used_blocks),
                "hit_rate": hits / lookups if lookups else None,
                "lookups": lookups,
                "tail_share": steps["tail_sum"] / steps["tail_steps"] if steps["tail_steps"] else None,
                "missed_mass": _missed_mass([steps]),
                "attended_blocks": steps["kept_sum"] / steps["kept_steps"] if steps["kept_steps"] else None,
                "reused_selections": int(s.reused_selections),
            }
            device += blocks.device_kv_bytes()
            summaries += blocks.device_summary_bytes()
            host += blocks.host_kv_bytes()
            shared += blocks.shared_host_bytes()
            reserved += blocks.host_reserved_bytes()
        elif layer.is_initialized and layer.keys is not None:
            device += 2 * layer.keys.numel() * layer.keys.element_size()

    def total(name: str) -> int:
        return sum(int(getattr(layer.stats, name)) for layer in offload)

    lookups = total("lookups")
    return {
        "device_kv_bytes": device,
        "device_summary_bytes": summaries,
        "host_kv_bytes": host,
        "host_shared_bytes": shared,
        "host_reserved_bytes": reserved,
        "recalled_blocks": total("recalled_blocks"),
        "recalled_bytes": total("recalled_bytes"),
        "decode_recalled_blocks": total("decode_recalled_blocks"),
        "decode_recalled_bytes": total("decode_recalled_bytes"),
        "decode_host_bytes": total("decode_host_bytes"),
        "prefetched_blocks": total("prefetched_blocks"),
        "prefetched_bytes": total("prefetched_bytes"),
        "prefetch_used_blocks": total("prefetch_used_blocks"),
        "offloaded_bytes": total("offloaded_bytes"),
        "graph_captures": total("graph_captures"),
        "graph_replays": total("graph_replays"),
        "graph_capture_ms": total("graph_capture_us") / 1000,
        "graph_capture_retries": total("graph_capture_retries"),
        "layer_graph_captures": total("layer_graph_captures"),
        "layer_graph_replays": total("layer_graph_replays"),
        "seal_graph_captures": total("seal_graph_captures"),
        "seal_graph_replays": total("seal_graph_replays"),
        "question_graph_captures": total("question_graph_captures"),
        "question_graph_replays": total("question_graph_replays"),
        "hit_rate": total("hits") / lookups if lookups else None,
        "tail_share": _ratio(step_summaries.values(), "tail_sum", "tail_steps"),
        "missed_mass": _missed_mass(step_summaries.values()),
        "attended_blocks": _ratio(step_summaries.values(), "kept_sum", "kept_steps"),
        "reused_selections": total("reused_selections"),
        "decode_steps": max((layer.stats.decode_steps for layer in offload), default=0),
        **_disk_stats(offload, disk),
        "layers": per_layer,
        "timing": timing,
        "fusions": fusions,
    }
