"""Optional per-phase timing of decode steps (``OffloadConfig(timing=True)``).

Phases per offloaded layer and decode step: ``select`` (scoring and top-k), ``prefetch`` (lookahead: the speculative
plan of the next offloaded layer, its slot assignment and the launch of its recall; on CUDA the copy itself runs on
a side stream and belongs to no phase, elsewhere it runs here), ``recall`` (slot assignment, waiting for the layer's
prefetch, host-to-device copies of what is still missing), ``attention`` (the softmax over the selected blocks and
the recent tokens). ``step`` is the time between the starts of two consecutive decode steps, and ``rest`` what the
step spends outside those phases (the model's own layers, sampling, Python). On CUDA the marks are events on the
current stream, read only when :meth:`PhaseTimer.summary` is called (timing adds no host synchronisation to the
step itself); elsewhere they are wall-clock times.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

PHASES = ("select", "prefetch", "recall", "attention")


class PhaseTimer:
    """Collects phase marks for one cache.

    Args:
        device: the compute device (CUDA events there, wall clock elsewhere).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[int, str, object, object]] = []  # (step number, phase, start, end)
        self.totals_ms: dict[str, float] = defaultdict(float)
        self.step_marks: list[object] = []
        self.steps = 0  # complete step-to-step spans
        self.started = 0  # decode steps begun

    def reset(self) -> None:
        """Forget every mark and total (e.g. between two measured runs on one cache)."""
        self.pending.clear()
        self.totals_ms.clear()
        self.step_marks.clear()
        self.steps = 0
        self.started = 0

    def mark(self) -> object:
        """A point in time on the current stream."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, phase: str, start: object, end: object) -> None:
        """Attribute the span ``start``..``end`` to ``phase`` of the current decode step."""
        self.pending.append((self.started, phase, start, end))

    def step_start(self) -> None:
        """Mark the start of a decode step (called by the first offloaded layer)."""
        self.step_marks.append(self.mark())
        self.started += 1

    def _elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def summary(self) -> dict[str, float]:
        """Mean milliseconds per decode step of each phase, of the whole step, and of the rest."""
        if self.cuda and (self.pending or self.step_marks):
            torch.cuda.synchronize()
        # Only complete steps count (those followed by another step's start), for the phases and the step alike,
        # so that step = select + recall + attention + rest holds for every step counted.
        done = [entry for entry in self.pending if entry[0] < self.started]
        self.pending = [entry for entry in self.pending if entry[0] >= self.started]
        for _, phase, start, end in done:
            self.totals_ms[phase] += self._elapsed_ms(start, end)
        for start, end in zip(self.step_marks, self.step_marks[1:]):
            self.totals_ms["step"] += self._elapsed_ms(start, end)
            self.steps += 1
        self.step_marks = self.step_marks[-1:]
        if not self.steps:
            return {}
        out = {f"{phase}_ms": self.totals_ms[phase] / self.steps for phase in (*PHASES, "step")}
        out["rest_ms"] = out["step_ms"] - sum(out[f"{phase}_ms"] for phase in PHASES)
        out["timed_steps"] = self.steps
        return out
