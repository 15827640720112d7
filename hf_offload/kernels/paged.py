"""Decode attention over the selected blocks where they lie: admitted device chunks in place, the rest in the slot pool.

With IO-adaptive admission most sealed blocks sit in device memory (in the block pool's admitted chunks), yet the
slot-pool path copies every selected block that the pool does not hold into a slot before one attention call reads
the pool, a copy of most of the attended bytes where the pool's hit rate is low. Here one kernel walks each sequence's and KV head's selection, reads a
block from its admitted chunk when it is there and from its slot otherwise (blocks in host memory are recalled into
slots as before), and the open block from the pool's last slot; only blocks in host memory are ever copied.

Split-KV decoding (as in FlashDecoding): each program attends one (sequence, KV head) pair's share of the entries
with an online softmax and writes its partial output and log-sum-exp; a second launch merges the shares. The query
heads of one KV head are the rows of one matrix product (grouped-query attention without repeated keys).

:func:`paged_decode_reference` is the pure-torch reference the tests compare the kernels with.
"""

from __future__ import annotations

import torch

from .gather import kernels_available, tl, triton


def paged_decode_supported(pool_data: torch.Tensor) -> bool:
    """Whether :func:`paged_decode` can run over this slot pool, ``[2, batch, kv_heads, slots + 1, block_tokens,
    head_dim]`` (Triton on its device; power-of-two ``head_dim`` of at least 16 and ``block_tokens``; float16,
    bfloat16 or float32, which the queries share)."""
    head_dim, tokens = pool_data.shape[-1], pool_data.shape[-2]
    return (
        kernels_available(pool_data.device)
        and pool_data.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and tokens & (tokens - 1) == 0
    )


