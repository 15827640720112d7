"""Quantized keys: attention mass per block estimated from every key of the block at a few bits per element.

Block summaries (Quest's bounds, mean keys) compress 16 keys into one to three vectors, and the selectors built on
them lose most of their accuracy to the oracle on retrieval among many similar keys (``docs/results/selection.md``):
a block's bound is set by its most extreme coordinates, not by the key that matches the query. This policy keeps
every key of every block on the compute device, quantized to ``bits`` bits per element with one minimum and one step
per block, KV head and channel (keys vary per channel, so they are quantized per channel, as KIVI does for its
key cache, Liu et al., 2024), and scores blocks like the oracle: per KV head, the softmax at the attention's scale
over the logits of all quantized keys, its mass summed per block over tokens, query heads and KV heads (one shared
selection of whole blocks, SoloHead style). Double Sparsity (Yang et al., 2024) and InfiniGen (Lee et al., 2024)
also score tokens from a reduced copy of the keys held on the device; here the reduction is precision, which needs
no calibration.

Summaries: ``codes`` (``[batch, n_blocks, kv_heads, block_tokens, head_dim * bits / 8]``, ``torch.uint8``),
``kmin`` and ``kstep`` (``[batch, n_blocks, kv_heads, head_dim]``, cache dtype). Per block and KV head:
``block_tokens * head_dim * bits / 8 + 2 * head_dim * itemsize`` bytes; at 16-token blocks and bf16 that is
``(2 * bits + 4) * head_dim`` bytes, 6 / 8 / 12 x ``head_dim`` at 1 / 2 / 4 bits, against SoloHead's
``4 x head_dim``, ``meanbound``'s ``6 x head_dim`` and the block's own K and V, ``64 x head_dim``. Scoring reads every code once (one matrix product over
all keys: one Triton launch per layer and step where Triton runs (``hf_offload.kernels.quantkey``), which
dequantizes in registers; elsewhere pure torch, ``chunk_blocks`` blocks at a time to bound the dequantized
temporary).

With ``tail_bits`` set, the values of every block are kept on the device too, quantized the same way (per block,
head and channel), and each decode query adds the attention over the blocks it did not select, estimated from the
quantized keys and values (:mod:`hf_offload.kernels.tail`), to the exact attention over its selection. Each block
and KV head then costs ``(2 * tail_bits + 4) * head_dim`` more bytes (at 16-token blocks, bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Selector


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
    per = 8 // bits
    k = keys.float()
    if k.shape[-1] % per:  # pad the channels to whole bytes; a zero channel meets a zero query channel
        k = torch.nn.functional.pad(k, (0, -k.shape[-1] % per))
    kmin, kmax = k.amin(dim=3), k.amax(dim=3)
    step = (kmax - kmin) / levels
    kmin, step = kmin.to(keys.dtype), step.to(keys.dtype)  # quantize against the stored (rounded) parameters
    safe = torch.where(step.float() > 0, step.float(), torch.ones_like(step, dtype=torch.float32))
    codes = ((k - kmin.float()[:, :, :, None]) / safe[:, :, :, None]).round_().clamp_(0, levels).to(torch.uint8)
    if per > 1:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=keys.device)
        codes = (codes.unflatten(-1, (-1, per)) << shifts).sum(dim=-1, dtype=torch.uint8)
    return {"codes": codes, "kmin": kmin, "kstep": step}


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


@dataclass
class QuantKeySelector(Selector):
    """Oracle-style attention mass per block from keys quantized to ``bits`` bits (shared selection).

    Attributes:
        bits: bits per key element: 1, 2, 4 or 8.
        chunk_blocks: blocks dequantized at a time while scoring.
        tail_bits: bits per value element of the on-device copy of every block's values that estimates the
            attention outside the selection (1, 2, 4 or 8); 0: no estimate, the query attends to its selection only.
    """

    name = "quantkey"
    per_head = False
    bits: int = 2
    chunk_blocks: int = 512
    tail_bits: int = 0

    def __post_init__(self) -> None:
        if self.bits not in (1, 2, 4, 8):
            raise ValueError(f"QuantKeySelector.bits must be 1, 2, 4 or 8, got {self.bits!r}.")
        if self.tail_bits not in (0, 1, 2, 4, 8):
            raise ValueError(
                f"QuantKeySelector.tail_bits must be 0 (no estimate of the unselected blocks) or 1, 2, 4 or 8 bits "
                f"per value element, got {self.tail_bits!r}."
            )
        if isinstance(self.chunk_blocks, bool) or not isinstance(self.chunk_blocks, int) or self.chunk_blocks <= 0:
            raise ValueError(f"QuantKeySelector.chunk_blocks must be a positive integer, got {self.chunk_blocks!r}.")

    def summarize(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """``codes``, ``kmin`` and ``kstep`` of the new blocks (see :func:`quantize_keys`).

        Args:
            keys: ``[batch, n_new, kv_heads, block_tokens, head_dim]``, the cache dtype, compute device.
        """
        return quantize_keys(keys, self.bits)

    @property
    def estimates_tail(self) -> bool:
        """Whether the unselected blocks' attention is estimated (``tail_bits`` > 0)."""
        return self.tail_bits > 0

    def summarize_values(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """With ``tail_bits``: ``vcodes``, ``vmin`` and ``vstep`` of the new blocks' values (see
        :func:`quantize_keys`); else nothing.

        Args:
            values: ``[batch, n_new, kv_heads, block_tokens, head_dim]``, the cache dtype, compute device.
        """
        if not self.tail_bits:
            return {}
        q = quantize_keys(values, self.tail_bits)
        return {"vcodes": q["codes"], "vmin": q["kmin"], "vstep": q["kstep"]}

    def tail_attention(
        self,
        query: torch.Tensor,
        summaries: dict[str, torch.Tensor],
        scaling: float,
        tokens_ok: torch.Tensor,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over the ``tokens_ok`` tokens from the quantized keys and values (see
        :meth:`Selector.tail_attention <hf_offload.selectors.base.Selector.tail_attention>`).

        Args:
            query: ``[batch, kv_heads, group, head_dim]``, compute device.
            summaries: ``codes`` / ``kmin`` / ``kstep`` and ``vcodes`` / ``vmin`` / ``vstep``, ``[batch, n_blocks,
                ...]``.
            scaling: softmax scale.
            tokens_ok: ``[batch, n_blocks, block_tokens]``, ``torch.bool``.
            softcap: optional logit soft-capping.
        """
        from ..kernels.tail import tail_attention

        if not self.tail_bits:
            raise RuntimeError("QuantKeySelector.tail_attention needs tail_bits > 0.")
        head_dim = query.shape[-1]
        q = query.float() * scaling
        channels = summaries["kmin"].shape[-1]
        if channels != head_dim:
            q = torch.nn.functional.pad(q, (0, channels - head_dim))
        keys = {"codes": summaries["codes"], "kmin": summaries["kmin"], "kstep": summaries["kstep"]}
        values = {"codes": summaries["vcodes"], "kmin": summaries["vmin"], "kstep": summaries["vstep"]}
        out, lse = tail_attention(q, keys, self.bits, values, self.tail_bits, tokens_ok, softcap)
        return out[..., :head_dim], lse

    def score(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Estimated attention mass per block summed over all heads, shape ``[batch, 1, n_blocks]``, float32.

        Args:
            query: ``[batch, kv_heads, group, head_dim]``.
            summaries: ``codes`` ``[batch, n_blocks, kv_heads, block_tokens, channels * bits // 8]`` and ``kmin`` /
                ``kstep`` ``[batch, n_blocks, kv_heads, channels]`` (see :func:`quantize_keys`).
            scaling: softmax scale.
        """
        from ..kernels.quantkey import block_lse

        q = query.float() * scaling
        channels = summaries["kmin"].shape[-1]
        if channels != q.shape[-1]:  # head_dim padded to whole bytes of codes
            q = torch.nn.functional.pad(q, (0, channels - q.shape[-1]))
        lse = block_lse(q, summaries["codes"], summaries["kmin"], summaries["kstep"], self.bits, self.chunk_blocks)
        return torch.softmax(lse, dim=-1).sum(dim=(1, 2))[:, None, :]
