"""Small writes into device buffers, gathered over the layers of a cache and launched together.

A fork's refill (``OffloadCache.fork(into=...)``) resets and copies a few dozen small buffers per layer: block tables,
summaries, the open block, the slot pool's map, counters. Launched one by one from Python, those writes cost the host
more than the device. Inside :func:`gathered` the writes of :func:`copy_`, :func:`zero_` and :func:`fill_` are kept
and launched at the end as one ``torch._foreach_zero_`` and then one ``torch._foreach_copy_``; outside it they run at
once. Only writes that nothing reads before the end of the block may be gathered, from sources that the block does not
write, and no two of them may overlap, except that a region zeroed and then copied into (a buffer cleared, then part
of it filled) ends with the copy, as it would op by op.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_local = threading.local()


class _Writes:
    def __init__(self) -> None:
        self.dst: list[torch.Tensor] = []
        self.src: list[torch.Tensor] = []
        self.zero: list[torch.Tensor] = []
        self.constants: dict[tuple, torch.Tensor] = {}

    def constant(self, value, like: torch.Tensor) -> torch.Tensor:
        key = (value, like.dtype, like.device)
        if key not in self.constants:
            self.constants[key] = torch.full((), value, dtype=like.dtype, device=like.device)
        return self.constants[key]

    def run(self) -> None:
        with torch.inference_mode():  # some buffers are inference tensors (made in a decode), some are not
            if self.zero:
                torch._foreach_zero_(self.zero)
            if self.dst:
                torch._foreach_copy_(self.dst, self.src)


@contextlib.contextmanager
def gathered() -> Iterator[None]:
    """Gather the writes of :func:`copy_`, :func:`zero_` and :func:`fill_` made in the block (this thread) and launch
    them together when it ends; on an exception they are dropped (the caller's state is broken then anyway)."""
    outer = getattr(_local, "writes", None)
    if outer is not None:  # nested: the outer block launches them
        yield
        return
    writes = _local.writes = _Writes()
    try:
        yield
    finally:
        _local.writes = None
    writes.run()


def _active() -> _Writes | None:
    return getattr(_local, "writes", None)


def copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (``src`` broadcast to ``dst``), now or at the end of :func:`gathered`."""
    writes = _active()
    if writes is None or dst.device != src.device or dst.dtype != src.dtype:
        dst.copy_(src)
        return
    writes.dst.append(dst)
    writes.src.append(src if src.shape == dst.shape else src.expand_as(dst))


def zero_(dst: torch.Tensor) -> None:
    """``dst.zero_()``, now or at the end of :func:`gathered`."""
    writes = _active()
    if writes is None:
        dst.zero_()
        return
    writes.zero.append(dst)


def fill_(dst: torch.Tensor, value) -> None:
    """``dst.fill_(value)``, now or at the end of :func:`gathered`."""
    writes = _active()
    if writes is None:
        dst.fill_(value)
        return
    if value == 0:
        writes.zero.append(dst)
        return
    writes.dst.append(dst)
    writes.src.append(writes.constant(value, dst).expand_as(dst))