def _entry_sources(
    blocks: torch.Tensor,
    keep: torch.Tensor,
    block_table: torch.Tensor,
    chunk_admitted: torch.Tensor,
    chunk_blocks: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per selected entry: its block id (``-1`` where not kept) and whether it is read in place from an admitted
    chunk, both ``[batch, kv_heads, k]`` (the reference's bookkeeping, in torch)."""
    batch, sel_heads, k = blocks.shape
    ids = block_table.gather(1, blocks.reshape(batch, -1).clamp(min=0)).view(batch, sel_heads, k)
    ids = torch.where(keep, ids, -1)
    chunk = torch.where(ids >= 0, ids // chunk_blocks, 0)
    in_place = (ids >= 0) & chunk_admitted.to(ids.device)[chunk]
    return ids.expand(batch, kv_heads, k), in_place.expand(batch, kv_heads, k)


def paged_decode_reference(
    query: torch.Tensor,
    scaling: float,
    blocks: torch.Tensor,
    keep: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    open_row: int,
    block_table: torch.Tensor,
    chunks: list[torch.Tensor],
    chunk_admitted: list[bool],
    pool_data: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one decode query over its selected blocks and the open block, in pure torch (float32).

    Args:
        query: ``[batch, kv_heads, group, head_dim]`` (the query heads of one KV head as rows), the pool's dtype,
            compute device.
        scaling: softmax scale.
        blocks: selected block indices, ``[batch, 1 or kv_heads, k]`` (1: one selection shared by every head),
            ``torch.int64``, compute device.
        keep: which entries are attended, same shape, ``torch.bool``.
        slots: the slot of each entry in the pool, ``[batch, kv_heads, k]``, ``torch.int64`` (read for entries not
            in an admitted chunk).
        rows: which tokens of each block may be attended, ``[batch, >= open_row + 1, block_tokens]``, ``torch.bool``;
            row ``open_row``: the open block's.
        open_row: the row of ``rows`` that describes the open block (held in the pool's last slot).
        block_table: block id of each sequence's block index, ``[batch, >= max(blocks) + 1]``, ``torch.int64``.
        chunks: the block pool's chunks, each ``[chunk_blocks, 2, kv_heads, block_tokens, head_dim]``, any device.
        chunk_admitted: per chunk, whether it is in device memory (read in place; else its blocks are read from
            their slots).
        pool_data: the slot pool, ``[2, batch, kv_heads, slots + 1, block_tokens, head_dim]`` (the last slot: the
            open block), compute device.

    Returns:
        ``(out, lse)``: ``[batch, kv_heads, group, head_dim]`` and ``[batch, kv_heads, group]``, float32.
    """
    batch, heads, group, head_dim = query.shape
    tokens, open_slot = pool_data.shape[-2], pool_data.shape[3] - 1
    chunk_blocks = chunks[0].shape[0] if chunks else 1
    admitted = torch.tensor(list(chunk_admitted) or [False], dtype=torch.bool)
    ids, in_place = _entry_sources(blocks, keep, block_table, admitted, chunk_blocks, heads)
    b = torch.arange(batch, device=query.device)[:, None, None]
    h = torch.arange(heads, device=query.device)[None, :, None]
    k_slot, v_slot = pool_data[0][b, h, slots], pool_data[1][b, h, slots]  # [B, H, k, T, D]
    if in_place.any():
        store = torch.cat([c.to(query.device) for c in chunks])  # [n_ids, 2, H, T, D]
        flat = ids.clamp(min=0)
        k_store, v_store = store[flat, 0, h], store[flat, 1, h]
        where = in_place[..., None, None]
        k_slot, v_slot = torch.where(where, k_store, k_slot), torch.where(where, v_store, v_slot)
    k_open, v_open = pool_data[0, :, :, open_slot, None], pool_data[1, :, :, open_slot, None]  # [B, H, 1, T, D]
    keys = torch.cat([k_slot, k_open], dim=2).flatten(2, 3)  # [B, H, (k + 1) * T, D]
    values = torch.cat([v_slot, v_open], dim=2).flatten(2, 3)
    sel_rows = rows[torch.arange(batch, device=rows.device)[:, None, None], blocks.clamp(min=0)]  # [B, Hs, k, T]
    sel_rows = (sel_rows & keep[..., None]).expand(batch, heads, -1, tokens)
    open_rows = rows[:, open_row][:, None, None].expand(batch, heads, 1, tokens)
    allowed = torch.cat([sel_rows, open_rows], dim=2).flatten(2)[:, :, None]  # [B, H, 1, (k + 1) * T]
    logits = torch.einsum("bhgd,bhnd->bhgn", query.float(), keys.float()) * scaling
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = logits.logsumexp(dim=-1)
    out = torch.einsum("bhgn,bhnd->bhgd", torch.exp(logits - lse[..., None]), values.float())
    return out, lse


if triton is not None:

    @triton.jit
    def _paged_partial_kernel(
        q_ptr,  # [B, H, G, D], the pool's dtype
        blocks_ptr,  # int64 [B, HS, K]
        keep_ptr,  # bool (as int8) [B, HS, K]
        slots_ptr,  # int64 [B, H, K]
        rows_ptr,  # bool (as int8) [B, n_rows, T]
        table_ptr,  # int64 [B, table_stride]
        chunk_addr_ptr,  # int64 [n_chunks]: chunk addresses
        chunk_on_host_ptr,  # bool (as int8) [>= n_chunks]: chunk in host memory (read from its slot)
        pool_ptr,  # [2, B, H, S + 1, T, D], the pool's dtype
        pool_addr,  # int: pool_ptr's address in bytes
        part_out_ptr,  # float32 [B, H, SPLITS, G, D]
        part_lse_ptr,  # float32 [B, H, SPLITS, G]
        scaling,
        k_entries,
        n_rows,
        open_row,
        table_stride,
        chunk_blocks,
        batch,
        PER_SPLIT: tl.constexpr,
        H: tl.constexpr,
        HS: tl.constexpr,
        S: tl.constexpr,
        G: tl.constexpr,
        GP: tl.constexpr,
        T: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
        BLOCK_E: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        # One program: one (sequence, KV head) and one split's share of the entries (the k selected ones, then the
        # open block as entry k). Each tile of BLOCK_E entries is BLOCK_E * T keys read through per-entry addresses:
        # an admitted block's K (V) of this head at its chunk's address plus the block's and head's offset, else
        # the entry's slot in the pool; masked tokens (padding, entries not kept, unfilled open positions) read
        # nothing and get -inf logits.
        bh = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        b = bh // H
        h = bh % H
        if HS > 1:  # one selection per KV head
            hs = h
        else:  # one selection shared by every head
            hs = h * 0
        dt = pool_ptr.dtype.element_ty
        ESIZE: tl.constexpr = dt.primitive_bitwidth // 8
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        t = tl.arange(0, T)
        q = tl.load(q_ptr + (bh * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
        block_elems = 2 * H * T * D  # one block of the block pool: K and V of every head
        pool_v = batch * H * (S + 1) * T * D  # V's offset in the pool
        m_i = tl.full((GP,), float("-inf"), tl.float32)
        l_i = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        first = split * PER_SPLIT
        for start in range(0, PER_SPLIT, BLOCK_E):
            j = first + start + tl.arange(0, BLOCK_E)
            sel = j < k_entries
            is_open = j == k_entries
            live = (j < first + PER_SPLIT) & (j <= k_entries)
            at = (b * HS + hs) * k_entries + j
            blk = tl.load(blocks_ptr + at, mask=sel, other=0)
            kept = tl.load(keep_ptr + at, mask=sel, other=0) != 0
            slot = tl.load(slots_ptr + (b * H + h) * k_entries + j, mask=sel, other=0)
            slot = tl.where(is_open, S, slot)
            used = live & ((sel & kept) | is_open)
            bid = tl.load(table_ptr + b * table_stride + blk, mask=sel & kept, other=-1)
            chunk = tl.where(bid >= 0, bid // chunk_blocks, 0)
            on_host = tl.load(chunk_on_host_ptr + chunk, mask=bid >= 0, other=1) != 0
            in_place = (bid >= 0) & ~on_host
            base = tl.load(chunk_addr_ptr + chunk, mask=in_place, other=0)
            # Element offsets from the pool's start: an admitted block's K of this head (its chunk's address minus
            # the pool's, plus the block's and head's offset), else the entry's slot. Every offset is a multiple of
            # 16 elements (device allocations start 512-byte aligned; T * D is a multiple of 16), which lets the
            # loads below use wide accesses.
            place_off = (base - pool_addr) // ESIZE + (bid % chunk_blocks) * block_elems + h * T * D
            pool_off = (((b * H + h) * (S + 1) + slot) * T) * D
            k_off = tl.multiple_of(tl.where(in_place, place_off, pool_off), 16)
            v_off = tl.multiple_of(k_off + tl.where(in_place, H * T * D, pool_v), 16)
            row = tl.where(is_open, open_row, blk)
            tok = tl.load(rows_ptr + (b * n_rows + row)[:, None] * T + t[None, :], mask=used[:, None], other=0) != 0
            tok = tok & used[:, None]  # [BLOCK_E, T]
            inner = (t[None, :, None] * D + d[None, None, :]).to(tl.int64)  # [1, T, D]
            k_ptrs = pool_ptr + k_off[:, None, None] + inner
            v_ptrs = pool_ptr + v_off[:, None, None] + inner
            lmask = tok[:, :, None]
            keys = tl.reshape(tl.load(k_ptrs, mask=lmask, other=0.0), (BLOCK_E * T, D))
            vals = tl.reshape(tl.load(v_ptrs, mask=lmask, other=0.0), (BLOCK_E * T, D))
            if IEEE:
                s = tl.dot(q, tl.trans(keys), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(keys))
            s = s * scaling
            s = tl.where(tl.reshape(tok, (BLOCK_E * T,))[None, :], s, float("-inf"))  # [GP, BLOCK_E * T]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(dt), vals, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(dt), vals)
            m_i = m_new
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        at = (bh * SPLITS + split) * G + g
        tl.store(part_out_ptr + at[:, None] * D + d[None, :], out, mask=(g < G)[:, None])
        tl.store(part_lse_ptr + at, lse, mask=g < G)

    @triton.jit
    def _paged_merge_kernel(
        part_out_ptr,  # float32 [B, H, SPLITS, G, D]
        part_lse_ptr,  # float32 [B, H, SPLITS, G]
        out_ptr,  # [B, H, G, D], any float dtype
        lse_ptr,  # float32 [B, H, G]
        G: tl.constexpr,
        D: tl.constexpr,
        SPLITS: tl.constexpr,
        SP: tl.constexpr,
    ):
        # One program: one (sequence, KV head, query head): the softmax-weighted mean of the splits' outputs.
        bhg = tl.program_id(0).to(tl.int64)
        bh = bhg // G
        g = bhg % G
        s = tl.arange(0, SP)
        d = tl.arange(0, D)
        at = (bh * SPLITS + s) * G + g
        lse = tl.load(part_lse_ptr + at, mask=s < SPLITS, other=float("-inf"))
        top = tl.max(lse, axis=0)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(lse - top_safe)
        total = tl.sum(w, axis=0)
        parts = tl.load(part_out_ptr + at[:, None] * D + d[None, :], mask=(s < SPLITS)[:, None], other=0.0)
        out = tl.sum(parts * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + bhg * D + d, out.to(out_ptr.dtype.element_ty))
        tl.store(lse_ptr + bhg, tl.where(total == 0.0, float("-inf"), top_safe + tl.log(total)))


def default_splits(entries: int, block_e: int) -> int:
    """Splits of each (sequence, KV head) pair's entries: one tile of ``block_e`` entries per program (a program's
    tiles are too few for pipelining to pay, and more programs keep more loads in flight)."""
    return max(1, -(-entries // block_e))


def paged_decode(
    query: torch.Tensor,
    scaling: float,
    blocks: torch.Tensor,
    keep: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    open_row: int,
    block_table: torch.Tensor,
    chunk_addrs: torch.Tensor,
    chunk_on_host: torch.Tensor,
    chunk_blocks: int,
    pool_data: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    block_e: int = 4,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one decode query over its selected blocks (admitted ones read in place) and the open block:
    two launches, no host synchronisation (a CUDA graph can hold them once they have compiled).

    Args:
        query: ``[batch, kv_heads, group, head_dim]``, the pool's dtype, compute device.
        scaling: softmax scale.
        blocks, keep, slots, rows, open_row, block_table: as :func:`paged_decode_reference`'s; ``blocks``,
            ``keep``, ``slots``, ``rows`` contiguous; ``block_table`` with contiguous rows.
        chunk_addrs: the block pool's chunk addresses (:meth:`~hf_offload.store.HostBlockPool.chunk_addrs`),
            ``[n_chunks]``, ``torch.int64``, compute device.
        chunk_on_host: per chunk, whether it is in host memory, ``[>= n_chunks]``, ``torch.bool``, compute device.
        chunk_blocks: blocks per chunk.
        pool_data: the slot pool, ``[2, batch, kv_heads, slots + 1, block_tokens, head_dim]``, contiguous.
        out_dtype: dtype of ``out``; ``None``: float32.
        block_e: entries per tile (a power of two).
        splits: programs per (sequence, KV head); ``None``: :func:`default_splits`.
        num_warps: warps per program of the first launch.
        num_stages: software-pipelining stages of the first launch; ``None``: Triton's default.

    Returns:
        ``(out, lse)``: ``[batch, kv_heads, group, head_dim]`` (``out_dtype``) and ``[batch, kv_heads, group]``
        (float32).
    """
    batch, heads, group, head_dim = query.shape
    k = blocks.shape[-1]
    tokens, slots_total = pool_data.shape[-2], pool_data.shape[3]
    blocks, keep, slots = blocks.contiguous(), keep.contiguous(), slots.contiguous()
    splits = splits or default_splits(k + 1, block_e)
    per_split = -(-(k + 1) // splits)
    per_split = -(-per_split // block_e) * block_e
    splits = -(-(k + 1) // per_split)
    device = query.device
    part_out = torch.empty((batch, heads, splits, group, head_dim), dtype=torch.float32, device=device)
    part_lse = torch.empty((batch, heads, splits, group), dtype=torch.float32, device=device)
    out = torch.empty((batch, heads, group, head_dim), dtype=out_dtype or torch.float32, device=device)
    lse = torch.empty((batch, heads, group), dtype=torch.float32, device=device)
    gp = max(16, triton.next_power_of_2(group))
    _paged_partial_kernel[(batch * heads, splits)](
        query.contiguous(), blocks, keep.view(torch.int8), slots, rows.view(torch.int8), block_table,
        chunk_addrs, chunk_on_host.view(torch.int8), pool_data, pool_data.data_ptr(), part_out, part_lse,
        scaling, k, rows.shape[1], open_row, block_table.stride(0), chunk_blocks, batch,
        PER_SPLIT=per_split, H=heads, HS=blocks.shape[1], S=slots_total - 1, G=group, GP=gp, T=tokens, D=head_dim,
        SPLITS=splits, BLOCK_E=block_e, IEEE=query.dtype == torch.float32, num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )  # fmt: skip
    _paged_merge_kernel[(batch * heads * group,)](
        part_out, part_lse, out, lse, G=group, D=head_dim, SPLITS=splits, SP=max(2, triton.next_power_of_2(splits)),
        num_warps=1,
    )  # fmt: skip
    return out, lse
