"""Attention over the blocks a decode step did not select, estimated from low-precision copies of their keys and values.

Why: attending only to the selection renormalises the attention mass it misses onto the selected tokens. Keeping
every block's keys and values on the compute device at a few bits, per block and channel (KIVI's per-channel layout,
Liu et al., 2024; :mod:`hf_offload.kernels.quant`), lets each decode query add the blocks it did not select as an
estimate: exact attention where it matters, low precision for the rest, as MiKV (Yang et al., 2024) keeps
unimportant tokens at low precision and RetroInfer (Chen et al., 2025) estimates the attention of the clusters it
does not retrieve. The two parts are merged through their log-sum-exp, so the result is one softmax over selection
and estimate.

:func:`tail_attention` picks its kernel by itself (:func:`tail_partials`): the tensor-core CUDA kernel of
:mod:`hf_offload.kernels.tail_mma` where it can run, else the Triton ``dot`` kernel (products over 64 token rows at a
time with ``tl.dot``) where its tiles fit, else the Triton ``loop`` kernel (one block at a time); each program walks a
range of blocks of one sequence and KV head, decodes keys and values in registers and keeps an online softmax for
every query head of the KV head. Without Triton on the device, :func:`tail_attention_reference` computes the same in
pure torch, ``chunk_blocks`` blocks dequantized at a time. Nothing is chosen through the environment. None of them
waits for the host, so a captured CUDA graph can hold them. A decode step calls :func:`tail_attention_merged`,
whose one more launch merges the ranges, adds the blocks counted by their mass alone and merges the estimate with
the selection's attention; with the bounded estimate :func:`tail_plan` finds the near blocks' tokens and the far
blocks in one launch before it, its programs each owning a range of one sequence's blocks (many ranges per sequence
where the batch is small).
"""

from __future__ import annotations

import warnings

import torch

from .gather import kernels_available, tl, triton
from .quant import dequantize_keys, take_blocks

BLOCKS_PER_PROGRAM = 16
"""Blocks one program of the kernel walks (its partial softmax is merged with the others' in torch, or in
:func:`tail_attention_merged`'s launch)."""


