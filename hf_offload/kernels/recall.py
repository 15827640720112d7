"""A decode step's recall of a shared selection in two launches: the entries the slot pool takes, then the copy of
the missed blocks with the step's counts.

Between the slot assignment and the copy, the recall in torch operations is about seventeen small launches per
layer and step (the ids of the missed blocks through the block table, which of them lie in host memory, the launch's
index arrays, and the counters of hits, recalled blocks and bytes); inside a decode step's CUDA graph each is a
kernel of one or two microseconds. With the two launches below, the small elementwise and copy kernels of a step at
128K tokens and batch 1 on the 8B shape went from 1,401 to 674 us (``results/decode/recall_launch_h100/``,
``kernel_profile``). Here:

- :func:`pool_keep`: the kept entries whose blocks lie in host memory (those that take slots when the paged
  attention reads admitted blocks in place), one launch.
- :func:`recall_entries`: one program per piece (the K or V of one head of one entry, as
  :func:`~hf_offload.store.transfer.recall_blocks_kernel` moves them) reads its entry's miss flag, block, host id and
  slot, and copies the piece from pinned host memory (or an admitted chunk) into the slot; the first program of each
  entry adds the entry to the step's counts (kept entries, recalled entries, recalled entries read from host memory)
  with atomic adds into a persistent ``int64`` counter (the cache's counters read it; nothing is zeroed per step).

Both match the torch code (:func:`pool_keep_reference`, :func:`recall_entries_reference`), which the tests compare
under Triton's CPU interpreter and on CUDA.
"""

from __future__ import annotations

import torch

from .gather import _words, kernels_available, tl, triton

COUNTS = 3
"""Entries of the counts :func:`recall_entries` adds to: kept entries, recalled entries, recalled entries whose
block lies in host memory (not in an admitted chunk)."""

POOL_KEEP_BLOCK = 1024
"""Entries per program of :func:`pool_keep`."""


def supported(device: torch.device) -> bool:
    """Whether the kernels run on ``device`` (Triton there: CUDA, or the CPU under the interpreter)."""
    return kernels_available(device)


