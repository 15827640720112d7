"""Low-bit block quantization and block gathers: the layout every quantized-key kernel reads (pure torch).

A block's keys (or values) are quantized per (sequence, block, KV head, channel): one minimum ``kmin`` and one step
``kstep`` over the block's tokens, codes of ``bits`` bits on the grid ``kmin + code * kstep``, packed ``8 // bits``
to a byte, the code of channel ``PER * j + p`` at bit ``bits * p`` of byte ``j`` (``PER = 8 // bits``).
Per-channel parameters because keys vary per channel (KIVI's key layout).

Layout (``channels``: ``head_dim`` rounded up to a multiple of ``8 // bits``, padding channels zero):

* ``codes``: ``[batch, n_blocks, kv_heads, block_tokens, channels * bits // 8]``, ``torch.uint8``.
* ``kmin``, ``kstep``: ``[batch, n_blocks, kv_heads, channels]``, the dtype of what was quantized.

Everything here runs on any device and never waits for it.
"""

from __future__ import annotations

import torch


def quantize_keys(keys: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """Per-(block, head, channel) asymmetric quantization of keys, packed ``8 // bits`` codes per byte.

    Args:
        keys: ``[batch, n, kv_heads, block_tokens, head_dim]``, any float dtype, any device.
        bits: 1, 2, 4 or 8.

    Returns:
        ``codes`` (``[batch, n, kv_heads, block_tokens, channels * bits // 8]``, ``torch.uint8``), ``kmin`` and
        ``kstep`` (``[batch, n, kv_heads, channels]``, ``keys.dtype``): key ≈ ``kmin + code * kstep``. ``channels``
        is ``head_dim`` rounded up to a multiple of ``8 // bits`` (padding channels are zero).
    """
    levels = (1 << bits) - 1
    k = padded_channels(keys.float(), bits)
    kmin, kmax = k.amin(dim=3), k.amax(dim=3)
    step = (kmax - kmin) / levels
    kmin, step = kmin.to(keys.dtype), step.to(keys.dtype)  # quantize against the stored (rounded) parameters
    return {"codes": grid_codes(k, kmin, step, bits), "kmin": kmin, "kstep": step}


def padded_channels(keys: torch.Tensor, bits: int) -> torch.Tensor:
    """``keys`` (``[..., head_dim]``, any float dtype) with the channels zero-padded to a multiple of ``8 // bits``
    (whole bytes of codes; a zero channel meets a zero query channel)."""
    per = 8 // bits
    return torch.nn.functional.pad(keys, (0, -keys.shape[-1] % per)) if keys.shape[-1] % per else keys


def grid_codes(keys: torch.Tensor, kmin: torch.Tensor, kstep: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of ``keys`` on the grid ``kmin + code * kstep``, rounded to the nearest level, packed ``8 // bits``
    per byte.

    Args:
        keys: ``[batch, n, kv_heads, block_tokens, channels]`` (channels padded: :func:`padded_channels`), float.
        kmin, kstep: ``[batch, n, kv_heads, channels]``, any float dtype, same device.
        bits: 1, 2, 4 or 8.

    Returns:
        ``[batch, n, kv_heads, block_tokens, channels * bits // 8]``, ``torch.uint8``.
    """
    levels, per = (1 << bits) - 1, 8 // bits
    step = kstep.float()
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = ((keys.float() - kmin.float()[:, :, :, None]) / safe[:, :, :, None]).round_().clamp_(0, levels)
    codes = codes.to(torch.uint8)
    if per > 1:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=keys.device)
        codes = (codes.unflatten(-1, (-1, per)) << shifts).sum(dim=-1, dtype=torch.uint8)
    return codes


def dequantize_keys(codes: torch.Tensor, kmin: torch.Tensor, kstep: torch.Tensor, bits: int) -> torch.Tensor:
    """Keys back from :func:`quantize_keys`' output, ``[batch, n, kv_heads, block_tokens, channels]``, float32.

    Args:
        codes: ``[batch, n, kv_heads, block_tokens, channels * bits // 8]``, ``torch.uint8``, any device.
        kmin: ``[batch, n, kv_heads, channels]``, float dtype, same device.
        kstep: same shape as ``kmin``.
        bits: the bits the codes were packed with.
    """
    per = 8 // bits
    if per > 1:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        codes = ((codes[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)
    return kmin.float()[:, :, :, None] + codes.float() * kstep.float()[:, :, :, None]


def take_blocks(t: torch.Tensor, index: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Whole blocks of per-block tensors: ``t[b, index[b, j]]``, moved as the widest integer words that tile a
    block's bytes.

    Indexing works element by element, so gathering 4-bit codes byte by byte costs eight times the work of gathering
    them as 64-bit words; ``take_along_dim`` would also expand the index to every element (as int64). Here the index
    stays ``[batch, near]`` and each block moves as whole words where its bytes allow.

    Args:
        t: ``[batch, n_blocks, ...]``, any dtype, contiguous past the block dimension (a slice of the block
            dimension of a contiguous buffer is fine), any device.
        index: ``[batch, near]``, ``torch.int64``, same device: blocks to take per sequence.
        rows: ``arange(batch)[:, None]`` on that device (``None``: made here; a caller taking several tensors
            passes one).

    Returns:
        ``[batch, near, ...]``, ``t``'s dtype, contiguous.
    """
    if rows is None:
        rows = torch.arange(index.shape[0], device=index.device)[:, None]
    if t.dim() < 3 or t.numel() == 0 or not t[0, 0].is_contiguous():
        return t[rows, index]  # element by element
    block_bytes = t[0, 0].numel() * t.element_size()
    as_bytes = t.flatten(2).view(torch.uint8)  # [batch, n_blocks, block_bytes], a view
    for word in (torch.int64, torch.int32, torch.int16):
        if block_bytes % word.itemsize:
            continue
        try:
            words = as_bytes.view(word)  # fails where a stride or the offset is not a whole number of words
        except RuntimeError:
            continue
        return words[rows, index].view(torch.uint8).view(t.dtype).view(*index.shape, *t.shape[2:])
    return t[rows, index]
