"""What the offloaded layers of one decode step share: which tokens may be attended and which blocks may and must
be selected, in buffers that keep their address while the step's block capacity does (captured graphs read them).
"""

from __future__ import annotations

import torch


def forced_blocks(valid: torch.Tensor, sink_blocks: int, window_blocks: int, n_blocks: int | None = None) -> torch.Tensor:
    """Blocks every selection keeps: the sink (the first ``sink_blocks`` blocks holding a real token of each
    sequence, so left padding shifts it) and the window (the newest ``window_blocks`` of the ``n_blocks`` sealed
    ones); only valid blocks.

    Args:
        valid: blocks with a token that may be attended, ``[batch, capacity]``, ``torch.bool``, any device (blocks
            from ``n_blocks`` on are past the sealed ones and not valid).
        n_blocks: sealed blocks; ``None``: ``capacity``.

    Returns:
        ``[batch, capacity]``, ``torch.bool``, ``valid``'s device.
    """
    capacity = valid.shape[-1]
    n = capacity if n_blocks is None else n_blocks
    idx = torch.arange(capacity, device=valid.device)
    start = valid.int().argmax(dim=-1, keepdim=True)  # the first block holding a real token
    forced = (idx >= start) & (idx < start + sink_blocks)
    forced |= idx >= n - window_blocks
    return forced & valid


class DecodeInputs:
    """The inputs every offloaded layer of one decode step shares, built once per step.

    A step scores ``capacity`` blocks: the ``n_blocks`` sealed ones, then blocks past them that nothing may attend
    (``capacity`` is ``n_blocks`` rounded up as ``hf_offload.cache.execution.decode_capacity`` does), so that the
    shapes, and a captured graph, stay the same over several seals.

    Attributes:
        rows: which tokens may be attended, ``[batch, capacity + 2, block_tokens]``, ``torch.bool``, compute device.
            Row ``j < n_blocks``: sealed block ``j`` (left padding masks tokens); rows ``n_blocks`` to ``capacity -
            1``: nothing; row ``capacity`` (:attr:`open_row`): the open block (its filled positions that are not
            padding); row ``capacity + 1``: nothing (entries not selected).
        valid: blocks with at least one token that may be attended, ``[batch, capacity]``, ``torch.bool``.
        forced: blocks every selection keeps (sink and window), ``[batch, capacity]``, ``torch.bool``.
        sequence: ``arange(batch)`` shaped ``[batch, 1, 1]``, ``torch.int64`` (row index of ``rows``).
        open_pos: where this step's token goes in the open block, ``[1]``, ``torch.int64`` (``n_recent - 1``; what a
            graph of a whole decoder layer writes the token at).
        capacity: blocks a step scores (the open block's row).

    The buffers keep their address while ``batch``, ``capacity`` and ``block_tokens`` stay the same; a step with new
    values fills them in place. The buffers of the first shape since :meth:`invalidate` (the entry) are kept beside
    the current ones, so that the first decode step of the next cache that takes the layers
    (:mod:`~hf_offload.cache.parking`), after a decode that crossed a capacity, finds the buffers its graphs read.
    """

    _KEPT_SHAPES = 2

    def __init__(self) -> None:
        self._step: tuple | None = None
        self._shape: tuple | None = None
        self._sets: dict[tuple, tuple] = {}  # shape -> (rows, valid, forced, sequence, open_pos), oldest first
        self._entry: tuple | None = None  # the first shape since invalidate(): kept
        self._plain_n: int | None = None  # sealed rows hold "every token" up to this block, nothing past it
        self.rows = self.valid = self.forced = self.sequence = self.open_pos = None
        self.capacity = 0

    @property
    def open_row(self) -> int:
        """The row of :attr:`rows` that holds the open block (``capacity``)."""
        return self.capacity

    def invalidate(self) -> None:
        """Forget the step the buffers were filled for (the cache was reset); the next step fills them again, and its
        shape is the entry one."""
        self._step = None
        self._plain_n = None
        self._entry = None

    def kept_rows(self) -> set[int]:
        """Addresses of the :attr:`rows` buffers kept (graphs keyed by another one can no longer replay)."""
        return {buffers[0].data_ptr() for buffers in self._sets.values()}

    def update(
        self,
        batch: int,
        n_blocks: int,
        block_tokens: int,
        first_recent: int,
        n_recent: int,
        padding: torch.Tensor | None,
        sink_blocks: int,
        window_blocks: int,
        device: torch.device,
        step: object,
        capacity: int | None = None,
    ) -> "DecodeInputs":
        """Fill the buffers for one decode step (a no-op for the later layers of the same step).

        Args:
            batch, n_blocks, block_tokens: the geometry (sequences, sealed blocks before this step, tokens per block).
            first_recent: position of the open block's first token.
            n_recent: tokens in the open block, this step's new token included (1 to ``block_tokens``).
            padding: the forward's 2D padding mask, ``[batch, >= first_recent + n_recent]``, ``torch.bool``, any
                device; ``None``: no padding.
            sink_blocks, window_blocks: blocks forced at the start (after left padding) and at the end.
            device: compute device.
            step: identifies the forward (the layers of one forward pass the same object).
            capacity: blocks the step scores, ``>= n_blocks``; ``None``: ``n_blocks``.
        """
        capacity = n_blocks if capacity is None else capacity
        if capacity < n_blocks:
            raise ValueError(f"DecodeInputs.update: capacity {capacity} is below the {n_blocks} sealed blocks.")
        key = (batch, n_blocks, capacity, block_tokens, first_recent, n_recent, id(step))
        if key == self._step:
            return self
        shape = (batch, capacity, block_tokens, device)
        if self._entry is None:
            self._entry = shape
        if shape != self._shape:
            buffers = self._sets.pop(shape, None)
            if buffers is None:
                buffers = (
                    torch.zeros((batch, capacity + 2, block_tokens), dtype=torch.bool, device=device),
                    torch.zeros((batch, capacity), dtype=torch.bool, device=device),
                    torch.zeros((batch, capacity), dtype=torch.bool, device=device),
                    torch.arange(batch, device=device)[:, None, None],
                    torch.zeros(1, dtype=torch.int64, device=device),
                )
            self._sets[shape] = buffers
            while len(self._sets) > self._KEPT_SHAPES:  # the oldest but the entry
                del self._sets[next(s for s in self._sets if s != self._entry)]
            self.rows, self.valid, self.forced, self.sequence, self.open_pos = buffers
            self.capacity = capacity
            self._shape = shape
            self._plain_n = None
        rows, n, T, C = self.rows, n_blocks, block_tokens, capacity
        if padding is None:
            if self._plain_n != n:  # sealed rows: every token (once per seal while no padding comes)
                rows[:, :n] = True
                rows[:, n:C] = False
                self._plain_n = n
            rows[:, C] = torch.arange(T, device=device) < n_recent
        else:
            padding = padding.to(device)
            rows[:, :n].copy_(padding[:, : n * T].view(batch, n, T))
            rows[:, n:C] = False
            rows[:, C, :n_recent] = padding[:, first_recent : first_recent + n_recent]
            rows[:, C, n_recent:] = False
            self._plain_n = None
        torch.any(rows[:, :C], dim=-1, out=self.valid)
        self.open_pos.fill_(n_recent - 1)
        self.forced.copy_(forced_blocks(self.valid, sink_blocks, window_blocks, n))
        self._step = key
        return self
