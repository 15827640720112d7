"""The device tier: a slot pool of hot blocks, one per layer, kept across decode steps (a hot-block cache).

A slot holds one block of one sequence: ``block_tokens`` keys and values of every KV head. The data is laid out
``[2 (K, V), batch, kv_heads, slots, block_tokens, head_dim]``, so the keys of all slots of one sequence and head
are one contiguous run of tokens: decode attention reads the whole pool in place (one attention call over every slot,
the unselected ones masked) instead of first gathering the selected blocks. Each KV head's slice of a slot is tracked
separately, so per-head selection (headwise) can place different blocks in the same slot for different heads; with
a shared selection (SoloHead) all heads of a slot hold the same block. Replacement is least recently used. An
optional last slot, never assigned, holds the layer's open block, so that one attention call covers it too.
"""

from __future__ import annotations

import torch

from ..kernels.slots import assign_slots, assign_supported
from . import writes

_NEVER = torch.iinfo(torch.int64).max


class DeviceSlotPool:
    """Device-resident slots with LRU replacement, per sequence and KV head.

    Args:
        batch: sequences.
        slots: slots per sequence (assigned to blocks).
        kv_heads, block_tokens, head_dim: block geometry.
        dtype: KV dtype.
        device: the layer's compute device.
        open_slot: add one more slot per sequence that is never assigned (the open block's buffer, :attr:`open_keys`).

    Attributes:
        data: ``[2, batch, kv_heads, slots (+ 1), block_tokens, head_dim]``: keys and values.
        keys: ``data[0]`` as ``[batch, kv_heads, (slots (+ 1)) * block_tokens, head_dim]`` (a view).
        values: ``data[1]``, the same way.
    """

    def __init__(
        self, batch: int, slots: int, kv_heads: int, block_tokens: int, head_dim: int, dtype, device,
        open_slot: bool = False,
    ):  # fmt: skip
        total = slots + int(open_slot)
        self.data = torch.zeros((2, batch, kv_heads, total, block_tokens, head_dim), dtype=dtype, device=device)
        self.keys = self.data[0].view(batch, kv_heads, total * block_tokens, head_dim)
        self.values = self.data[1].view(batch, kv_heads, total * block_tokens, head_dim)
        self.has_open_slot = open_slot
        # Which block each (sequence, head, slot) holds (-1: empty) and when it was last used. One extra column
        # (index ``slots``) takes the writes of entries that change no slot, so that ``assign`` updates both in
        # place with one scatter each, with no mask of the entries that do change a slot.
        self._block = torch.full((batch, kv_heads, slots + 1), -1, dtype=torch.int64, device=device)
        self._last_used = torch.full((batch, kv_heads, slots + 1), -1, dtype=torch.int64, device=device)
        self.block = self._block[..., :slots]
        self.last_used = self._last_used[..., :slots]
        self.n_slots = slots
        self._pieces: torch.Tensor | None = None
        # assign() runs one kernel on CUDA where Triton runs (hf_offload.kernels.slots); else the torch code (the
        # tests switch the kernel on under Triton's CPU interpreter, where it is slow).
        self.use_kernel = torch.device(device).type == "cuda"
        # The recency clock lives on the device, so that a captured decode step (CUDA graph) advances it too.
        self.clock = torch.zeros((), dtype=torch.int64, device=device)
        self._b = torch.arange(batch, device=device)[:, None, None]
        self._h = torch.arange(kv_heads, device=device)[None, :, None]

    @classmethod
    def scratch(cls, batch: int, slots: int, kv_heads: int, block_tokens: int, head_dim: int, dtype,
                device) -> "DeviceSlotPool":  # fmt: skip
        """A pool used only as the destination of one recall (a prefill chunk's earlier blocks, in order): its
        slot data uninitialised and no replacement state (:meth:`assign` and :meth:`clear` do not apply), so that
        making it is one allocation."""
        pool = cls.__new__(cls)
        pool.data = torch.empty((2, batch, kv_heads, slots, block_tokens, head_dim), dtype=dtype, device=device)
        pool.keys = pool.data[0].view(batch, kv_heads, slots * block_tokens, head_dim)
        pool.values = pool.data[1].view(batch, kv_heads, slots * block_tokens, head_dim)
        pool.has_open_slot, pool.n_slots, pool._pieces = False, slots, None
        return pool

    def piece_index(self, device) -> torch.Tensor:
        """``arange(2 * kv_heads)`` on ``device`` (``kv * kv_heads + head`` of each piece of a block), made once."""
        if self._pieces is None or self._pieces.device != torch.device(device):
            self._pieces = torch.arange(2 * self.kv_heads, device=device)
        return self._pieces

    @property
    def slots(self) -> int:
        """Slots per sequence that blocks are assigned to (the open slot excluded)."""
        return self.n_slots

    @property
    def kv_heads(self) -> int:
        """KV heads per slot."""
        return self.data.shape[2]

    @property
    def open_keys(self) -> torch.Tensor:
        """The open slot's keys, ``[batch, kv_heads, block_tokens, head_dim]`` (a view; needs ``open_slot=True``)."""
        return self.data[0, :, :, self.n_slots]

    @property
    def open_values(self) -> torch.Tensor:
        """The open slot's values, like :attr:`open_keys`."""
        return self.data[1, :, :, self.n_slots]

    @staticmethod
    def bytes_for(batch: int, slots: int, kv_heads: int, block_tokens: int, head_dim: int, dtype,
                  open_slot: bool = False) -> int:  # fmt: skip
        """Device bytes of the slot data of a pool of these arguments (:attr:`nbytes` once built)."""
        total = slots + int(open_slot)
        return 2 * batch * kv_heads * total * block_tokens * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Device bytes of the slot data."""
        return self.data.numel() * self.data.element_size()

    def clear(self) -> None:
        """Mark every slot empty."""
        writes.fill_(self._block, -1)
        writes.fill_(self._last_used, -1)

    def forget_from(self, first_block: int) -> None:
        """Mark empty every slot that holds a block at index ``first_block`` or later (blocks dropped by a crop:
        their indices will name other data once sealed again)."""
        dropped = self._block >= first_block
        self._block.masked_fill_(dropped, -1)
        self._last_used.masked_fill_(dropped, -1)

    def take_rows(self, rows: torch.Tensor) -> "DeviceSlotPool":
        """The pool of the sequences ``rows`` (any order, repeats allowed): slots, their block map and recency
        clocks, and the open slot, copied row by row.

        Args:
            rows: sequence indices into this pool, ``[new_batch]``, ``torch.int64``, any device.

        Returns:
            ``self``, reordered in place (same addresses), where ``new_batch`` equals the batch; else a new pool.
        """
        rows = rows.to(self.data.device)
        batch, heads, slots = self.block.shape
        if len(rows) == batch:
            self.data.copy_(self.data[:, rows])
            self._block.copy_(self._block[rows])
            self._last_used.copy_(self._last_used[rows])
            return self
        _, _, _, total, block_tokens, head_dim = self.data.shape
        pool = DeviceSlotPool(len(rows), slots, heads, block_tokens, head_dim, self.data.dtype, self.data.device,
                              open_slot=self.has_open_slot)  # fmt: skip
        pool.data.copy_(self.data[:, rows])
        pool._block.copy_(self._block[rows])
        pool._last_used.copy_(self._last_used[rows])
        pool.clock.copy_(self.clock)
        pool.use_kernel = self.use_kernel
        return pool

    def assign(
        self, blocks: torch.Tensor, keep: torch.Tensor, touch: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Find or make a slot for every wanted block; evicts least recently used slots for misses.

        Args:
            blocks: wanted block indices, shape ``[batch, 1 or kv_heads, n]`` with ``n <= slots`` distinct entries
                per row, ``torch.int64``, pool device.
            keep: which entries are wanted at all, same shape, ``torch.bool``.
            touch: mark the entries used now (``True``). ``False`` (speculative prefetch): resident entries keep
                their age and filled slots rank as never used, so an unused guess is the first victim later and
                the recency order of what was really used does not change.

        Returns:
            ``(slots, miss)``: slot per entry, shape ``[batch, kv_heads, n]`` (0 where not kept), and which kept
            entries were not resident and must be filled by the caller, same shape, ``torch.bool``.
        """
        batch, heads, slots = self.block.shape
        n = blocks.shape[-1]
        if n > slots:
            raise ValueError(f"assign() got {n} blocks for a pool of {slots} slots per sequence")
        if self.use_kernel and assign_supported(self.block.device, slots, n):
            if touch:
                self.clock += 1
            return assign_slots(self._block, self._last_used, self.clock, blocks, keep, touch)
        return self.assign_reference(blocks, keep, touch)

    def assign_reference(
        self, blocks: torch.Tensor, keep: torch.Tensor, touch: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`assign` in torch operations (where the kernel of :mod:`hf_offload.kernels.slots` does not run,
        and the reference it is tested against); same arguments and result."""
        batch, heads, slots = self.block.shape
        n = blocks.shape[-1]
        # Entries not kept look for block -2, which no slot holds (empty slots hold -1).
        wanted = torch.where(keep, blocks, -2)
        match = self.block[:, :, None, :] == wanted[..., None]  # [B, H, n, S]
        # A block is in at most one slot per row: max gives whether it is resident and where (slot 0 if not).
        hit, hit_slot = match.max(-1)
        miss = keep != hit  # hit implies keep
        # Slots holding a wanted block are protected; the rest are candidates, least recently used first.
        order = self.last_used.masked_fill(match.any(-2), _NEVER).argsort(dim=-1, stable=True)
        rank = (miss.cumsum(-1) - 1).clamp(min=0)  # the i-th miss takes the i-th candidate
        slots_of = torch.where(miss, order.gather(-1, rank), hit_slot)
        # Kept entries own distinct slots (a block is in at most one slot per row; victims are unprotected and of
        # distinct rank); every other entry writes into the extra column, so the scatters change only owned slots.
        filled = torch.where(miss, slots_of, slots)
        self._block.scatter_(-1, filled, blocks.expand(batch, heads, n))
        if touch:
            self.clock += 1
            used = torch.where(keep, slots_of, slots)
            self._last_used.scatter_(-1, used, self.clock.expand(used.shape))
        else:
            self._last_used.scatter_(-1, filled, -1)
        return slots_of, miss

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given slots.

        Args:
            slots: shape ``[batch, kv_heads, n]``, ``torch.int64``, pool device.

        Returns:
            ``(keys, values)``, each ``[batch, kv_heads, n * block_tokens, head_dim]``.
        """
        batch, heads, _ = slots.shape
        head_dim = self.data.shape[-1]
        keys = self.data[0][self._b, self._h, slots].view(batch, heads, -1, head_dim)  # [B, H, n, T, D] -> tokens
        values = self.data[1][self._b, self._h, slots].view(batch, heads, -1, head_dim)
        return keys, values

    def write(self, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        """Fill slots with blocks already on the device.

        Args:
            slots: shape ``[batch, kv_heads, n]``, ``torch.int64``.
            blocks: shape ``[batch, n, 2, kv_heads, block_tokens, head_dim]``, pool dtype and device.
        """
        self.data[:, self._b, self._h, slots] = blocks.permute(2, 0, 3, 1, 4, 5)
