"""Quantized keys: attention mass per block estimated from every key of the block at a few bits per element.

Why: block summaries (Quest's bounds, mean keys) compress 16 keys into one to three vectors, and a block's bound is
set by its most extreme coordinates, not by the key that matches the query, so such selectors lose most of their
accuracy to the oracle on retrieval among many similar keys. This policy keeps every key of every block on the
compute device, quantized to ``bits`` bits per element with one minimum and one step per block, KV head and channel
(:mod:`hf_offload.kernels.quant`; keys vary per channel, as KIVI's key cache assumes, Liu et al., 2024), and scores blocks like the oracle: per KV head, the softmax at the attention's scale
over the logits of all quantized keys, its mass summed per block over tokens, query heads and KV heads (one shared
selection of whole blocks, SoloHead style). Double Sparsity (Yang et al., 2024) and InfiniGen (Lee et al., 2024)
also score tokens from a reduced copy of the keys held on the device; here the reduction is precision, which needs
no calibration.

Summaries: ``codes`` (``[batch, n_blocks, kv_heads, block_tokens, head_dim * bits / 8]``, ``torch.uint8``),
``kmin`` and ``kstep`` (``[batch, n_blocks, kv_heads, head_dim]``, cache dtype). Per block and KV head:
``block_tokens * head_dim * bits / 8 + 2 * head_dim * itemsize`` bytes; at 16-token blocks and bf16 that is
``(2 * bits + 4) * head_dim`` bytes, 6 / 8 / 12 x ``head_dim`` at 1 / 2 / 4 bits, against SoloHead's
``4 x head_dim``, ``meanbound``'s ``6 x head_dim`` and the block's own K and V, ``64 x head_dim``. Scoring reads
every code once: one kernel launch per layer and step where a kernel runs (:mod:`hf_offload.kernels.quantkey`,
decoding in registers); elsewhere pure torch, at most ``chunk_blocks`` blocks at a time to bound the dequantized
temporary.

With ``tail_bits`` set, the values of every block are kept on the device too, quantized the same way (per block,
head and channel), and each decode query adds the attention over the blocks it did not select, estimated from the
quantized keys and values (:mod:`hf_offload.kernels.tail`), to the exact attention over its selection. Each block
and KV head then costs ``(2 * tail_bits + 4) * head_dim`` more bytes (at 16-token blocks, bf16). With ``tail_near``
set, only the ``tail_near * k`` unselected blocks of highest score (``k``: the blocks the step selects) are
estimated token by token, and the other unselected blocks count by their mass alone: their log-sum-exps over the
quantized keys, which the scoring computed already, valued at the estimate's output. The estimate then reads a
bounded number of blocks per step, like the recall, instead of every block.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..kernels.quant import dequantize_keys, quantize_keys, take_blocks
from .base import Selection, Selector, unselected_tokens


def _block_mass(lse: torch.Tensor) -> torch.Tensor:
    """Attention mass per block summed over query and KV heads, ``[batch, 1, n_blocks]``, float32, from the block
    log-sum-exps ``[batch, kv_heads, group, n_blocks]`` (per head, the softmax over blocks)."""
    return torch.softmax(lse, dim=-1).sum(dim=(1, 2))[:, None, :]


# Blocks re-encoded at a time by QuantKeySelector.coarsen_summaries (its float32 temporaries: this many blocks of
# keys per sequence).
RECODE_BLOCKS = 64


@dataclass
class QuantKeySelector(Selector):
    """Oracle-style attention mass per block from keys quantized to ``bits`` bits (shared selection).

    Attributes:
        bits: bits per key element: 1, 2, 4 or 8.
        chunk_blocks: most blocks dequantized at a time while scoring (where the pure-torch scoring runs).
        tail_bits: bits per value element of the on-device copy of every block's values that estimates the
            attention outside the selection (1, 2, 4 or 8); 0: no estimate, the query attends to its selection only.
        tail_near: with ``tail_bits``: estimate token by token only the ``ceil(tail_near * k)`` unselected blocks
            of highest score (``k``: blocks selected per step) and count the other unselected blocks by their
            mass (block log-sum-exps of the scoring; blocks partly padding are left out), valued at that estimate's
            output; 0: every unselected block token by token.
        tail_far: with ``tail_near``: what the blocks counted by their mass alone are valued at: ``"near"`` (the
            near blocks' estimate, as above) or ``"mid"`` (each block at the midpoint of its quantized value range
            per KV head and channel, ``vmin + vstep * (2**tail_bits - 1) / 2``: its own value, from the summaries
            alone; docs/tuning.md has the measurement).
    """

    name = "quantkey"
    per_head = False
    mass_scores = True
    bits: int = 2
    chunk_blocks: int = 512
    tail_bits: int = 0
    tail_near: float = 0.0
    tail_far: str = "near"

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
        if self.tail_far not in ("near", "mid"):
            raise ValueError(f"QuantKeySelector.tail_far must be 'near' (the far blocks valued at the near blocks' "
                             f"estimate) or 'mid' (each at its value range's midpoint), got {self.tail_far!r}.")  # fmt: skip
        near = self.tail_near
        if isinstance(near, bool) or not isinstance(near, (int, float)) or not math.isfinite(near) or near < 0:
            raise ValueError(f"QuantKeySelector.tail_near must be a number >= 0 (0: estimate every unselected "
                             f"block), got {near!r}.")  # fmt: skip
        if self.tail_far != "near" and not near:
            raise ValueError("QuantKeySelector.tail_far values the blocks the bounded estimate counts by their mass "
                             "alone: set tail_near too (e.g. quantkey[bits=4,tail_bits=2,tail_near=3,tail_far=mid]), "
                             "or leave tail_far at 'near'.")  # fmt: skip
        if near and not self.tail_bits:
            raise ValueError("QuantKeySelector.tail_near bounds the estimate of the unselected blocks: set tail_bits "
                             "too (e.g. quantkey[bits=4,tail_bits=2,tail_near=3]), or leave tail_near at 0.")  # fmt: skip

    @property
    def masks_invalid(self) -> bool:
        """The block masses are softmaxes over the valid blocks only (unless a subclass scores its own way)."""
        return type(self).score is QuantKeySelector.score

    def summarize(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """``codes``, ``kmin`` and ``kstep`` of the new blocks (see :func:`quantize_keys`).

        Args:
            keys: ``[batch, n_new, kv_heads, block_tokens, head_dim]``, the cache dtype, compute device.
        """
        return quantize_keys(keys, self.bits)

    def coarser(self) -> QuantKeySelector | None:
        """The next coarser summary level: keys at half the bits, down to 2; then no estimate of the unselected
        blocks (the values' summaries dropped). From the default, ``quantkey[bits=4,tail_bits=2,tail_near=16]``
        (``20·H·D`` bytes per 16-token block, bf16): ``quantkey[bits=2,tail_bits=2,tail_near=16]`` (``16·H·D``),
        then ``quantkey`` (``8·H·D``). ``None`` from plain 2-bit (or 1-bit) keys, and for a subclass with summaries
        of its own."""
        own = ("summarize", "summarize_values", "coarsen_summaries")
        if any(getattr(type(self), name) is not getattr(QuantKeySelector, name) for name in own):
            return None
        if self.bits > 2:
            return dataclasses.replace(self, bits=self.bits // 2)
        if self.tail_bits:
            return dataclasses.replace(self, tail_bits=0, tail_near=0.0, tail_far="near")
        return None

    def coarsen_summaries(
        self, summaries: dict[str, torch.Tensor], coarser: Selector, head_dim: int, n_blocks: int
    ) -> dict[str, torch.Tensor]:
        """Summaries re-encoded at ``coarser``'s bits (see :meth:`Selector.coarsen_summaries
        <hf_offload.selectors.base.Selector.coarsen_summaries>`): each block's keys (values) as its codes give them,
        quantized again at the new bits with their own minimum and step, ``RECODE_BLOCKS`` blocks at a time (so the
        temporaries stay small); the values' summaries dropped where ``coarser`` estimates nothing."""
        if not isinstance(coarser, QuantKeySelector):
            raise TypeError(f"QuantKeySelector summaries convert to another QuantKeySelector's, not {coarser!r}.")
        parts = [("codes", "kmin", "kstep", self.bits, coarser.bits)]
        if coarser.tail_bits:
            if not self.tail_bits:
                raise ValueError("Summaries without values cannot be converted to a level that estimates the "
                                 "unselected blocks (tail_bits).")  # fmt: skip
            parts.append(("vcodes", "vmin", "vstep", self.tail_bits, coarser.tail_bits))
        out: dict[str, torch.Tensor] = {}
        for codes_name, min_name, step_name, old, new in parts:
            codes, low, step = summaries[codes_name], summaries[min_name], summaries[step_name]
            if old == new:
                out.update({codes_name: codes, min_name: low, step_name: step})
                continue
            batch, capacity, heads, tokens = codes.shape[:4]
            like = quantize_keys(torch.zeros((1, 1, heads, tokens, head_dim), dtype=low.dtype, device=low.device), new)
            made = {name: torch.zeros((batch, capacity, *like[name].shape[2:]), dtype=like[name].dtype,
                                      device=low.device) for name in like}  # fmt: skip
            for start in range(0, n_blocks, RECODE_BLOCKS):
                end = min(n_blocks, start + RECODE_BLOCKS)
                values = dequantize_keys(codes[:, start:end], low[:, start:end], step[:, start:end], old)
                again = quantize_keys(values[..., :head_dim].to(low.dtype), new)
                for name, tensor in again.items():
                    made[name][:, start:end] = tensor
            out.update({codes_name: made["codes"], min_name: made["kmin"], step_name: made["kstep"]})
        return out

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
        selection: Selection | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over the ``tokens_ok`` tokens from the quantized keys and values (see
        :meth:`Selector.tail_attention <hf_offload.selectors.base.Selector.tail_attention>`); with ``tail_near``
        and a ``selection`` that carries its ``block_lse``, the bounded estimate (see the class).

        Args:
            query: ``[batch, kv_heads, group, head_dim]``, compute device.
            summaries: ``codes`` / ``kmin`` / ``kstep`` and ``vcodes`` / ``vmin`` / ``vstep``, ``[batch, n_blocks,
                ...]``.
            scaling: softmax scale.
            tokens_ok: ``[batch, n_blocks, block_tokens]``, ``torch.bool``.
            softcap: optional logit soft-capping (the blocks counted by mass alone are left out under it: their
                log-sum-exps are of uncapped logits).
            selection: the step's selection (``scores`` ``[batch, 1, n_blocks]``, ``blocks``, ``block_lse``).
        """
        from ..kernels.tail import far_midpoints, tail_attention, with_far_mass, with_far_values

        head_dim = query.shape[-1]
        q, keys, values = self._tail_inputs(query, summaries, scaling)
        n = tokens_ok.shape[1]
        bounded = self.tail_near > 0 and selection is not None and selection.block_lse is not None
        if not bounded or self.near_count(selection, n) >= n:  # every unselected block token by token
            out, lse = tail_attention(q, keys, self.bits, values, self.tail_bits, tokens_ok, softcap)
            return out[..., :head_dim], lse
        near_ok, index = self.near_index(tokens_ok, selection)
        out, lse = tail_attention(q, keys, self.bits, values, self.tail_bits, near_ok, softcap, index=index)
        if softcap is None:
            # Unselected blocks not estimated token by token, every token of which the query may attend (the block
            # log-sum-exps cover whole blocks: a block with padding in it would count its padding).
            far = tokens_ok.all(dim=-1).scatter(1, index, False)  # [batch, n]
            if self.tail_far == "mid":
                return with_far_values(out[..., :head_dim], lse, selection.block_lse[..., :n], far,
                                       far_midpoints(values, self.tail_bits))  # fmt: skip
            lse = with_far_mass(lse, selection.block_lse[..., :n], far)
        return out[..., :head_dim], lse

    def _tail_inputs(
        self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The estimate's query (float32, scaled, channels padded like the codes') and its key and value summaries."""
        if not self.tail_bits:
            raise RuntimeError("QuantKeySelector.tail_attention needs tail_bits > 0.")
        q = query.float() * scaling
        channels = summaries["kmin"].shape[-1]
        if channels != query.shape[-1]:
            q = torch.nn.functional.pad(q, (0, channels - query.shape[-1]))
        keys = {"codes": summaries["codes"], "kmin": summaries["kmin"], "kstep": summaries["kstep"]}
        values = {"codes": summaries["vcodes"], "kmin": summaries["vmin"], "kstep": summaries["vstep"]}
        return q, keys, values

    def tail_attention_merged(
        self,
        query: torch.Tensor,
        summaries: dict[str, torch.Tensor],
        scaling: float,
        tokens_ok: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        selection: Selection | None = None,
        out_dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`tail_attention` merged with the selection's attention (see :meth:`Selector.tail_attention_merged
        <hf_offload.selectors.base.Selector.tail_attention_merged>`): where the estimate's kernel runs, the merge of
        its ranges, the far blocks' mass and the merge with the selection are one launch
        (:func:`hf_offload.kernels.tail.tail_attention_merged`). The same result as :meth:`tail_attention`
        followed by ``merge_attention``, up to float32 rounding."""
        from ..kernels.tail import tail_attention_merged, tail_plan

        q, keys, values = self._tail_inputs(query, summaries, scaling)
        n = tokens_ok.shape[1]
        args = (q, keys, self.bits, values, self.tail_bits)
        bounded = self.tail_near > 0 and selection is not None and selection.block_lse is not None
        near = self.near_count(selection, n) if bounded else n
        if near >= n:  # every unselected block token by token
            tail = tokens_ok if selection is None else unselected_tokens(tokens_ok, selection)
            return tail_attention_merged(*args, tail, out, lse, out_dtype=out_dtype)
        k = selection.blocks.shape[-1]
        if selection.ranked is not None and selection.ranked.shape[-1] >= k + near:
            # The near blocks from the selection's own ranking, their tokens and the far blocks in one launch
            # (kernels/tail.py tail_plan; the same as the torch code below).
            index = selection.ranked[:, 0, k : k + near]
            near_ok, far = tail_plan(tokens_ok, selection.blocks[:, 0], selection.keep[:, 0], index,
                                     selection.scores[:, 0, :n])  # fmt: skip
        else:
            tail = unselected_tokens(tokens_ok, selection)
            near_ok, index = self.near_index(tail, selection)
            # The far blocks as in tail_attention: unselected, not near, every token attendable.
            far = tail.all(dim=-1).scatter(1, index, False)  # [batch, n]
        return tail_attention_merged(*args, near_ok, out, lse, index=index, block_lse=selection.block_lse[..., :n],
                                     far=far, out_dtype=out_dtype, far_mid=self.tail_far == "mid")  # fmt: skip

    def decode_branch(self, n_blocks: int, k: int) -> object:
        """With an estimate of the unselected blocks: whether it is bounded (``tail_near`` and more unselected blocks
        than :meth:`near_count`) or takes every unselected block token by token, and whether the selection's own
        ranking holds the near blocks (``n_blocks >= k + near``; else :meth:`near_index` ranks again)."""
        if not self.tail_bits:
            return None
        near = math.ceil(self.tail_near * k)
        return bool(self.tail_near) and near < n_blocks, bool(self.tail_near) and k + near <= n_blocks

    def estimate_coverage(self, n_blocks: int, k: int) -> float | None:
        """The share of a step's unselected blocks that the estimate takes token by token (the rest count by their
        mass alone), with ``n_blocks`` sealed blocks of which ``k`` are selected: ``1.0`` without ``tail_near`` or
        where ``ceil(tail_near * k)`` reaches every unselected block, ``None`` without an estimate (``tail_bits=0``).
        Below 1 aggregation tasks lose accuracy (docs/tuning.md, "How many near blocks")."""
        if not self.tail_bits:
            return None
        unselected = n_blocks - k
        if not self.tail_near or unselected <= 0:
            return 1.0
        return min(1.0, math.ceil(self.tail_near * k) / unselected)

    def near_count(self, selection: Selection, n: int) -> int:
        """Unselected blocks the bounded estimate takes token by token: ``ceil(tail_near * k)``, at most ``n``."""
        return min(n, math.ceil(self.tail_near * selection.blocks.shape[-1]))

    def near_index(self, tokens_ok: torch.Tensor, selection: Selection) -> tuple[torch.Tensor, torch.Tensor]:
        """The bounded estimate's near blocks, the :meth:`near_count` unselected blocks of highest score: which of
        their tokens to estimate and where they are.

        Args:
            tokens_ok: ``[batch, n_blocks, block_tokens]``, ``torch.bool``: the tokens to estimate.
            selection: the step's selection (its ``scores``, ``[batch, 1, n_blocks]``).

        Returns:
            ``(tokens_ok, index)``: ``tokens_ok`` of the near blocks, ``[batch, near, block_tokens]``, ``False`` for
            an entry with nothing to estimate; ``index``, ``[batch, near]``, ``torch.int64``, their blocks.
        """
        n = tokens_ok.shape[1]
        k, near = selection.blocks.shape[-1], self.near_count(selection, n)
        if selection.ranked is not None and selection.ranked.shape[-1] >= k + near:
            # The selection's own ranking past k: the best unselected blocks, no second top-k. Blocks ranked at
            # -inf may not be attended; an entry without a token to estimate counts nothing.
            index = selection.ranked[:, 0, k : k + near]
            live = selection.scores[:, 0, :n].gather(1, index) > float("-inf")
            return take_blocks(tokens_ok, index) & live[:, :, None], index
        wanted = tokens_ok.any(dim=-1)  # [batch, n]: blocks with a token to estimate
        order = selection.scores[:, 0, :n].masked_fill(~wanted, float("-inf")).topk(near)
        index = order.indices  # [batch, near]
        near_ok = take_blocks(tokens_ok, index) & (order.values > float("-inf"))[:, :, None]
        return near_ok, index

    def near_blocks(
        self,
        keys: dict[str, torch.Tensor],
        values: dict[str, torch.Tensor],
        tokens_ok: torch.Tensor,
        selection: Selection,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        """:meth:`near_index` plus copies of the near blocks' summaries (what the estimate read before its kernel
        took the index; kept for the benchmarks and the reference).

        Args:
            keys: ``codes`` / ``kmin`` / ``kstep`` of the sealed blocks, ``[batch, n_blocks, ...]``.
            values: the same for the values.
            tokens_ok: ``[batch, n_blocks, block_tokens]``, ``torch.bool``: the tokens to estimate.
            selection: the step's selection (its ``scores``, ``[batch, 1, n_blocks]``).

        Returns:
            ``(keys, values, tokens_ok, index)`` of the near blocks, ``[batch, near, ...]``; ``tokens_ok`` and
            ``index`` as :meth:`near_index`'s.
        """
        near_ok, index = self.near_index(tokens_ok, selection)
        rows = torch.arange(index.shape[0], device=index.device)[:, None]
        near_keys = {k: take_blocks(v, index, rows) for k, v in keys.items()}
        return near_keys, {k: take_blocks(v, index, rows) for k, v in values.items()}, near_ok, index

    def score(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Estimated attention mass per block summed over all heads, shape ``[batch, 1, n_blocks]``, float32.

        Args:
            query: ``[batch, kv_heads, group, head_dim]``.
            summaries: ``codes`` ``[batch, n_blocks, kv_heads, block_tokens, channels * bits // 8]`` and ``kmin`` /
                ``kstep`` ``[batch, n_blocks, kv_heads, channels]`` (see :func:`quantize_keys`).
            scaling: softmax scale.
        """
        return _block_mass(self.block_lse(query, summaries, scaling))

    def block_lse(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Log-sum-exp of each block's logits over its quantized keys, per query head: ``[batch, kv_heads, group,
        n_blocks]``, float32 (arguments as :meth:`score`'s)."""
        from ..kernels.quantkey import block_lse

        channels = summaries["kmin"].shape[-1]
        if channels != query.shape[-1]:  # head_dim padded to whole bytes of codes
            q = torch.nn.functional.pad(query.float() * scaling, (0, channels - query.shape[-1]))
            return block_lse(q, summaries["codes"], summaries["kmin"], summaries["kstep"], self.bits, self.chunk_blocks)
        # Scaled inside the kernel where it can (one launch less per layer and step than converting here).
        return block_lse(query, summaries["codes"], summaries["kmin"], summaries["kstep"], self.bits, self.chunk_blocks,
                         scaling=scaling)  # fmt: skip

    def select(
        self,
        query: torch.Tensor,
        summaries: dict[str, torch.Tensor],
        scaling: float,
        k: int,
        forced: torch.Tensor,
        valid: torch.Tensor,
    ) -> Selection:
        """:meth:`Selector.select <hf_offload.selectors.base.Selector.select>` with each head's softmax over the
        valid blocks only (blocks that may not be attended take no share of it); with ``tail_near`` the selection
        also carries the block log-sum-exps its scores came from (``Selection.block_lse``)."""
        if not self.masks_invalid:  # a subclass with its own score()
            return super().select(query, summaries, scaling, k, forced, valid)
        from ..kernels.mass import block_scores
        from ..kernels.topk import ranked_topk_keep

        lse = self.block_lse(query, summaries, scaling)
        # The masses, forced and invalid blocks in two launches where Triton runs (kernels/mass.py); with
        # tail_near, the second also writes the estimate's far blocks' log-sum-exps (valid blocks only).
        if self.tail_near:
            scores, lse = block_scores(lse, valid, forced, masked=True)
        else:
            scores = block_scores(lse, valid, forced)
        n = valid.shape[-1]
        ranked = min(n, k + math.ceil(self.tail_near * k)) if self.tail_near else k
        # One top-k serves the selection (its first k) and the bounded estimate's near blocks (the next ones), each
        # tier in block order, ties broken toward lower blocks (kernels/topk.py: one launch on CUDA, the keep mask of
        # the first k included; where Triton runs, a second for the mask).
        indices, values, keep = ranked_topk_keep(scores, k, ranked)
        blocks = indices[..., :k]
        if not self.tail_near:
            return Selection(blocks=blocks, keep=keep, scores=scores)
        return Selection(blocks=blocks, keep=keep, scores=scores, block_lse=lse,
                         ranked=indices if ranked > k else None)  # fmt: skip
