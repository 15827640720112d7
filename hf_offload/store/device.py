"""The device tier: a slot pool of hot blocks, one per layer, kept across decode steps (a hot-block cache).

A slot holds one block of one sequence: ``[2, kv_heads, block_tokens, head_dim]``. Each KV head's slice of a slot is
tracked separately, so per-head selection (headwise) can place different blocks in the same slot for different
heads; with a shared selection (SoloHead) all heads of a slot hold the same block. Replacement is least recently used.
"""

from __future__ import annotations

import torch

_NEVER = torch.iinfo(torch.int64).max


class DeviceSlotPool:
    """Device-resident slots with LRU replacement, per sequence and KV head.

    Args:
        batch: sequences.
        slots: slots per sequence.
        kv_heads, block_tokens, head_dim: block geometry.
        dtype: KV dtype.
        device: the layer's compute device.
    """

    def __init__(self, batch: int, slots: int, kv_heads: int, block_tokens: int, head_dim: int, dtype, device):
        self.data = torch.zeros((batch, slots, 2, kv_heads, block_tokens, head_dim), dtype=dtype, device=device)
        # Which block each (sequence, head, slot) holds (-1: empty) and when it was last used.
        self.block = torch.full((batch, kv_heads, slots), -1, dtype=torch.int64, device=device)
        self.last_used = torch.full((batch, kv_heads, slots), -1, dtype=torch.int64, device=device)
        self.clock = 0
        self._b = torch.arange(batch, device=device)[:, None, None]
        self._h = torch.arange(kv_heads, device=device)[None, :, None]

    @property
    def slots(self) -> int:
        """Slots per sequence."""
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        """Device bytes of the slot data."""
        return self.data.numel() * self.data.element_size()

    def clear(self) -> None:
        """Mark every slot empty."""
        self.block.fill_(-1)
        self.last_used.fill_(-1)

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
        batch, heads, _ = self.block.shape
        n = blocks.shape[-1]
        if n > self.slots:
            raise ValueError(f"assign() got {n} blocks for a pool of {self.slots} slots per sequence")
        blocks = blocks.expand(batch, heads, n)
        keep = keep.expand(batch, heads, n)
        match = (self.block[:, :, None, :] == blocks[..., None]) & keep[..., None]  # [B, H, n, S]
        hit = match.any(-1)
        miss = keep & ~hit
        # Slots holding a wanted block are protected; the rest are candidates, least recently used first.
        protected = match.any(-2)
        order = self.last_used.masked_fill(protected, _NEVER).argsort(dim=-1, stable=True)
        rank = (miss.cumsum(-1) - 1).clamp(min=0)
        victim = order.gather(-1, rank)
        slots = torch.where(hit, match.int().argmax(-1), torch.where(miss, victim, 0))
        # Kept entries own distinct slots (a block is in at most one slot per row; victims are unprotected and of
        # distinct rank), so a one-hot update needs no scatter with colliding indices.
        owned = torch.nn.functional.one_hot(slots, self.slots).bool() & keep[..., None]  # [B, H, n, S]
        filled = owned & miss[..., None]
        self.block = torch.where(filled.any(-2), (filled.long() * blocks[..., None]).sum(-2), self.block)
        if touch:
            self.clock += 1
            self.last_used = self.last_used.masked_fill(owned.any(-2), self.clock)
        else:
            self.last_used = self.last_used.masked_fill(filled.any(-2), -1)
        return slots, miss

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given slots.

        Args:
            slots: shape ``[batch, kv_heads, n]``, ``torch.int64``, pool device.

        Returns:
            ``(keys, values)``, each ``[batch, kv_heads, n * block_tokens, head_dim]``.
        """
        batch, heads, n = slots.shape
        kv = self.data[self._b, slots, :, self._h]  # [B, H, n, 2, T, D]
        keys = kv[:, :, :, 0].reshape(batch, heads, -1, kv.shape[-1])
        values = kv[:, :, :, 1].reshape(batch, heads, -1, kv.shape[-1])
        return keys, values

    def write(self, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        """Fill slots with blocks already on the device.

        Args:
            slots: shape ``[batch, kv_heads, n]``, ``torch.int64``.
            blocks: shape ``[batch, n, 2, kv_heads, block_tokens, head_dim]``, pool dtype and device.
        """
        self.data[self._b, slots, :, self._h] = blocks.permute(0, 3, 1, 2, 4, 5)
