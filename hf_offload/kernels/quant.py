"""Low-bit block quantization and block gathers: the layout every quantized-key kernel reads (pure torch).

A block's keys (or values) are quantized per (sequence, block, KV head, channel): one minimum ``kmin`` and one step
``kstep`` over the block's tokens, codes of ``bits`` bits on the grid ``kmin + code * kstep``, packed ``8 // bits``
to a byte, the code of channel ``PER * j + p`` at bit ``bits * p`` of byte ``j`` (``PER = 8 // bits``).
Per-channel parameters because keys vary per channel (KIVI's key layout).

Layout (``channels``: ``head_dim`` rounded up to a multiple of ``8 // bits``, padding channels zero):

* ``codes``: ``[batch, n_blocks, kv_heads, block_tokens, channels * bits // 8]``, ``torch.uint8``.
* ``kmin``, ``kstep``: ``[batch, n_blocks, kv_heads, channels]``, the dtype of what was quantized.

Everything here runs on any device and never waits for it; :func:`quantize_keys` runs one Triton kernel where it
can (``hf_offload.kernels.seal``).
"""

from __future__ import annotations

import sys
import warnings

import torch

from .seal import quantize_blocks, quantize_blocks_supported


_KERNEL = {"ran": set(), "failed": None}  # the compiled variants that have run / why a first launch failed


def quantize_keys(keys: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """:func:`quantize_keys_reference`, in one launch where :func:`~hf_offload.kernels.seal.quantize_blocks_supported`
    (Triton on the keys' device; the same result, bit for bit). Where the first launch of a compiled variant (device,
    dtype, bits, block shape) fails (it could not be compiled), one warning, and the reference from then on."""
    if _KERNEL["failed"] is None and quantize_blocks_supported(keys, bits):
        variant = (keys.device.type, keys.dtype, bits, *keys.shape[3:])
        if variant in _KERNEL["ran"]:
            return quantize_blocks(keys, bits)
        try:
            out = quantize_blocks(keys, bits)
        except Exception as e:  # noqa: BLE001 (reported once; the reference runs from here on)
            if keys.is_cuda and torch.cuda.is_current_stream_capturing():
                raise  # perhaps only the capture forbids it: the capture's own fallback takes it
            _KERNEL["failed"] = f"{type(e).__name__}: {e}"
            warnings.warn(f"hf_offload: the summaries' kernel could not run ({_KERNEL['failed'][:300]}); using the "
                          "torch code instead.", RuntimeWarning, stacklevel=2)  # fmt: skip
        else:
            _KERNEL["ran"].add(variant)
            return out
    return quantize_keys_reference(keys, bits)


def quantize_keys_reference(keys: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """Per-(block, head, channel) asymmetric quantization of keys, packed ``8 // bits`` codes per byte, in torch.

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


LAYOUT = "bnhtc"
"""Dimensions of the codes and of :func:`dequantize_keys`' default result: batch, block, KV head, token, channel."""


def dequantize_keys(
    codes: torch.Tensor, kmin: torch.Tensor, kstep: torch.Tensor, bits: int, layout: str = LAYOUT
) -> torch.Tensor:
    """Keys back from :func:`quantize_keys`' output, float32, contiguous in ``layout``.

    ``kmin + code * kstep`` in float32, one multiply and one add per element. The layout is a permutation of
    :data:`LAYOUT`'s letters: ``"bnhtc"`` (default) gives ``[batch, n, kv_heads, block_tokens, channels]``;
    ``"bhcnt"`` gives keys ready for ``query @ keys`` per (batch, KV head), ``[batch, kv_heads, channels, n,
    block_tokens]``; ``"bhntc"`` gives values ready for ``weights @ values``. The same float32 values in every
    layout: a product can read them where they lie instead of copying them into its own order.

    The codes are moved into the layout as whole 32-bit words where their bytes allow (a transposing copy element by
    element costs about as much per byte as per word), then unpacked in place: every word's codes come out with one
    shift and one mask, whatever ``bits``.

    Args:
        codes: ``[batch, n, kv_heads, block_tokens, channels * bits // 8]``, ``torch.uint8``, any device.
        kmin: ``[batch, n, kv_heads, channels]``, float dtype, same device.
        kstep: same shape as ``kmin``.
        bits: the bits the codes were packed with.
        layout: the result's dimensions, a permutation of ``"bnhtc"``.
    """
    if sorted(layout) != sorted(LAYOUT):
        raise ValueError(f"dequantize_keys: layout must be a permutation of {LAYOUT!r}, got {layout!r}")
    order = [LAYOUT.index(axis) for axis in layout]
    at = layout.index("c")
    words = _code_words(codes).permute(order).contiguous()  # [..., words, ...] in the layout
    per_word = words.element_size() * 8 // bits
    code = torch.empty((*words.shape[: at + 1], per_word, *words.shape[at + 1 :]), dtype=words.dtype,
                       device=codes.device)  # fmt: skip
    shifts = _word_shifts(bits, words.dtype, codes.device).view(per_word, *[1] * (words.dim() - at - 1))
    torch.bitwise_right_shift(words.unsqueeze(at + 1), shifts, out=code)
    code = code.bitwise_and_((1 << bits) - 1).flatten(at, at + 1)  # the codes of channels in order

    def param(t: torch.Tensor) -> torch.Tensor:  # [batch, n, kv_heads, channels] broadcast over the tokens
        return t.float()[:, :, :, None].permute(order)

    out = torch.empty(code.shape, dtype=torch.float32, device=codes.device).copy_(code)
    return out.mul_(param(kstep)).add_(param(kmin))


def _code_words(codes: torch.Tensor) -> torch.Tensor:
    """``codes`` (``[..., code_bytes]``, ``torch.uint8``) as the widest of ``torch.int32``, ``torch.int16`` and
    ``torch.uint8`` whose words tile each row of code bytes and whose view the strides allow (a view, no copy)."""
    for word in (torch.int32, torch.int16):
        if codes.shape[-1] % word.itemsize or codes.stride(-1) != 1:
            continue
        try:
            return codes.view(word)  # fails where a stride or the offset is not a whole number of words
        except RuntimeError:
            continue
    return codes


def _word_shifts(bits: int, word: torch.dtype, device: torch.device) -> torch.Tensor:
    """Right shifts that bring each code of a ``word`` to its lowest bits, in channel order (byte ``i`` of the word,
    code ``p`` of the byte: channel ``i * 8 // bits + p``), in the machine's byte order; ``word`` dtype."""
    size = word.itemsize
    if sys.byteorder == "little":  # byte i at bit 8 * i: code s of the word at bit bits * s
        return torch.arange(0, 8 * size, bits, dtype=word, device=device)
    slot = torch.arange(8 * size // bits, device=device)
    byte, code = slot // (8 // bits), slot % (8 // bits)
    return (8 * (size - 1 - byte) + bits * code).to(word)


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