if triton is not None:

    @triton.jit
    def _pool_keep_kernel(
        blocks_ptr,  # int64 [E]: block index per entry
        keep_ptr,  # uint8 [E]
        out_ptr,  # uint8 [E]
        table_ptr,  # int64 [B, capacity]: host block id per block, -1 for none
        on_host_ptr,  # uint8 [chunks + 1]: chunk in host memory; the last entry (id -1) is 0
        entries,
        per_row,  # entries per sequence
        capacity,
        last_chunk,  # index of the last on_host entry
        chunk_blocks,
        BLOCK: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = e < entries
        keep = tl.load(keep_ptr + e, mask=live, other=0) != 0
        block = tl.load(blocks_ptr + e, mask=live & keep, other=0)
        block = tl.minimum(tl.maximum(block, 0), capacity - 1)
        ids = tl.load(table_ptr + (e // per_row) * capacity + block, mask=live & keep, other=-1)
        chunk = tl.where(ids >= 0, ids // chunk_blocks, last_chunk)
        host = tl.load(on_host_ptr + chunk, mask=live & keep, other=0) != 0
        tl.store(out_ptr + e, (keep & host).to(tl.uint8), mask=live)

    @triton.jit(do_not_specialize=["entries", "per_row", "capacity", "total", "chunk_blocks"])
    def _recall_entries_kernel(
        blocks_ptr,  # int64: block index of entry (b, j) at b * blocks_row + j
        keep_ptr,  # uint8: kept flag, same layout (keep_row)
        miss_ptr,  # uint8: missed flag of entry (b, j) at b * miss_row + j (head 0 of the pool's entries)
        slots_ptr,  # int64: slot of entry (b, j) at b * slots_row + j
        table_ptr,  # int64 [B, capacity]
        on_host_ptr,  # uint8 [chunks + 1]
        chunk_addr_ptr,  # int64 [chunks]: addresses of the chunks (pinned host memory or device)
        dev_ptr,  # int32 view of the slot pool [2, B, H, total, ...]
        counts_ptr,  # int64 [COUNTS]: kept, recalled, recalled from host memory
        blocks_row,
        keep_row,
        miss_row,
        slots_row,
        per_row,  # entries per sequence
        capacity,
        last_chunk,
        chunk_blocks,
        block_words,
        piece_words,
        batch,
        heads,
        total,
        COUNT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        piece = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        pieces = 2 * heads
        entry = piece // pieces
        kv_h = piece % pieces
        b = entry // per_row
        j = entry % per_row
        missed = tl.load(miss_ptr + b * miss_row + j) != 0
        block = tl.load(blocks_ptr + b * blocks_row + j, mask=missed, other=0)
        block_id = tl.load(table_ptr + b * capacity + block, mask=missed, other=-1)
        if COUNT:
            if (kv_h == 0) & (part == 0):
                if tl.load(keep_ptr + b * keep_row + j) != 0:
                    tl.atomic_add(counts_ptr, 1)
                if missed:
                    tl.atomic_add(counts_ptr + 1, 1)
                    chunk = tl.where(block_id >= 0, block_id // chunk_blocks, last_chunk)
                    if tl.load(on_host_ptr + chunk) != 0:
                        tl.atomic_add(counts_ptr + 2, 1)
        if block_id >= 0:
            slot = tl.load(slots_ptr + b * slots_row + j)
            kv = kv_h // heads
            h = kv_h % heads
            base = tl.load(chunk_addr_ptr + block_id // chunk_blocks).to(tl.pointer_type(tl.int32))
            host = base + (block_id % chunk_blocks) * block_words + kv_h * piece_words
            dev = dev_ptr + (((kv * batch + b) * heads + h) * total + slot) * piece_words
            offs = part * BLOCK + tl.arange(0, BLOCK)
            mask = offs < piece_words
            tl.store(dev + offs, tl.load(host + offs, mask=mask), mask=mask)


def _row_view(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` (``[batch, heads, n]``) and the stride between its rows' entry 0 of head 0, for a kernel that reads
    entry ``(b, 0, j)`` at ``b * row + j`` (the last dimension must be contiguous)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t, t.stride(0)


def pool_keep_reference(blocks: torch.Tensor, keep: torch.Tensor, table: torch.Tensor, on_host: torch.Tensor,
                        chunk_blocks: int) -> torch.Tensor:  # fmt: skip
    """``keep`` limited to the entries whose block lies in host memory, in torch.

    Args:
        blocks: block indices, ``[batch, heads, n]``, ``torch.int64``.
        keep: wanted entries, same shape, ``torch.bool``.
        table: host block id per block of each sequence, ``[batch, capacity]``, ``torch.int64``, ``-1`` for none.
        on_host: per chunk whether it lies in host memory, ``[chunks + 1]``, ``torch.bool``, the last entry
            ``False`` (read for the id ``-1``).
        chunk_blocks: blocks per chunk.

    Returns:
        Same shape as ``keep``, ``torch.bool``.
    """
    ids = table.gather(1, blocks.reshape(blocks.shape[0], -1).clamp(0, table.shape[1] - 1)).view(blocks.shape)
    chunk = torch.where(ids >= 0, ids // chunk_blocks, len(on_host) - 1)
    return keep & on_host[chunk]


def pool_keep(blocks: torch.Tensor, keep: torch.Tensor, table: torch.Tensor, on_host: torch.Tensor,
              chunk_blocks: int) -> torch.Tensor:  # fmt: skip
    """:func:`pool_keep_reference` in one launch where :func:`supported` (no host synchronisation; arguments and
    result the same)."""
    if not supported(blocks.device):
        return pool_keep_reference(blocks, keep, table, on_host, chunk_blocks)
    blocks, keep = blocks.contiguous(), keep.contiguous()
    out = torch.empty_like(keep)
    entries = keep.numel()
    if entries:
        _pool_keep_kernel[(triton.cdiv(entries, POOL_KEEP_BLOCK),)](
            blocks, keep.view(torch.uint8), out.view(torch.uint8), table.contiguous(), on_host.view(torch.uint8),
            entries, keep[0].numel(), table.shape[1], len(on_host) - 1, chunk_blocks, BLOCK=POOL_KEEP_BLOCK,
        )  # fmt: skip
    return out


def recall_entries(
    blocks: torch.Tensor,
    keep: torch.Tensor,
    miss: torch.Tensor,
    slots: torch.Tensor,
    table: torch.Tensor,
    chunk_addrs: torch.Tensor,
    on_host: torch.Tensor,
    chunk_blocks: int,
    block_words: int,
    pool_data: torch.Tensor,
    counts: torch.Tensor | None,
    words_per_program: int = 512,
    num_warps: int = 2,
) -> None:
    """Copy the missed whole blocks of a shared selection from the host pool into their slots, in one launch on the
    current stream, and add the step's counts to ``counts`` (no host synchronisation). Needs :func:`supported`.

    Args:
        blocks: block indices, ``[batch, 1 or kv_heads, n]``, ``torch.int64`` (head 0 is read: a shared selection);
            a missed entry's block is below ``table``'s capacity.
        keep: the selection's kept entries, same shape as ``blocks``, ``torch.bool`` (counted only).
        miss: entries to recall, ``[batch, kv_heads, n]``, ``torch.bool`` (head 0 is read).
        slots: slot per entry, ``[batch, kv_heads, n]``, ``torch.int64`` (head 0 is read).
        table: host block id per block, ``[batch, capacity]``, ``torch.int64``, ``-1`` for none (a missed entry
            without an id is counted and not copied).
        chunk_addrs: addresses of the host pool's chunks, ``[chunks]``, ``torch.int64``.
        on_host: per chunk whether it lies in host memory, ``[capacity + 1]`` for a table of room for ``capacity >=
            chunks`` chunks, ``torch.bool``; the last entry ``False`` (read for a missed entry without an id).
        chunk_blocks: blocks per chunk.
        block_words: 32-bit words per host block (``[2, kv_heads, block_tokens, head_dim]``).
        pool_data: the slot pool, ``[2, batch, kv_heads, total, block_tokens, head_dim]``, contiguous.
        counts: ``[3]`` ``torch.int64``: kept entries, recalled entries and recalled entries read from host memory
            are added to it (:data:`COUNTS`); ``None``: nothing is counted.
        words_per_program: 32-bit words of one piece one program moves (a power of two).
        num_warps: warps per program.
    """
    _, batch, heads, total, _, _ = pool_data.shape
    n = miss.shape[-1]
    piece = block_words // (2 * heads)
    if batch * n == 0:
        return
    if not supported(miss.device):
        raise RuntimeError(f"recall_entries needs Triton on {miss.device} (CUDA, or the CPU with TRITON_INTERPRET=1)")
    blocks, blocks_row = _row_view(blocks)
    keep, keep_row = _row_view(keep)
    miss, miss_row = _row_view(miss)
    slots, slots_row = _row_view(slots)
    block = min(words_per_program, triton.next_power_of_2(piece))
    grid = (batch * n * 2 * heads, triton.cdiv(piece, block))
    _recall_entries_kernel[grid](
        blocks, keep, miss, slots, table.contiguous(), on_host.view(torch.uint8), chunk_addrs, _words(pool_data),
        counts if counts is not None else chunk_addrs, blocks_row, keep_row, miss_row, slots_row, n, table.shape[1],
        len(on_host) - 1, chunk_blocks, block_words,
        piece, batch, heads, total, COUNT=counts is not None, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip


def recall_entries_reference(
    blocks: torch.Tensor,
    keep: torch.Tensor,
    miss: torch.Tensor,
    slots: torch.Tensor,
    table: torch.Tensor,
    chunk_addrs: torch.Tensor,
    on_host: torch.Tensor,
    chunk_blocks: int,
    block_words: int,
    pool_data: torch.Tensor,
    counts: torch.Tensor | None,
) -> None:
    """:func:`recall_entries` in torch operations and the copy kernel of :func:`~hf_offload.kernels.gather
    .copy_pieces` (the path it replaces); same arguments."""
    from .gather import copy_pieces

    _, batch, heads, total, _, _ = pool_data.shape
    n = miss.shape[-1]
    piece = block_words // (2 * heads)
    missed = miss[:, 0]
    ids = torch.where(missed, table.gather(1, torch.where(missed, blocks[:, 0], 0)), -1)  # [B, n]
    kv_h = torch.arange(2 * heads, device=miss.device)
    kv, h = kv_h // heads, kv_h % heads
    b = torch.arange(batch, device=miss.device)[:, None, None]
    dev_off = (((kv * batch + b) * heads + h) * total + slots[:, 0, :, None]) * piece  # [B, n, 2H]
    host_off = (kv_h * piece).expand(batch, n, -1)
    copy_pieces(chunk_addrs, chunk_blocks, block_words, ids[..., None].expand(-1, -1, 2 * heads), host_off,
                pool_data, dev_off, piece, False)  # fmt: skip
    if counts is not None:
        chunk = torch.where(ids >= 0, ids // chunk_blocks, len(on_host) - 1)
        host = (missed & on_host[chunk]).sum()
        counts += torch.stack([keep[:, 0].sum(), missed.sum(), host])