def tail_attention_reference(
    query: torch.Tensor,
    keys: dict[str, torch.Tensor],
    key_bits: int,
    values: dict[str, torch.Tensor],
    value_bits: int,
    tokens_ok: torch.Tensor,
    softcap: float | None = None,
    chunk_blocks: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one decode query over the quantized keys and values of the ``tokens_ok`` tokens.

    Args:
        query: ``[batch, kv_heads, group, channels]``, float32, compute device, already multiplied by the softmax
            scale; ``channels`` is ``keys["kmin"]``'s last size (``head_dim`` padded to whole bytes of codes).
        keys: ``codes`` (``[batch, n_blocks, kv_heads, block_tokens, channels * key_bits // 8]``, ``torch.uint8``),
            ``kmin`` and ``kstep`` (``[batch, n_blocks, kv_heads, channels]``) from
            :func:`hf_offload.kernels.quant.quantize_keys`, same device.
        key_bits: bits per key code.
        values: ``codes``, ``kmin`` and ``kstep`` of the values quantized the same way (their own channel count).
        value_bits: bits per value code.
        tokens_ok: which tokens to attend, ``[batch, n_blocks, block_tokens]``, ``torch.bool``, same device.
        softcap: optional logit soft-capping (``softcap * tanh(logits / softcap)``).
        chunk_blocks: blocks dequantized at a time.

    Returns:
        ``(out, lse)``: ``out`` ``[batch, kv_heads, group, value_channels]``, float32 (zero where no token is
        attended); ``lse`` ``[batch, kv_heads, group]``, float32, the log-sum-exp of the attended logits (``-inf``
        where none is attended).
    """
    n = tokens_ok.shape[1]
    batch, heads, group, _ = query.shape
    channels = values["kmin"].shape[-1]
    m = torch.full((batch, heads, group), float("-inf"), dtype=torch.float32, device=query.device)
    l = torch.zeros_like(m)
    o = torch.zeros((batch, heads, group, channels), dtype=torch.float32, device=query.device)
    for start in range(0, n, chunk_blocks):
        part = slice(start, min(n, start + chunk_blocks))
        # Keys and values dequantized straight into the layouts of the two batched products (per sequence and KV
        # head: query @ [channels, tokens], weights @ [tokens, channels]), so neither is copied into another order.
        k = dequantize_keys(keys["codes"][:, part], keys["kmin"][:, part], keys["kstep"][:, part], key_bits, "bhcnt")
        logits = torch.matmul(query, k.flatten(-2)).unflatten(-1, k.shape[-2:])  # [B, H, G, c, T]
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits.masked_fill_(~tokens_ok[:, None, None, part], float("-inf")).flatten(-2)
        m_new = torch.maximum(m, logits.amax(-1))
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # nothing attended yet: no inf - inf
        p = logits.sub_(shift[..., None]).exp_()
        rescale = torch.exp(m - shift)
        v = dequantize_keys(values["codes"][:, part], values["kmin"][:, part], values["kstep"][:, part], value_bits,
                            "bhntc")  # fmt: skip
        l = l * rescale + p.sum(-1)
        o = o * rescale[..., None] + torch.matmul(p, v.flatten(2, 3))
        m = m_new
    attended = l > 0
    out = torch.where(attended[..., None], o / l.clamp(min=1e-30)[..., None], torch.zeros_like(o))
    lse = torch.where(attended, m + torch.log(l.clamp(min=1e-30)), torch.full_like(m, float("-inf")))
    return out, lse


def attention_lse_reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention that also returns its log-sum-exp, in float32 matrix products (the reference of
    :func:`attention_lse`; arguments and result as its)."""
    logits = torch.einsum("bhgd,bhnd->bhgn", query.float(), keys.float()) * scaling
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = logits.logsumexp(dim=-1)
    out = torch.einsum("bhgn,bhnd->bhgd", torch.exp(logits - lse[..., None]), values.float())
    return out, lse


def _fused_lse_supported(query: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether :func:`attention_lse` can call a fused attention operator for these tensors (CUDA: the
    memory-efficient kernel; CPU: the flash kernel; both take float16, bfloat16 or float32 and a ``head_dim`` that is
    a multiple of 8)."""
    return (
        query.device.type in ("cuda", "cpu")
        and query.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and keys.dtype == query.dtype
        and query.shape[-1] % 8 == 0
    )


def attention_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention that also returns its log-sum-exp (to merge with the attention over another set of
    keys through :func:`merge_attention`).

    One fused attention call that returns its log-sum-exp (torch's memory-efficient kernel on CUDA, its flash
    kernel on the CPU) where :func:`_fused_lse_supported`, else :func:`attention_lse_reference`. The fused kernels
    accumulate in float32 and round the output to the inputs' dtype; the reference multiplies in float32 and casts
    every key to it first (several times slower). No host synchronisation: a CUDA graph can hold it.

    Args:
        query: ``[batch, kv_heads, group, head_dim]`` (the query heads of one KV head in the query-length
            dimension), compute device.
        keys: ``[batch, kv_heads, n, head_dim]``, same device and dtype.
        values: same shape, device and dtype as ``keys``.
        allowed: ``[batch, 1 or kv_heads, 1, n]``, ``torch.bool``; every query row must allow at least one key.
        scaling: softmax scale.

    Returns:
        ``(out, lse)``: ``[batch, kv_heads, group, head_dim]`` and ``[batch, kv_heads, group]``, float32.
    """
    if not _fused_lse_supported(query, keys) or (query.device.type, query.dtype) in _FUSED_LSE_FAILED:
        return attention_lse_reference(query, keys, values, allowed, scaling)
    try:
        return _fused_attention_lse(query, keys, values, allowed, scaling)
    except RuntimeError as error:
        if query.is_cuda and torch.cuda.is_current_stream_capturing():
            raise  # a failed call has invalidated the capture; the op-by-op run before it falls back
        _FUSED_LSE_FAILED.add((query.device.type, query.dtype))
        warnings.warn(f"attention_lse: the fused attention kernel failed on {query.device.type} for {query.dtype} "
                      f"({error}); using the float32 reference from now on.", RuntimeWarning, stacklevel=2)  # fmt: skip
        return attention_lse_reference(query, keys, values, allowed, scaling)


_FUSED_LSE_FAILED: set[tuple[str, torch.dtype]] = set()
"""Device types and dtypes where the fused kernel of :func:`attention_lse` raised once (the reference serves them)."""


def _fused_attention_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_lse` through torch's fused kernels (arguments and result as its)."""
    batch, heads, group, _ = query.shape
    n = keys.shape[-2]
    # An additive mask whose rows start 16-element aligned (what the memory-efficient kernel reads), broadcast over
    # heads and the query rows without a copy.
    padded = -(-n // 16) * 16
    bias = torch.zeros((*allowed.shape[:-1], padded), dtype=query.dtype, device=query.device)[..., :n]
    bias.masked_fill_(~allowed, float("-inf"))
    bias = bias.expand(batch, heads, group, n)
    if query.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, keys, values, bias, True, scale=scaling
        )[:2]
        lse = lse[..., :group]  # rows padded to the kernel's tile
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, keys, values, attn_mask=bias, scale=scaling
        )
    return out.float(), lse.float()


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over two disjoint sets of keys from the attention over each.

    Args:
        out_a: ``[..., head_dim]``, float32: attention output over the first set.
        lse_a: ``[...]``, float32: log-sum-exp of its logits (``-inf``: empty set).
        out_b: same shape as ``out_a``, the second set.
        lse_b: same shape as ``lse_a``.

    Returns:
        ``(out, lse)`` over the union, float32, same shapes; where both sets are empty, ``out_b`` and ``-inf``
        (the attention functions of this module give zeros for an empty set).

    Five operations (each a kernel on a GPU, where a decode step runs this once per layer): the share of the first
    set is ``exp(lse_a - lse)`` with ``lse = logaddexp(lse_a, lse_b)``, and the output interpolates between the
    two by it.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    share_a = torch.exp(lse_a - lse).nan_to_num_(0.0)  # both empty: -inf - -inf
    return torch.lerp(out_b, out_a, share_a[..., None]), lse


if triton is not None:

    @triton.jit
    def _tail_kernel(
        q_ptr,  # float32 [B, H, G, D], scaled
        kcodes_ptr,  # uint8 [B, cap, H, T, D // KPER]
        kmin_ptr,  # [B, cap, H, D]
        kstep_ptr,  # [B, cap, H, D]
        vcodes_ptr,  # uint8 [B, cap, H, T, D // VPER]
        vmin_ptr,  # [B, cap, H, D]
        vstep_ptr,  # [B, cap, H, D]
        ok_ptr,  # uint8 [B, N, T]: 1 = attend
        idx_ptr,  # int64 [B, N]: the summaries' block of each of the N blocks (read with HAS_INDEX only)
        o_ptr,  # float32 [B, H, S, G, D]: unnormalised partial outputs
        m_ptr,  # float32 [B, H, S, G]: partial maxima
        l_ptr,  # float32 [B, H, S, G]: partial denominators
        n_blocks,
        heads,
        splits,
        k_stride,  # blocks from one sequence's key summaries to the next's
        v_stride,  # the same for the value summaries
        G: tl.constexpr,
        GP: tl.constexpr,  # G rounded up to a power of two
        T: tl.constexpr,
        D: tl.constexpr,
        KBITS: tl.constexpr,
        VBITS: tl.constexpr,
        PER_PROGRAM: tl.constexpr,
        HAS_INDEX: tl.constexpr,  # block n is the summaries' block idx[b, n] (else block n itself)
    ):
        # One program: one (sequence, KV head) and PER_PROGRAM consecutive blocks; per block the keys and values
        # are decoded into [T, D] float32 tiles and folded into an online softmax of all G query heads.
        KPER: tl.constexpr = 8 // KBITS
        VPER: tl.constexpr = 8 // VBITS
        bh = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1).to(tl.int64)
        b = bh // heads
        h = bh % heads
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        t = tl.arange(0, T)
        q = tl.load(q_ptr + (bh * G + g)[:, None] * D + d[None, :], mask=(g < G)[:, None], other=0.0)
        m = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((GP,), dtype=tl.float32)
        o = tl.zeros((GP, D), dtype=tl.float32)
        for i in range(PER_PROGRAM):
            n = split * PER_PROGRAM + i
            if n < n_blocks:
                if HAS_INDEX:
                    blk = tl.load(idx_ptr + b * n_blocks + n)
                else:
                    blk = n
                krow = (b * k_stride + blk) * heads + h
                kmin = tl.load(kmin_ptr + krow * D + d).to(tl.float32)
                kstep = tl.load(kstep_ptr + krow * D + d).to(tl.float32)
                kbyte = tl.load(kcodes_ptr + (krow * T + t[:, None]) * (D // KPER) + (d // KPER)[None, :])
                kcode = (kbyte.to(tl.int32) >> ((d % KPER) * KBITS)[None, :]) & ((1 << KBITS) - 1)
                keys = kmin[None, :] + kcode.to(tl.float32) * kstep[None, :]  # [T, D]
                logits = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)  # [GP, T]
                ok = tl.load(ok_ptr + (b * n_blocks + n) * T + t) != 0
                logits = tl.where(ok[None, :], logits, float("-inf"))
                m_new = tl.maximum(m, tl.max(logits, axis=1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp(logits - shift[:, None])
                rescale = tl.exp(m - shift)
                vrow = (b * v_stride + blk) * heads + h
                vmin = tl.load(vmin_ptr + vrow * D + d).to(tl.float32)
                vstep = tl.load(vstep_ptr + vrow * D + d).to(tl.float32)
                vbyte = tl.load(vcodes_ptr + (vrow * T + t[:, None]) * (D // VPER) + (d // VPER)[None, :])
                vcode = (vbyte.to(tl.int32) >> ((d % VPER) * VBITS)[None, :]) & ((1 << VBITS) - 1)
                vals = vmin[None, :] + vcode.to(tl.float32) * vstep[None, :]  # [T, D]
                l = l * rescale + tl.sum(p, axis=1)
                o = o * rescale[:, None] + tl.sum(p[:, :, None] * vals[None, :, :], axis=1)
                m = m_new
        part = (bh * splits + split) * G + g
        live = g < G
        tl.store(o_ptr + part[:, None] * D + d[None, :], o, mask=live[:, None])
        tl.store(m_ptr + part, m, mask=live)
        tl.store(l_ptr + part, l, mask=live)

    @triton.jit
    def _tail_dot_kernel(
        q_ptr,  # float32 [B, H, G, D], scaled
        kcodes_ptr,  # uint8 [B, cap, H, T, D // KPER]
        kmin_ptr,  # [B, cap, H, D]
        kstep_ptr,  # [B, cap, H, D]
        vcodes_ptr,  # uint8 [B, cap, H, T, D // VPER]
        vmin_ptr,  # [B, cap, H, D]
        vstep_ptr,  # [B, cap, H, D]
        ok_ptr,  # uint8 [B, N, T]: 1 = attend
        idx_ptr,  # int64 [B, N]: the summaries' block of each of the N blocks (read with HAS_INDEX only)
        o_ptr,  # float32 [B, H, S, G, D]: unnormalised partial outputs
        m_ptr,  # float32 [B, H, S, G]: partial maxima
        l_ptr,  # float32 [B, H, S, G]: partial denominators
        n_blocks,
        heads,
        splits,
        k_stride,
        v_stride,
        G: tl.constexpr,
        GP: tl.constexpr,  # G rounded up to a power of two, at least 16 (the smallest matrix-product tile)
        T: tl.constexpr,
        D: tl.constexpr,
        KBITS: tl.constexpr,
        VBITS: tl.constexpr,
        PER_PROGRAM: tl.constexpr,  # a multiple of NB
        NB: tl.constexpr,  # blocks per iteration (NB * T rows, at least 16)
        PRECISION: tl.constexpr,  # tl.dot input precision: "tf32" or "ieee"
        HAS_INDEX: tl.constexpr,  # block n is the summaries' block idx[b, n] (else block n itself)
    ):
        # One program: one (sequence, KV head) and PER_PROGRAM consecutive blocks, NB blocks (R = NB * T token
        # rows) per iteration, as flash-decoding walks a KV range. The codes of a byte position p (channels
        # j * PER + p) form a [R, D / PER] tile: each is dequantized with its block's parameters (loaded once per
        # block, broadcast over its T rows) and multiplied with the matching channels of the queries by one
        # matrix product, so every code byte is loaded once and no reduction crosses threads outside tl.dot.
        KPER: tl.constexpr = 8 // KBITS
        VPER: tl.constexpr = 8 // VBITS
        KDB: tl.constexpr = D // KPER
        VDB: tl.constexpr = D // VPER
        R: tl.constexpr = NB * T
        bh = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1).to(tl.int64)
        b = bh // heads
        h = bh % heads
        g = tl.arange(0, GP)
        jk = tl.arange(0, KDB)
        jv = tl.arange(0, VDB)
        nb = tl.arange(0, NB)
        t = tl.arange(0, T)
        qs = ()
        for p in tl.static_range(KPER):
            qs = qs + (tl.load(q_ptr + (bh * G + g)[:, None] * D + (jk * KPER + p)[None, :], mask=(g < G)[:, None],
                               other=0.0),)  # fmt: skip
        accs = ()
        for p in tl.static_range(VPER):
            accs = accs + (tl.zeros((GP, VDB), dtype=tl.float32),)
        m = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l = tl.zeros((GP,), dtype=tl.float32)
        for it in range(PER_PROGRAM // NB):
            n = split * PER_PROGRAM + it * NB + nb  # [NB]
            live = n < n_blocks
            if HAS_INDEX:
                blk = tl.load(idx_ptr + b * n_blocks + n, mask=live, other=0)
            else:
                blk = n
            krow = (b * k_stride + blk) * heads + h
            kbyte = tl.load(kcodes_ptr + ((krow * T)[:, None, None] + t[None, :, None]) * KDB + jk[None, None, :],
                            mask=live[:, None, None], other=0).to(tl.int32)  # [NB, T, KDB]; fmt: skip
            logits = tl.zeros((GP, R), dtype=tl.float32)
            for p in tl.static_range(KPER):
                at = krow[:, None] * D + (jk * KPER + p)[None, :]  # [NB, KDB]
                kmin = tl.load(kmin_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
                kstep = tl.load(kstep_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
                code = ((kbyte >> (p * KBITS)) & ((1 << KBITS) - 1)).to(tl.float32)
                keys = tl.reshape(kmin[:, None, :] + code * kstep[:, None, :], (R, KDB))
                logits += tl.dot(qs[p], tl.trans(keys), input_precision=PRECISION)  # [GP, R]
            ok = tl.load(ok_ptr + (b * n_blocks + n)[:, None] * T + t[None, :], mask=live[:, None], other=0) != 0
            logits = tl.where(tl.reshape(ok, (R,))[None, :], logits, float("-inf"))
            m_new = tl.maximum(m, tl.max(logits, axis=1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            prob = tl.exp(logits - shift[:, None])
            rescale = tl.exp(m - shift)
            l = l * rescale + tl.sum(prob, axis=1)
            vrow = (b * v_stride + blk) * heads + h
            vbyte = tl.load(vcodes_ptr + ((vrow * T)[:, None, None] + t[None, :, None]) * VDB + jv[None, None, :],
                            mask=live[:, None, None], other=0).to(tl.int32)  # [NB, T, VDB]; fmt: skip
            new_accs = ()
            for p in tl.static_range(VPER):
                at = vrow[:, None] * D + (jv * VPER + p)[None, :]
                vmin = tl.load(vmin_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
                vstep = tl.load(vstep_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
                code = ((vbyte >> (p * VBITS)) & ((1 << VBITS) - 1)).to(tl.float32)
                vals = tl.reshape(vmin[:, None, :] + code * vstep[:, None, :], (R, VDB))
                new_accs = new_accs + (accs[p] * rescale[:, None] + tl.dot(prob, vals, input_precision=PRECISION),)
            accs = new_accs
            m = m_new
        part = (bh * splits + split) * G + g
        live_g = g < G
        for p in tl.static_range(VPER):
            tl.store(o_ptr + part[:, None] * D + (jv * VPER + p)[None, :], accs[p], mask=live_g[:, None])
        tl.store(m_ptr + part, m, mask=live_g)
        tl.store(l_ptr + part, l, mask=live_g)


def tail_kernel_supported(query: torch.Tensor, keys: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> bool:
    """Whether :func:`tail_attention` can run the kernel for these tensors: Triton on their device, power-of-two
    ``block_tokens`` and channels (the same for keys and values), parameters in a 16- or 32-bit float type, and
    summaries the kernel reads in place (see :func:`hf_offload.kernels.quantkey.summaries_layout_ok`)."""
    from .quantkey import summaries_layout_ok

    tokens, channels = keys["codes"].shape[3], query.shape[-1]
    return (
        kernels_available(query.device)
        and tokens & (tokens - 1) == 0
        and channels & (channels - 1) == 0
        and channels >= 8
        and keys["kmin"].shape[-1] == channels == values["kmin"].shape[-1]
        and all(t.dtype in (torch.bfloat16, torch.float16, torch.float32) for t in (keys["kmin"], values["kmin"]))
        and keys["kstep"].dtype == keys["kmin"].dtype
        and values["kstep"].dtype == values["kmin"].dtype
        and summaries_layout_ok(keys["codes"], keys["kmin"], keys["kstep"])
        and summaries_layout_ok(values["codes"], values["kmin"], values["kstep"])
    )


VARIANTS = ("mma", "dot", "loop")
"""Kernels :func:`tail_attention` can run: ``mma`` (the tensor-core CUDA kernel of :mod:`hf_offload.kernels.tail_mma`,
where :func:`~hf_offload.kernels.tail_mma.mma_supported` allows it), ``dot`` (Triton: matrix products over ``NB *
block_tokens`` rows at a time, where its tiles fit, see :func:`dot_kernel_fits`) and ``loop`` (Triton: one block at
a time, products as broadcast sums; where ``dot`` does not fit). Left to itself, :func:`tail_attention` takes the
first of them that can run."""


_RAN: set[str] = set()  # names of the estimates tail_partials ran since take_kernels_run(); read by eval_harness


def take_kernels_run() -> list[str]:
    """The estimates :func:`tail_partials` ran since the last call, sorted, and forget them: names of
    :data:`VARIANTS`, or ``"reference"`` for the torch reference. Under CUDA graphs a replay runs no Python, so
    what a graph replays counts once, when it was captured."""
    ran = sorted(_RAN)
    _RAN.clear()
    return ran


def dot_kernel_fits(tokens: int, channels: int, key_bits: int, value_bits: int) -> bool:
    """Whether the ``dot`` kernel's matrix-product tiles fit: at least 16 code bytes per key and per value row
    (``channels * bits / 8``; the inner size of a product, at least 16) and ``tokens`` at most 128 (one iteration's
    rows)."""
    return channels * key_bits // 8 >= 16 and channels * value_bits // 8 >= 16 and tokens <= 128


def _dot_rows_blocks(tokens: int) -> int:
    """Blocks the ``dot`` kernel walks per iteration: 64 token rows (at least one block, at least 16 rows)."""
    return max(1, 64 // tokens, -(-16 // tokens))


def tail_attention(
    query: torch.Tensor,
    keys: dict[str, torch.Tensor],
    key_bits: int,
    values: dict[str, torch.Tensor],
    value_bits: int,
    tokens_ok: torch.Tensor,
    softcap: float | None = None,
    chunk_blocks: int = 256,
    blocks_per_program: int = BLOCKS_PER_PROGRAM,
    variant: str | None = None,
    precision: str = "tf32",
    num_warps: int | None = None,
    num_stages: int | None = None,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tail_attention_reference`'s result, from one Triton launch where :func:`tail_kernel_supported` (and
    no ``softcap``), else from the reference itself. Arguments and result as the reference's (``chunk_blocks`` is
    used by the reference only), plus the kernel's settings:

    Args:
        index: the blocks to read, ``[batch, n]``, ``torch.int64``, same device: entry ``j`` of ``tokens_ok``
            (``[batch, n, block_tokens]``) is block ``index[b, j]`` of ``keys`` and ``values``, which then hold
            every block (``[batch, n_blocks, ...]``). The kernel reads the blocks where they are; the reference
            gathers them first. ``None``: ``keys`` and ``values`` are the ``n`` blocks themselves.
        blocks_per_program: blocks of one sequence and KV head one program walks (their partial softmaxes are merged
            in torch); the ``dot`` kernel rounds it up to whole iterations; not read by ``mma`` (one range per warp
            of :data:`hf_offload.kernels.tail_mma.BLOCKS_PER_WARP` blocks).
        variant: one of :data:`VARIANTS` (what the tests and benchmarks use to run one kernel); ``None``: the
            first that can run (``mma`` where :func:`~hf_offload.kernels.tail_mma.mma_supported`, else ``dot``
            where :func:`dot_kernel_fits`, else ``loop``). Asking for ``mma`` or ``dot`` where it cannot run raises
            ``ValueError``.
        precision: the ``dot`` kernel's matrix-product input precision: ``"tf32"`` (tensor cores; products of
            float32 inputs rounded to 10 mantissa bits, an error far below that of the 2-4-bit codes) or
            ``"ieee"`` (exact float32, as the reference).
        num_warps: warps per program; ``None``: Triton's default (4).
        num_stages: software-pipelining stages of the kernel's loop; ``None``: Triton's default.

    Allocates only its outputs and never waits for the device."""
    parts = tail_partials(query, keys, key_bits, values, value_bits, tokens_ok, softcap, chunk_blocks,
                          blocks_per_program, variant, precision, num_warps, num_stages, index)  # fmt: skip
    return merge_ranges(*parts) if len(parts) == 3 else parts


def tail_partials(
    query: torch.Tensor,
    keys: dict[str, torch.Tensor],
    key_bits: int,
    values: dict[str, torch.Tensor],
    value_bits: int,
    tokens_ok: torch.Tensor,
    softcap: float | None = None,
    chunk_blocks: int = 256,
    blocks_per_program: int = BLOCKS_PER_PROGRAM,
    variant: str | None = None,
    precision: str = "tf32",
    num_warps: int | None = None,
    num_stages: int | None = None,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`tail_attention` before its ranges are merged: ``(o, m, l)`` of the kernel's ranges (see
    :func:`merge_ranges`) where it runs the kernel, else the reference's ``(out, lse)``. Arguments as
    :func:`tail_attention`'s."""
    if index is not None and (index.shape != tokens_ok.shape[:2] or index.dtype != torch.int64):
        raise ValueError(f"tail_attention: index must be int64 of shape {tuple(tokens_ok.shape[:2])} (tokens_ok's "
                         f"first two sizes), got {index.dtype} {tuple(index.shape)}")  # fmt: skip
    if softcap is not None or not tail_kernel_supported(query, keys, values):
        if index is not None:
            rows = torch.arange(index.shape[0], device=index.device)[:, None]
            keys = {name: take_blocks(t, index, rows) for name, t in keys.items()}
            values = {name: take_blocks(t, index, rows) for name, t in values.items()}
        _RAN.add("reference")
        return tail_attention_reference(query, keys, key_bits, values, value_bits, tokens_ok, softcap, chunk_blocks)
    from .quantkey import block_stride

    batch, heads, group, channels = query.shape
    n, tokens = tokens_ok.shape[1], tokens_ok.shape[2]
    from . import tail_mma

    fits = dot_kernel_fits(tokens, channels, key_bits, value_bits)
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"tail_attention: unknown variant {variant!r}; expected one of {VARIANTS}")
    if precision not in ("tf32", "ieee"):
        raise ValueError(f"tail_attention: precision must be 'tf32' or 'ieee', not {precision!r}")
    wanted = variant or "mma"
    if wanted == "mma":
        if tail_mma.mma_supported(query, keys, key_bits, values, value_bits, index is not None):
            strides = (0, 0) if n == 0 else (block_stride(keys["codes"], keys["kmin"], keys["kstep"]),
                                             block_stride(values["codes"], values["kmin"], values["kstep"]))
            _RAN.add("mma")
            return tail_mma.launch(query.float().contiguous(), keys, key_bits, values, value_bits, tokens_ok, index,
                                   *strides)  # fmt: skip
        if variant == "mma":
            raise ValueError("tail_attention: the 'mma' kernel needs CUDA (compute capability 9.0+, NVRTC), 2- or "
                             "4-bit keys and values, 16-token blocks, head_dim 64, 128 or 256, at most 8 query heads "
                             "per KV head and bfloat16 summaries; use variant=None to fall back")  # fmt: skip
        wanted = "dot"
    variant = "loop" if wanted == "dot" and not fits and variant is None else wanted  # the default falls back
    if variant == "dot" and not fits:
        raise ValueError(f"tail_attention: the 'dot' kernel needs >= 16 code bytes per key and value row and "
                         f"block_tokens <= 128 (got {channels} channels at {key_bits}/{value_bits} bits, "
                         f"{tokens} tokens); use variant='loop' or None")  # fmt: skip
    _RAN.add(variant)
    if n == 0:
        return (torch.zeros((batch, heads, 1, group, channels), dtype=torch.float32, device=query.device),
                torch.full((batch, heads, 1, group), float("-inf"), dtype=torch.float32, device=query.device),
                torch.zeros((batch, heads, 1, group), dtype=torch.float32, device=query.device))  # fmt: skip
    per_step = _dot_rows_blocks(tokens) if variant == "dot" else 1
    per_program = -(-max(1, blocks_per_program) // per_step) * per_step
    splits = -(-n // per_program)
    o = torch.empty((batch, heads, splits, group, channels), dtype=torch.float32, device=query.device)
    m = torch.empty((batch, heads, splits, group), dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    ok = tokens_ok.contiguous().view(torch.uint8)
    idx = index.contiguous() if index is not None else ok  # not read without an index
    args = (query.float().contiguous(), keys["codes"], keys["kmin"], keys["kstep"], values["codes"], values["kmin"],
            values["kstep"], ok, idx, o, m, l, n, heads, splits,
            block_stride(keys["codes"], keys["kmin"], keys["kstep"]),
            block_stride(values["codes"], values["kmin"], values["kstep"]))  # fmt: skip
    launch = {name: v for name, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    if variant == "dot":
        _tail_dot_kernel[(batch * heads, splits)](
            *args, G=group, GP=max(16, 1 << (group - 1).bit_length()), T=tokens, D=channels, KBITS=key_bits,
            VBITS=value_bits, PER_PROGRAM=per_program, NB=per_step, PRECISION=precision, HAS_INDEX=index is not None,
            **launch,
        )  # fmt: skip
    else:
        _tail_kernel[(batch * heads, splits)](
            *args, G=group, GP=1 << (group - 1).bit_length(), T=tokens, D=channels, KBITS=key_bits, VBITS=value_bits,
            PER_PROGRAM=per_program, HAS_INDEX=index is not None, **launch,
        )  # fmt: skip
    return o, m, l


def merge_ranges(o: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax from the kernel's per-range partial softmaxes.

    Args:
        o: ``[batch, kv_heads, splits, group, channels]``, float32: each range's unnormalised output.
        m: ``[batch, kv_heads, splits, group]``, float32: each range's largest logit (``-inf``: nothing attended).
        l: same shape: each range's sum of exponentials relative to ``m`` (0: nothing attended).

    Returns:
        ``(out, lse)``, ``[batch, kv_heads, group, channels]`` and ``[batch, kv_heads, group]``, float32: ``lse =
        log sum_s exp(m_s) l_s`` and ``out = sum_s exp(m_s - lse) o_s``; where nothing is attended at all, ``lse`` is
        ``-inf`` and the weights (``-inf - -inf``) become 0, so ``out`` is 0.
    """
    lse = torch.logsumexp(m + torch.log(l), dim=2)  # [B, H, G]
    weight = torch.exp(m - lse[:, :, None]).nan_to_num_(0.0)  # [B, H, S, G]
    return (o * weight[..., None]).sum(dim=2), lse


def with_far_mass(lse_t: torch.Tensor, block_lse: torch.Tensor, far: torch.Tensor) -> torch.Tensor:
    """The estimate's log-sum-exp with the mass of the blocks counted by their scoring log-sum-exps alone.

    Args:
        lse_t: the estimate's log-sum-exp over the blocks it took token by token, ``[batch, kv_heads, group]``,
            float32; where it is infinite there is no estimate to value the far blocks at, and they add nothing.
        block_lse: ``[batch, kv_heads, group, n]``, float32, the scoring's block log-sum-exps.
        far: ``[batch, n]``, ``torch.bool``: the blocks to add.

    Returns:
        ``[batch, kv_heads, group]``, float32.
    """
    far_lse = block_lse.masked_fill(~far[:, None, None, :], float("-inf")).logsumexp(-1)
    far_lse = far_lse.masked_fill(torch.isinf(lse_t), float("-inf"))  # no estimate to value them at
    return torch.logaddexp(lse_t, far_lse)


def far_midpoints(values: dict[str, torch.Tensor], value_bits: int) -> torch.Tensor:
    """Each block's value estimate for the far blocks of ``tail_far="mid"``: per KV head and channel the midpoint of
    the block's quantized value range, ``vmin + vstep * (2**bits - 1) / 2``, ``[batch, n, kv_heads, channels]``,
    float32 (from the summaries alone: no code is read).

    Args:
        values: ``codes`` / ``kmin`` / ``kstep`` of the values (``kmin`` / ``kstep`` ``[batch, n, kv_heads,
            channels]``).
        value_bits: the bits of the value codes.
    """
    return values["kmin"].float() + values["kstep"].float() * (((1 << value_bits) - 1) / 2)


def with_far_values(
    out_t: torch.Tensor, lse_t: torch.Tensor, block_lse: torch.Tensor, far: torch.Tensor, far_values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimate ``(out_t, lse_t)`` merged with the far blocks, each weighted by its scoring log-sum-exp and valued
    at its own ``far_values`` (:func:`far_midpoints`); the far blocks count where there is no estimate too.

    Args:
        out_t: ``[batch, kv_heads, group, head_dim]``, float32.
        lse_t: ``[batch, kv_heads, group]``, float32 (``-inf``: nothing estimated token by token).
        block_lse: ``[batch, kv_heads, group, n]``, float32.
        far: ``[batch, n]``, ``torch.bool``.
        far_values: ``[batch, n, kv_heads, channels >= head_dim]``, float32.

    Returns:
        ``(out, lse)`` over both, float32, shapes of ``out_t`` and ``lse_t``.
    """
    blse = block_lse.masked_fill(~far[:, None, None, :], float("-inf"))
    far_lse = blse.logsumexp(-1)  # [B, H, G]
    weight = torch.exp(blse - far_lse[..., None]).nan_to_num_(0.0)  # no far block: -inf - -inf
    out_f = torch.einsum("bhgn,bnhd->bhgd", weight, far_values[..., : out_t.shape[-1]].float())
    return merge_attention(out_f, far_lse, out_t, lse_t)


def finish_tail_reference(
    out_t: torch.Tensor,
    lse_t: torch.Tensor,
    selection_out: torch.Tensor,
    selection_lse: torch.Tensor,
    block_lse: torch.Tensor | None = None,
    far: torch.Tensor | None = None,
    far_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimate of the unselected blocks completed and merged with the selection's attention, in torch.

    Args:
        out_t: the estimate's output over the blocks taken token by token, ``[batch, kv_heads, group, channels]``,
            float32 (``channels >= head_dim``: the padding channels are dropped).
        lse_t: its log-sum-exp, ``[batch, kv_heads, group]``, float32 (``-inf``: nothing estimated).
        selection_out: the exact attention over the selection, ``[batch, kv_heads, group, head_dim]``, float32.
        selection_lse: its log-sum-exp, ``[batch, kv_heads, group]``, float32.
        block_lse: with ``far``: per-block log-sum-exps of the scoring, ``[batch, kv_heads, group, n]`` (any row
            stride), float32; the blocks marked in ``far`` count by them, valued at ``out_t``.
        far: ``[batch, n]``, ``torch.bool``: blocks counted by their mass alone (none where ``lse_t`` is infinite:
            no estimate to value them at).
        far_values: ``[batch, n, kv_heads, channels]``, float32: each far block valued at its own row instead of
            at ``out_t`` (:func:`with_far_values`); ``None``: at ``out_t``.

    Returns:
        ``(out, lse)``: the one softmax over selection and estimate, ``[batch, kv_heads, group, head_dim]``, float32,
        and the estimate's log-sum-exp with the far blocks' mass, ``[batch, kv_heads, group]``, float32.
    """
    out_t = out_t[..., : selection_out.shape[-1]]
    if block_lse is not None and far_values is not None:
        out_t, lse_t = with_far_values(out_t, lse_t, block_lse, far, far_values)
    elif block_lse is not None:
        lse_t = with_far_mass(lse_t, block_lse, far)
    out, _ = merge_attention(selection_out, selection_lse, out_t, lse_t)
    return out, lse_t


FAR_MID_SPLIT_N = 256
"""Far blocks per program of the midpoint partials (``tail_far="mid"``): the far blocks of one sequence and KV head
are split over programs of this many, so that a small batch still spreads the pass over the whole context across the
GPU (one program per KV head would leave most of it idle), and the finish merges their partials."""

FAR_MID_BLOCK_N = 16
"""Far blocks per step of a midpoint-partials program (a ``[16, head_dim]`` tile of minima and steps, weighted for
every query head of the KV head at once)."""

FINISH_BLOCK_N = 4096
"""Most far blocks per step of the merged estimate's loop over them (one program per sequence and query head; the
steps of such a loop wait on each other, see :data:`hf_offload.kernels.mass.STATS_BLOCK_N`)."""

if triton is not None:

    @triton.jit
    def _logaddexp(a, b):
        top = tl.maximum(a, b)
        safe = tl.where(top == float("-inf"), 0.0, top)
        r = safe + tl.log(tl.exp(a - safe) + tl.exp(b - safe))
        return tl.where(top == float("-inf"), float("-inf"), r)

    @triton.jit
    def _merge_parts(m_ptr, l_ptr, o_ptr, row, live, c, live_c, o_stride):
        """Partial softmaxes ``row`` (``live`` of them) merged: their maximum, then sums relative to it; returns the
        log-sum-exp (``-inf`` where nothing was attended) and the normalised output (0 there)."""
        m_s = tl.load(m_ptr + row, mask=live, other=float("-inf"))
        l_s = tl.load(l_ptr + row, mask=live, other=0.0)
        top = tl.max(m_s, axis=0)
        safe = tl.where(top == float("-inf"), 0.0, top)
        w = tl.exp(m_s - safe)  # 0 for a part with nothing attended
        total = tl.sum(l_s * w, axis=0)
        o_s = tl.load(o_ptr + row[:, None] * o_stride + c[None, :], mask=live[:, None] & live_c[None, :], other=0.0)
        acc = tl.sum(o_s * w[:, None], axis=0)
        some = total > 0
        lse = tl.where(some, top + tl.log(tl.where(some, total, 1.0)), float("-inf"))
        return lse, tl.where(some, acc / tl.where(some, total, 1.0), 0.0)

    @triton.jit(do_not_specialize=["splits", "n_blocks", "blse_row", "fsplits"])
    def _finish_kernel(
        o_ptr,  # float32 [B, H, S, G, C]: the ranges' unnormalised outputs
        m_ptr,  # float32 [B, H, S, G]
        l_ptr,  # float32 [B, H, S, G]
        sel_o_ptr,  # float32 [B, H, G, D]: the selection's attention
        sel_lse_ptr,  # float32 [B, H, G]
        blse_ptr,  # float32 [B, H, G, blse_row]: block log-sum-exps (read where HAS_FAR)
        far_ptr,  # uint8 [B, n_blocks]
        fo_ptr,  # float32 [B, H, FS, G, DP]: the far blocks' partial unnormalised outputs (read where FAR_MID)
        fm_ptr,  # float32 [B, H, FS, G]
        fl_ptr,  # float32 [B, H, FS, G]
        fsplits,
        out_ptr,  # [B, H, G, D], the output dtype
        lse_ptr,  # float32 [B, H, G]: the estimate's log-sum-exp with the far mass
        heads,
        splits,
        n_blocks,
        blse_row,
        G: tl.constexpr,
        C: tl.constexpr,
        D: tl.constexpr,
        DP: tl.constexpr,
        SPLITS: tl.constexpr,  # a power of two >= splits
        HAS_FAR: tl.constexpr,
        FAR_MID: tl.constexpr,  # far blocks valued at their value ranges' midpoints (_far_mid_kernel's partials)
        FSPLITS: tl.constexpr,  # a power of two >= fsplits
        BLOCK_N: tl.constexpr,
        STEPS: tl.constexpr,  # a power of two >= cdiv(n_blocks, BLOCK_N)
    ):
        # One program per (sequence, KV head, query head): row bhg of the [B, H, G] outputs.
        bhg = tl.program_id(0).to(tl.int64)
        bh = bhg // G
        g = bhg - bh * G
        b = bh // heads
        c = tl.arange(0, DP)
        live_c = c < D
        # The ranges merged at once.
        s = tl.arange(0, SPLITS)
        row = (bh * splits + s) * G + g
        lse_t, out_t = _merge_parts(m_ptr, l_ptr, o_ptr, row, s < splits, c, live_c, C)
        if FAR_MID:
            # The far blocks' partials, merged the same way, then one more softmax part, counted with or without an
            # estimate.
            fs = tl.arange(0, FSPLITS)
            frow = (bh * fsplits + fs) * G + g
            far_lse, far_out = _merge_parts(fm_ptr, fl_ptr, fo_ptr, frow, fs < fsplits, c, live_c, DP)
            lse_n = _logaddexp(lse_t, far_lse)
            w_t = tl.where(lse_n == float("-inf"), 0.0, tl.exp(lse_t - lse_n))
            w_f = tl.where(lse_n == float("-inf"), 0.0, tl.exp(far_lse - lse_n))
            out_t = out_t * w_t + far_out * w_f
            lse_t = lse_n
        elif HAS_FAR:
            f_top = tl.full([], float("-inf"), tl.float32)
            f_total = tl.full([], 0.0, tl.float32)
            for step in range(STEPS):
                n = step * BLOCK_N + tl.arange(0, BLOCK_N)
                live = n < n_blocks
                far = tl.load(far_ptr + b * n_blocks + n, mask=live, other=0) != 0
                x = tl.load(blse_ptr + bhg * blse_row + n, mask=live & far, other=float("-inf"))
                new = tl.maximum(f_top, tl.max(x, axis=0))
                safe = tl.where(new == float("-inf"), 0.0, new)
                f_total = f_total * tl.exp(f_top - safe) + tl.sum(tl.exp(x - safe), axis=0)
                f_top = new
            f_some = f_total > 0
            far_lse = tl.where(f_some, f_top + tl.log(tl.where(f_some, f_total, 1.0)), float("-inf"))
            finite = (lse_t != float("-inf")) & (lse_t != float("inf"))
            lse_t = _logaddexp(lse_t, tl.where(finite, far_lse, float("-inf")))
        sel_lse = tl.load(sel_lse_ptr + bhg)
        sel_o = tl.load(sel_o_ptr + bhg * D + c, mask=live_c, other=0.0)
        lse = _logaddexp(sel_lse, lse_t)
        share = tl.where(lse == float("-inf"), 0.0, tl.exp(sel_lse - lse))
        tl.store(out_ptr + bhg * D + c, out_t + share * (sel_o - out_t), mask=live_c)
        tl.store(lse_ptr + bhg, lse_t)


if triton is not None:

    @triton.jit(do_not_specialize=["n_blocks", "blse_row", "fsplits"])
    def _far_mid_kernel(
        blse_ptr,  # float32 [B, H, G, blse_row]: block log-sum-exps
        far_ptr,  # uint8 [B, n_blocks]
        vmin_ptr,  # [B, cap, H, C] value minima
        vstep_ptr,  # [B, cap, H, C] value steps
        v_batch_stride,
        v_block_stride,
        half_levels,
        fo_ptr,  # float32 [B, H, FS, G, DP]: out, the far blocks' unnormalised outputs per split
        fm_ptr,  # float32 [B, H, FS, G]: out, their running maxima
        fl_ptr,  # float32 [B, H, FS, G]: out, their sums
        heads,
        n_blocks,
        blse_row,
        fsplits,
        G: tl.constexpr,
        GP: tl.constexpr,  # a power of two >= G
        C: tl.constexpr,
        D: tl.constexpr,
        DP: tl.constexpr,
        PER_SPLIT: tl.constexpr,  # far blocks per program, a multiple of BLOCK_N
        BLOCK_N: tl.constexpr,
    ):
        # One program per (sequence and KV head, split): every query head of the KV head weights the same tile of
        # midpoints, which is read once.
        bh = tl.program_id(0).to(tl.int64)
        sp = tl.program_id(1)
        b = bh // heads
        h = bh - b * heads
        g = tl.arange(0, GP)
        live_g = g < G
        c = tl.arange(0, DP)
        live_c = c < D
        top = tl.full([GP], float("-inf"), tl.float32)
        total = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, DP], dtype=tl.float32)
        for step in range(PER_SPLIT // BLOCK_N):
            n = sp * PER_SPLIT + step * BLOCK_N + tl.arange(0, BLOCK_N)
            ok = n < n_blocks
            ok = ok & (tl.load(far_ptr + b * n_blocks + n, mask=ok, other=0) != 0)
            x = tl.load(blse_ptr + (bh * G + g[:, None]) * blse_row + n[None, :], mask=live_g[:, None] & ok[None, :],
                        other=float("-inf"))  # fmt: skip
            new = tl.maximum(top, tl.max(x, axis=1))
            safe = tl.where(new == float("-inf"), 0.0, new)
            scale = tl.exp(top - safe)
            p = tl.exp(x - safe[:, None])  # [GP, BLOCK_N], 0 where not far
            total = total * scale + tl.sum(p, axis=1)
            at = b * v_batch_stride + n[:, None].to(tl.int64) * v_block_stride + h * C + c[None, :]
            vm = ok[:, None] & live_c[None, :]
            mid = (
                tl.load(vmin_ptr + at, mask=vm, other=0.0).to(tl.float32)
                + tl.load(vstep_ptr + at, mask=vm, other=0.0).to(tl.float32) * half_levels
            )  # [BLOCK_N, DP]
            acc = acc * scale[:, None] + tl.sum(p[:, :, None] * mid[None, :, :], axis=1)
            top = new
        row = (bh * fsplits + sp) * G + g
        tl.store(fm_ptr + row, top, mask=live_g)
        tl.store(fl_ptr + row, total, mask=live_g)
        tl.store(fo_ptr + row[:, None] * DP + c[None, :], acc, mask=live_g[:, None])


def tail_attention_merged(
    query: torch.Tensor,
    keys: dict[str, torch.Tensor],
    key_bits: int,
    values: dict[str, torch.Tensor],
    value_bits: int,
    tokens_ok: torch.Tensor,
    selection_out: torch.Tensor,
    selection_lse: torch.Tensor,
    index: torch.Tensor | None = None,
    block_lse: torch.Tensor | None = None,
    far: torch.Tensor | None = None,
    softcap: float | None = None,
    out_dtype: torch.dtype = torch.float32,
    far_mid: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tail_attention`, completed by the far blocks' mass and merged with the selection's attention
    (:func:`finish_tail_reference`): where the estimate's kernel runs, the merge of its ranges, the far blocks'
    log-sum-exp and the merge with the selection are one more launch (instead of dozens of small torch kernels).

    Args:
        query, keys, key_bits, values, value_bits, tokens_ok, index, softcap: as :func:`tail_attention`'s.
        selection_out: the exact attention over the selection, ``[batch, kv_heads, group, head_dim]``, float32.
        selection_lse: its log-sum-exp, ``[batch, kv_heads, group]``, float32.
        block_lse: ``[batch, kv_heads, group, n]``, float32, last dimension contiguous, and ``far``
            (``[batch, n]``, ``torch.bool``): blocks counted by their mass alone (see
            :func:`finish_tail_reference`); both or neither.
        out_dtype: dtype of the merged output.
        far_mid: with ``far``: each far block valued at the midpoint of its quantized value range
            (:func:`far_midpoints`, read from ``values``' ``kmin`` / ``kstep``) instead of at the estimate's output.

    Returns:
        ``(out, lse)``: ``[batch, kv_heads, group, head_dim]`` in ``out_dtype`` and the estimate's log-sum-exp
        ``[batch, kv_heads, group]``, float32. Never waits for the device.
    """
    if (block_lse is None) != (far is None):
        raise ValueError("tail_attention_merged: pass block_lse and far together (the far blocks and their "
                         "log-sum-exps), or neither")  # fmt: skip
    parts = tail_partials(query, keys, key_bits, values, value_bits, tokens_ok, softcap, index=index)
    batch, heads, group, head_dim = selection_out.shape
    n = 0 if far is None else far.shape[-1]
    mid = far_mid and far is not None
    vmin, vstep = values["kmin"], values["kstep"]
    fused = len(parts) == 3 and (far is None or (block_lse.stride(-1) == 1 and block_lse.shape[-1] == n))
    fused = fused and (not mid or (vmin.stride() == vstep.stride() and vmin.stride(3) == 1
                                   and vmin.stride(2) == vmin.shape[3]))  # fmt: skip
    if not fused:
        out_t, lse_t = merge_ranges(*parts) if len(parts) == 3 else parts
        far_values = far_midpoints(values, value_bits) if mid else None
        out, lse_t = finish_tail_reference(out_t, lse_t, selection_out, selection_lse, block_lse, far, far_values)
        return out.to(out_dtype), lse_t
    o, m, l = parts
    splits, channels = o.shape[2], o.shape[-1]
    out = torch.empty((batch, heads, group, head_dim), dtype=out_dtype, device=o.device)
    lse_t = torch.empty((batch, heads, group), dtype=torch.float32, device=o.device)
    sel_o, sel_lse = selection_out.float().contiguous(), selection_lse.float().contiguous()
    if far is None:
        blse, far_u8, row, step = lse_t, lse_t, 1, 1  # not read
    else:
        blse, far_u8, row = block_lse, far.contiguous().view(torch.uint8), block_lse.stride(-2)
        if block_lse.stride(0) != heads * group * row or block_lse.stride(1) != group * row:
            blse = block_lse.contiguous()
            row = n
        step = min(FINISH_BLOCK_N, triton.next_power_of_2(max(1, n)))
    dp = triton.next_power_of_2(head_dim)
    fsplits = 1
    if mid:
        per_split = max(FAR_MID_BLOCK_N, min(FAR_MID_SPLIT_N, triton.next_power_of_2(max(1, n))))
        fsplits = triton.cdiv(max(1, n), per_split)
        fo = torch.empty((batch, heads, fsplits, group, dp), dtype=torch.float32, device=o.device)
        fm = torch.empty((batch, heads, fsplits, group), dtype=torch.float32, device=o.device)
        fl = torch.empty_like(fm)
        _far_mid_kernel[(batch * heads, fsplits)](
            blse, far_u8, vmin, vstep, vmin.stride(0), vmin.stride(1), ((1 << value_bits) - 1) / 2, fo, fm, fl,
            heads, n, row, fsplits, G=group, GP=triton.next_power_of_2(group), C=vmin.shape[3], D=head_dim, DP=dp,
            PER_SPLIT=per_split, BLOCK_N=FAR_MID_BLOCK_N,
        )  # fmt: skip
    else:
        fo = fm = fl = lse_t  # not read
    _finish_kernel[(batch * heads * group,)](
        o, m, l, sel_o, sel_lse, blse, far_u8, fo, fm, fl, fsplits, out, lse_t, heads, splits, n, row,
        G=group, C=channels, D=head_dim, DP=dp, SPLITS=triton.next_power_of_2(splits), HAS_FAR=far is not None,
        FAR_MID=mid, FSPLITS=triton.next_power_of_2(fsplits), BLOCK_N=step,
        STEPS=triton.next_power_of_2(triton.cdiv(max(1, n), step)),
    )  # fmt: skip
    return out, lse_t


def tail_plan_reference(
    rows: torch.Tensor, blocks: torch.Tensor, keep: torch.Tensor, index: torch.Tensor, scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which tokens the bounded estimate takes token by token, and which blocks count by their mass, in torch.

    Args:
        rows: tokens the query may attend, ``[batch, n, block_tokens]``, ``torch.bool``, compute device.
        blocks: the selection, ``[batch, k]``, ``torch.int64``; ``keep`` (same shape, ``torch.bool``): which of
            them are attended (the others are left to the estimate).
        index: the near blocks, ``[batch, near]``, ``torch.int64`` (unselected blocks of highest score).
        scores: the selection's block scores, ``[batch, n]``, float32 (``-inf``: may not be attended).

    Returns:
        ``(near_ok, far)``: the near blocks' tokens to estimate, ``[batch, near, block_tokens]``, ``torch.bool``
        (none where the block's score is ``-inf`` or the selection keeps it), and the far blocks, ``[batch, n]``,
        ``torch.bool``: every token attendable, neither kept by the selection nor near.
    """
    n = rows.shape[1]
    chosen = torch.zeros((rows.shape[0], n + 1), dtype=torch.bool, device=rows.device)
    chosen.scatter_(1, torch.where(keep, blocks, n), True)
    tail = rows & ~chosen[:, :n, None]
    live = scores.gather(1, index) > float("-inf")
    near_ok = tail[torch.arange(rows.shape[0], device=rows.device)[:, None], index] & live[:, :, None]
    return near_ok, tail.all(dim=-1).scatter(1, index, False)


PLAN_PROGRAMS = 128
"""Programs the plan kernel aims at over the whole batch. Each program owns a range of one sequence's blocks:
``batch * n / PLAN_PROGRAMS`` blocks rounded up to a power of two, at least :data:`PLAN_MIN_BLOCKS` and at most the
whole sequence; so a small batch spreads the pass over its token masks across many programs, and a large one keeps
one or a few ranges per sequence."""

PLAN_MIN_BLOCKS = 256
"""Fewest blocks in one range of the plan kernel (rounded up to a power of two), unless the sequence has fewer."""

PLAN_BLOCK_N = 2048
"""Blocks per step of the plan kernel's pass over a range's token masks (a power of two; a range smaller than this
is one step)."""

PLAN_NEAR_BLOCK = 64
"""Near blocks per step of the plan kernel's membership test against the selection."""

if triton is not None:

    @triton.jit(do_not_specialize=["n", "k", "near"])
    def _tail_plan_kernel(
        rows_ptr,  # uint8 [B, n, T] (strides rows_sb, rows_sn, 1)
        blocks_ptr,  # int64 [B, k] (stride blocks_sb, 1)
        keep_ptr,  # uint8 [B, k] (stride keep_sb, 1)
        idx_ptr,  # int64 [B, near] (stride idx_sb, 1)
        scores_ptr,  # float32 [B, n] (stride scores_sb, 1)
        far_ptr,  # uint8 [B, n], written
        near_ok_ptr,  # uint8 [B, near, T], written
        rows_sb,
        rows_sn,
        blocks_sb,
        keep_sb,
        idx_sb,
        scores_sb,
        n,
        k,
        near,
        T: tl.constexpr,
        RANGE_N: tl.constexpr,  # blocks of one program's range: program (b, p) owns far[b, p * RANGE_N:][:RANGE_N]
        BLOCK_N: tl.constexpr,  # divides RANGE_N
        KP: tl.constexpr,  # a power of two >= k
        NEAR_BLOCK: tl.constexpr,
        NEAR_STEPS: tl.constexpr,  # a power of two >= cdiv(near, NEAR_BLOCK)
        OWN_STEPS: tl.constexpr,  # a power of two >= cdiv(cdiv(near, NEAR_BLOCK), ranges)
    ):
        b = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1)
        ranges = tl.num_programs(1)
        lo = p * RANGE_N
        t = tl.arange(0, T)
        # Every block of the range whose tokens are all attendable, first.
        for step in range(RANGE_N // BLOCK_N):
            j = lo + step * BLOCK_N + tl.arange(0, BLOCK_N)
            live = j < n
            r = tl.load(rows_ptr + b * rows_sb + j[:, None] * rows_sn + t[None, :], mask=live[:, None], other=0)
            tl.store(far_ptr + b * n + j, (tl.min(r, axis=1) != 0).to(tl.uint8), mask=live)
        kk = tl.arange(0, KP)
        in_k = kk < k
        kept = in_k & (tl.load(keep_ptr + b * keep_sb + kk, mask=in_k, other=0) != 0)
        blk = tl.where(kept, tl.load(blocks_ptr + b * blocks_sb + kk, mask=in_k, other=0), n)  # n: none
        # The near blocks' tokens: the ranges of the sequence share its steps of near blocks.
        for step in range(OWN_STEPS):
            jn = (step * ranges + p) * NEAR_BLOCK + tl.arange(0, NEAR_BLOCK)
            in_near = jn < near
            idx = tl.load(idx_ptr + b * idx_sb + jn, mask=in_near, other=0)
            score = tl.load(scores_ptr + b * scores_sb + idx, mask=in_near, other=float("-inf"))
            chosen = tl.max((idx[:, None] == blk[None, :]).to(tl.int32), axis=1) > 0
            ok = in_near & (score > float("-inf")) & (chosen == 0)
            r = tl.load(rows_ptr + b * rows_sb + idx[:, None] * rows_sn + t[None, :], mask=ok[:, None], other=0)
            tl.store(near_ok_ptr + (b * near + jn)[:, None] * T + t[None, :], (r != 0).to(tl.uint8),
                     mask=in_near[:, None])  # fmt: skip
        # Kept and near blocks are not far: stores over the first pass's, each by the program that owns the entry.
        tl.debug_barrier()  # the stores below overwrite some of the pass's (other threads' entries)
        tl.store(far_ptr + b * n + blk, tl.zeros([KP], tl.uint8), mask=kept & (blk >= lo) & (blk < lo + RANGE_N))
        for step in range(NEAR_STEPS):
            jn = step * NEAR_BLOCK + tl.arange(0, NEAR_BLOCK)
            idx = tl.load(idx_ptr + b * idx_sb + jn, mask=jn < near, other=n)  # n: none
            tl.store(far_ptr + b * n + idx, tl.zeros([NEAR_BLOCK], tl.uint8),
                     mask=(idx >= lo) & (idx < lo + RANGE_N) & (idx < n))  # fmt: skip


def tail_plan(
    rows: torch.Tensor, blocks: torch.Tensor, keep: torch.Tensor, index: torch.Tensor, scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tail_plan_reference` in one launch where Triton runs on ``rows``' device; the same result. Each
    program owns a range of one sequence's blocks (:data:`PLAN_PROGRAMS`, :data:`PLAN_MIN_BLOCKS`): it writes their
    ``far`` entries from the token masks, then zeroes those of the kept and near blocks in its range, and finds the
    tokens of its share of the near blocks. Arguments and result as the reference's (any strides with the last
    dimension contiguous; ``rows``' ``block_tokens`` a power of two). Allocates only its results and never waits for
    the device."""
    batch, n, tokens = rows.shape
    k, near = blocks.shape[-1], index.shape[-1]
    if (not kernels_available(rows.device) or tokens & (tokens - 1) or n == 0
            or any(x.stride(-1) != 1 for x in (rows, blocks, keep, index, scores))):  # fmt: skip
        return tail_plan_reference(rows, blocks, keep, index, scores)
    far = torch.empty((batch, n), dtype=torch.bool, device=rows.device)
    near_ok = torch.empty((batch, near, tokens), dtype=torch.bool, device=rows.device)
    if batch == 0:
        return near_ok, far
    wanted = max(PLAN_MIN_BLOCKS, triton.cdiv(batch * n, PLAN_PROGRAMS))
    per = triton.next_power_of_2(min(n, wanted))  # blocks of one range
    step = min(PLAN_BLOCK_N, per)
    ranges = triton.cdiv(n, per)
    near_steps = triton.cdiv(near, PLAN_NEAR_BLOCK)
    _tail_plan_kernel[(batch, ranges)](
        rows.view(torch.uint8), blocks, keep.view(torch.uint8), index, scores, far.view(torch.uint8),
        near_ok.view(torch.uint8), rows.stride(0), rows.stride(1), blocks.stride(0), keep.stride(0), index.stride(0),
        scores.stride(0), n, k, near, T=tokens, RANGE_N=per, BLOCK_N=step, KP=triton.next_power_of_2(max(1, k)),
        NEAR_BLOCK=PLAN_NEAR_BLOCK, NEAR_STEPS=triton.next_power_of_2(max(1, near_steps)),
        OWN_STEPS=triton.next_power_of_2(max(1, triton.cdiv(near_steps, ranges))),
        num_warps=8 if step * tokens >= 16384 else 4,
    )  # fmt: skip
    return near_ok, far
