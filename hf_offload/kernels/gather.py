"""Block copies between the pinned host pool and device memory in one launch, reading and writing host memory
directly through unified virtual addressing (UVA).

One cudaMemcpy per block pays a fixed overhead that dominates at block sizes of a few KB, and a host-side gather into
a staging buffer halves the bandwidth; one kernel in which every program copies one piece straight from
pinned memory reaches the PCIe limit instead. The pieces are described by device tensors, so the caller never reads
indices on the host: an id of ``-1`` means "skip", which lets the caller launch over every candidate without first
compacting the misses (no host synchronisation in the decode loop).

Data is moved as 32-bit words, so the copy is bit-exact for any dtype. Each kernel has a pure-torch reference below
(:func:`copy_pieces_reference`), which the tests compare it with.
"""

from __future__ import annotations

import os

import torch

try:  # Triton is optional: only present on CUDA machines.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = None
    tl = None


def kernels_available(device: torch.device) -> bool:
    """Whether the Triton copy kernels can run for tensors on ``device`` (CUDA; or the CPU under Triton's
    interpreter, ``TRITON_INTERPRET=1``, which the tests use to run the kernel path without a GPU)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:

    @triton.jit
    def _copy_pieces_kernel(
        chunk_addr_ptr,  # int64 [n_chunks]: UVA addresses of the pinned host chunks
        ids_ptr,  # int64 [n_pieces]: host block id per piece, -1 = skip
        host_off_ptr,  # int64 [n_pieces]: word offset of the piece inside its host block
        dev_ptr,  # int32 view of the device tensor
        dev_off_ptr,  # int64 [n_pieces]: word offset of the piece in the device tensor
        chunk_blocks,
        block_words,
        piece_words,
        TO_HOST: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        piece = tl.program_id(0)
        part = tl.program_id(1)
        block_id = tl.load(ids_ptr + piece)
        if block_id >= 0:
            base = tl.load(chunk_addr_ptr + block_id // chunk_blocks).to(tl.pointer_type(tl.int32))
            host = base + (block_id % chunk_blocks) * block_words + tl.load(host_off_ptr + piece)
            dev = dev_ptr + tl.load(dev_off_ptr + piece)
            offs = part * BLOCK + tl.arange(0, BLOCK)
            mask = offs < piece_words
            if TO_HOST:
                tl.store(host + offs, tl.load(dev + offs, mask=mask), mask=mask)
            else:
                tl.store(dev + offs, tl.load(host + offs, mask=mask), mask=mask)


    @triton.jit
    def _copy_piece_groups_kernel(
        chunk_addr_ptr,  # int64 [n_chunks]: UVA addresses of the pinned host chunks
        ids_ptr,  # int64 [n_pieces]: host block id per piece, -1 = skip
        host_off_ptr,  # int64 [n_pieces]: word offset of the piece inside its host block
        dev_ptr,  # int32 view of the device tensor
        dev_off_ptr,  # int64 [n_pieces]: word offset of the piece in the device tensor
        chunk_blocks,
        block_words,
        piece_words,
        TO_HOST: tl.constexpr,
        PIECES: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # PIECES consecutive pieces per program, moved as one [PIECES, BLOCK] tile: a program whose pieces are all
        # skipped only reads their ids, and the loads of a group's pieces are all issued before its stores.
        group = tl.program_id(0)
        part = tl.program_id(1)
        pieces = group * PIECES + tl.arange(0, PIECES)
        block_id = tl.load(ids_ptr + pieces)
        if tl.max(block_id, axis=0) >= 0:
            live = block_id >= 0
            safe = tl.where(live, block_id, 0)
            base = tl.load(chunk_addr_ptr + safe // chunk_blocks, mask=live, other=0)
            host_word = (safe % chunk_blocks) * block_words + tl.load(host_off_ptr + pieces, mask=live, other=0)
            dev_word = tl.load(dev_off_ptr + pieces, mask=live, other=0)
            offs = part * BLOCK + tl.arange(0, BLOCK)
            mask = live[:, None] & (offs < piece_words)[None, :]
            host = (base + host_word * 4)[:, None].to(tl.pointer_type(tl.int32)) + offs[None, :]
            dev = dev_ptr + dev_word[:, None] + offs[None, :]
            if TO_HOST:
                tl.store(host, tl.load(dev, mask=mask), mask=mask)
            else:
                tl.store(dev, tl.load(host, mask=mask), mask=mask)


def _words(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("the device tensor of a block copy must be contiguous")
    if (t.numel() * t.element_size()) % 4:
        raise ValueError("block copies move 32-bit words: the device tensor's size must be a multiple of 4 bytes")
    return t.view(-1).view(torch.int32)


def copy_pieces(
    chunk_addrs: torch.Tensor,
    chunk_blocks: int,
    block_words: int,
    ids: torch.Tensor,
    host_word_offsets: torch.Tensor,
    device_tensor: torch.Tensor,
    device_word_offsets: torch.Tensor,
    piece_words: int,
    to_host: bool,
    words_per_program: int | None = None,
    num_warps: int = 4,
    pieces_per_program: int = 1,
) -> None:
    """Copy equal-sized pieces between host blocks and a device tensor in one launch, on the current stream.

    Args:
        chunk_addrs: UVA addresses of the host pool's pinned chunks, shape ``[n_chunks]``, ``torch.int64``, device.
        chunk_blocks: blocks per chunk.
        block_words: 32-bit words per host block.
        ids: host block id per piece (``-1``: skip the piece), shape ``[n]`` (any strides), ``torch.int64``, device.
        host_word_offsets: word offset of each piece inside its block, shape ``[n]`` (any strides), ``torch.int64``,
            device.
        device_tensor: the device side, contiguous, any dtype (moved as 32-bit words), CUDA.
        device_word_offsets: word offset of each piece in ``device_tensor``, shape ``[n]`` (any strides),
            ``torch.int64``, device.
        piece_words: 32-bit words per piece.
        to_host: copy device -> host if true, else host -> device.
        words_per_program: 32-bit words one program moves of each of its pieces (a power of two); ``None``: up to
            4096.
        num_warps: warps per program.
        pieces_per_program: consecutive pieces one program moves together (a power of two; the group of a
            program is skipped at the cost of reading its ids when all of them are ``-1``). Where ``n`` is not a
            multiple of it, one piece per program.
    """
    n = ids.numel()
    if n == 0:
        return
    # The kernel walks the index tensors as contiguous arrays. An index tensor built with expand() can flatten to a
    # stride-0 view (one entry expanded over its pieces), whose later elements would be read past its storage.
    ids, host_word_offsets, device_word_offsets = (
        t.reshape(-1).contiguous() for t in (ids, host_word_offsets, device_word_offsets)
    )
    block = min(words_per_program or 4096, triton.next_power_of_2(piece_words))
    group = pieces_per_program
    if group & (group - 1) or group < 1:
        raise ValueError(f"pieces_per_program must be a power of two, got {group}")
    if group > 1 and n % group == 0:
        grid = (n // group, triton.cdiv(piece_words, block))
        _copy_piece_groups_kernel[grid](
            chunk_addrs, ids, host_word_offsets, _words(device_tensor), device_word_offsets,
            chunk_blocks, block_words, piece_words, TO_HOST=to_host, PIECES=group, BLOCK=block, num_warps=num_warps,
        )  # fmt: skip
        return
    grid = (n, triton.cdiv(piece_words, block))
    _copy_pieces_kernel[grid](
        chunk_addrs, ids, host_word_offsets, _words(device_tensor), device_word_offsets,
        chunk_blocks, block_words, piece_words, TO_HOST=to_host, BLOCK=block, num_warps=num_warps,
    )  # fmt: skip


def copy_pieces_reference(
    chunks: list[torch.Tensor],
    chunk_blocks: int,
    ids: torch.Tensor,
    host_word_offsets: torch.Tensor,
    device_tensor: torch.Tensor,
    device_word_offsets: torch.Tensor,
    piece_words: int,
    to_host: bool,
) -> None:
    """Pure-torch reference of :func:`copy_pieces` (same arguments, but the host chunks as tensors)."""
    dev = _words(device_tensor)
    span = torch.arange(piece_words)
    for i, block_id in enumerate(ids.tolist()):
        if block_id < 0:
            continue
        host = chunks[block_id // chunk_blocks][block_id % chunk_blocks].view(-1).view(torch.int32)
        h = int(host_word_offsets[i]) + span
        d = (int(device_word_offsets[i]) + span).to(dev.device)
        if to_host:
            host[h] = dev[d].cpu()
        else:
            dev[d] = host[h].to(dev.device)
