"""The selector contract: which sealed blocks one decode query attends to.

A selector summarises each sealed block once (when the block is sealed) and scores all blocks with the current query
at every decode step. The base class owns everything that is not scoring: forced sink and window blocks, padding
blocks, and top-k under the budget, so a new policy only writes ``score`` (and ``summarize`` if it needs other
summaries than per-head key bounds). A selector that also keeps values on the device (``summarize_values``) can
estimate the attention over the blocks it did not select (``tail_attention``); the offload attention then adds that
estimate to the exact attention over the selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Selection:
    """The blocks one decode step attends to, per sequence and (for per-head selectors) per KV head.

    Attributes:
        blocks: block indices, shape ``[batch, heads_or_1, k]``, dtype ``torch.int64``, on the compute device.
            ``heads_or_1`` is 1 when one selection is shared by all KV heads of the layer (SoloHead).
        keep: which entries of ``blocks`` are attended, same shape, dtype ``torch.bool``. Entries not kept
            (padding-only blocks, or scores of ``-inf``) are neither recalled nor attended.
        scores: the scores the choice was made from, shape ``[batch, heads_or_1, n_blocks]``, float32 (``+inf``
            for forced blocks, ``-inf`` for blocks never to attend); ``None`` when every block is selected.
        block_lse: where the selector computed them, the per-query-head log-sum-exps of every block's logits the
            scores came from, ``[batch, kv_heads, group, n_blocks]``, float32, compute device (a bounded estimate of
            the unselected blocks counts the blocks it does not estimate token by token through them); else
            ``None``.
        ranked: where the selector ranked past ``k`` for a later use, the indices of the best blocks by ``scores``
            in descending order, ``[batch, heads_or_1, k + extra]``, ``torch.int64``, whose first ``k`` are
            ``blocks`` (the bounded estimate takes its near blocks from the rest); else ``None``. A selection that
            is changed after it was chosen (e.g. by the transfer cap) carries none.
        left_out: where ``disk_cap_blocks`` took blocks on disk out of the selection, the best-scored
            ``disk_stage_left_out`` of them, best first, ``[batch, heads_or_1, m]``, ``torch.int64``, ``-1`` past
            them (the recall stages them, so that a later step finds them in memory); else ``None``.
    """

    blocks: torch.Tensor
    keep: torch.Tensor
    scores: torch.Tensor | None = None
    block_lse: torch.Tensor | None = None
    ranked: torch.Tensor | None = None
    left_out: torch.Tensor | None = None


class Selector:
    """Base class of block selection policies.

    Attributes:
        name: registry name.
        per_head: ``True`` if each KV head selects its own blocks (recall then moves per-head pieces of a block);
            ``False`` if one selection is shared by all heads of the layer (recall moves whole blocks).
        mass_scores: ``True`` if the scores of a shared selection are each block's estimated attention mass: per
            query head a softmax over the valid blocks, summed over the query heads (a sequence's scores sum to its
            number of query heads), so that the share a selection leaves out can be read from them
            (:func:`missed_share`) and an adaptive budget can widen it (``OffloadConfig.missed_mass_target``).
            How close that estimate is to the attention depends on what the selector scores with.
        masks_invalid: ``True`` if no block's score depends on the summaries of blocks that ``valid`` leaves out
            of :meth:`select` (needed for ``OffloadConfig.decode_capacity_blocks`` above 1). In the base: ``True``
            where the class that defines :meth:`score` also defines :meth:`masked_score` (a subclass that
            overrides :meth:`score` alone loses it); a selector whose scores stand alone per block may set it
            ``True`` directly.
    """

    name = "base"
    per_head = False
    mass_scores = False

    @property
    def masks_invalid(self) -> bool:
        score, masked = _defined_by(type(self), "score"), _defined_by(type(self), "masked_score")
        return masked is not Selector and score is masked

    @property
    def estimates_tail(self) -> bool:
        """Whether :meth:`tail_attention` estimates the attention over the unselected blocks (off in the base)."""
        return False

    def decode_branch(self, n_blocks: int, k: int) -> object:
        """Which variant of its decode work this selector runs for ``n_blocks`` sealed blocks of which ``k`` are
        selected, where that depends on ``n_blocks`` beyond tensor sizes (a hashable value; the base has one
        variant). A decode step whose variant has not run op by op yet runs op by op before it is captured into a
        CUDA graph (``OffloadLayer.warm_for``)."""
        return None

    def summarize(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """Summaries of freshly sealed blocks, kept on the compute device for scoring.

        Args:
            keys: keys of the new blocks, shape ``[batch, n_new, kv_heads, block_tokens, head_dim]``, the cache
                dtype, on the compute device (after RoPE).

        Returns:
            Named tensors of shape ``[batch, n_new, ...]``; the cache appends them along dim 1. The default keeps
            per-head elementwise key bounds (Quest): ``kmin`` and ``kmax`` of shape ``[batch, n_new, kv_heads,
            head_dim]``.
        """
        return {"kmin": keys.amin(dim=3), "kmax": keys.amax(dim=3)}

    def coarser(self) -> "Selector | None":
        """The next coarser summary level of this selector: a selector of the same kind whose summaries take fewer
        device bytes per block and that :meth:`coarsen_summaries` converts this one's summaries to, or ``None``
        (the base: no coarser level). A cache whose summaries no longer fit the device moves to it
        (``OffloadConfig.coarsen_summaries``)."""
        return None

    def coarsen_summaries(
        self, summaries: dict[str, torch.Tensor], coarser: "Selector", head_dim: int, n_blocks: int
    ) -> dict[str, torch.Tensor]:
        """This selector's summary buffers re-encoded as ``coarser`` (:meth:`coarser`) makes them.

        Args:
            summaries: the buffers by name, ``[batch, capacity, ...]``; the first ``n_blocks`` blocks hold sealed
                blocks, the rest zeros.
            coarser: the level to convert to.
            head_dim: the keys' and values' head size.
            n_blocks: sealed blocks per sequence.

        Returns:
            New buffers by name (``coarser``'s names), ``[batch, capacity, ...]``, zeros past ``n_blocks``; a buffer
            that does not change may be returned as it is.
        """
        raise NotImplementedError(f"Selector {self.name!r} has no coarser summary level.")

    def summarize_values(self, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Summaries of the new blocks' values (none in the base class), kept on the compute device beside
        :meth:`summarize`'s; their names must differ from those.

        Args:
            values: values of the new blocks, ``[batch, n_new, kv_heads, block_tokens, head_dim]``, the cache dtype,
                on the compute device.

        Returns:
            Named tensors of shape ``[batch, n_new, ...]``.
        """
        return {}

    def tail_attention(
        self,
        query: torch.Tensor,
        summaries: dict[str, torch.Tensor],
        scaling: float,
        tokens_ok: torch.Tensor,
        softcap: float | None = None,
        selection: Selection | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Estimated attention of the decode query over the tokens ``tokens_ok`` (the unselected blocks), from the
        summaries alone. Only where :attr:`estimates_tail` is true.

        Args:
            query: ``[batch, kv_heads, group, head_dim]``, the model dtype, compute device.
            summaries: every summary (keys' and values'), each ``[batch, n_blocks, ...]``.
            scaling: the attention's softmax scale.
            tokens_ok: tokens to estimate, ``[batch, n_blocks, block_tokens]``, ``torch.bool``.
            softcap: optional logit soft-capping.
            selection: the step's :class:`Selection` (its scores and ``block_lse`` let an estimate spend its work on
                the unselected blocks that matter); ``None`` where the caller has none.

        Returns:
            ``(out, lse)``: ``out`` ``[batch, kv_heads, group, head_dim]`` and ``lse`` ``[batch, kv_heads, group]``,
            float32 (see :func:`hf_offload.kernels.tail.tail_attention_reference`).
        """
        raise NotImplementedError(f"{type(self).__name__} does not estimate the attention outside its selection.")

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
        """:meth:`tail_attention` merged with the exact attention over the selection into one softmax (a selector
        may do both in fewer launches; this one calls :meth:`tail_attention`, then
        :func:`hf_offload.kernels.tail.merge_attention`).

        Args:
            query, summaries, scaling: as :meth:`tail_attention`'s.
            tokens_ok: tokens the query may attend, ``[batch, n_blocks, block_tokens]``, ``torch.bool``: those of
                the blocks ``selection`` keeps are left out here (:func:`unselected_tokens`).
            selection: the step's shared :class:`Selection`.
            out: the selection's attention, ``[batch, kv_heads, group, head_dim]``, float32.
            lse: its log-sum-exp, ``[batch, kv_heads, group]``, float32.
            out_dtype: dtype of the merged output.

        Returns:
            ``(out, tail_lse)``: the merged attention, ``[batch, kv_heads, group, head_dim]`` in ``out_dtype``, and
            the estimate's log-sum-exp, ``[batch, kv_heads, group]``, float32.
        """
        from ..kernels.tail import merge_attention

        tail = tokens_ok if selection is None else unselected_tokens(tokens_ok, selection)
        tail_out, tail_lse = self.tail_attention(query, summaries, scaling, tail, selection=selection)
        merged, _ = merge_attention(out, lse, tail_out, tail_lse)
        return merged.to(out_dtype), tail_lse

    def score(self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float) -> torch.Tensor:
        """Score every sealed block for the current query.

        Args:
            query: the decode query, shape ``[batch, kv_heads, group, head_dim]`` (``group`` query heads share one
                KV head), the model dtype, on the compute device.
            summaries: the tensors ``summarize`` returned, concatenated over all sealed blocks, each
                ``[batch, n_blocks, ...]``.
            scaling: the attention's softmax scale.

        Returns:
            Scores of shape ``[batch, 1 or kv_heads, n_blocks]``, float32; higher is more important, ``-inf``
            means "never attend".
        """
        raise NotImplementedError

    def masked_score(
        self, query: torch.Tensor, summaries: dict[str, torch.Tensor], scaling: float, valid: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`score` with the blocks that ``valid`` leaves out taking no part in any normalisation over blocks
        (a softmax over blocks, a ranking), so that no valid block's score depends on their summaries; their own
        scores do not matter (:meth:`select` never picks them). Selectors that normalise over blocks implement
        this and define :meth:`score` as ``masked_score(..., valid=None)``; :meth:`select` then uses it.

        Args:
            query, summaries, scaling: see :meth:`score`.
            valid: blocks that may be attended, ``[batch, n_blocks]``, ``torch.bool``, compute device; ``None``:
                every block.

        Returns:
            See :meth:`score`.
        """
        raise NotImplementedError(f"{type(self).__name__} has no masked_score(); select() uses score().")

    def select(
        self,
        query: torch.Tensor,
        summaries: dict[str, torch.Tensor],
        scaling: float,
        k: int,
        forced: torch.Tensor,
        valid: torch.Tensor,
    ) -> Selection:
        """Pick ``k`` blocks per sequence (and head): forced blocks first, then the best scores (of
        :meth:`masked_score` where :attr:`masks_invalid` comes from it, else of :meth:`score`).

        Args:
            query: see :meth:`score`.
            summaries: see :meth:`score`.
            scaling: see :meth:`score`.
            k: blocks to select, ``1 <= k <= n_blocks``.
            forced: sink and window blocks, shape ``[batch, n_blocks]``, dtype ``torch.bool``, compute device.
            valid: blocks with at least one token the query may attend to (not padding-only), same shape and dtype.

        Returns:
            The :class:`Selection`.
        """
        if _defined_by(type(self), "masked_score") is not Selector and self.masks_invalid:
            scores = self.masked_score(query, summaries, scaling, valid)
        else:
            scores = self.score(query, summaries, scaling)
        if scores.dtype != torch.float32:
            scores = scores.float()
        expected = query.shape[1] if self.per_head else 1
        if scores.dim() != 3 or scores.shape[1] != expected or scores.shape[2] != forced.shape[1]:
            raise ValueError(
                f"{type(self).__name__}.score() returned shape {tuple(scores.shape)}; with per_head={self.per_head} "
                f"it must be [batch, {expected}, n_blocks={forced.shape[1]}]."
            )
        return self.choose(scores, k, forced, valid)

    @staticmethod
    def choose(scores: torch.Tensor, k: int, forced: torch.Tensor, valid: torch.Tensor) -> Selection:
        """The ``k`` best blocks by ``scores`` after forcing ``forced`` blocks in and ``valid``-less blocks out.

        Args:
            scores: ``[batch, 1 or kv_heads, n_blocks]``, float32.
            k: blocks to select.
            forced: blocks always selected, ``[batch, n_blocks]``, ``torch.bool``.
            valid: blocks that may be selected, same shape and dtype.
        """
        scores = scores.masked_fill(forced[:, None, :], float("inf"))
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        top = scores.topk(k, dim=-1)
        return Selection(blocks=top.indices, keep=top.values > float("-inf"), scores=scores)


def _defined_by(cls: type, name: str) -> type | None:
    """The class of ``cls``'s method resolution order whose body defines ``name``."""
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def mask_invalid_logits(logits: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``logits`` with every entry of a block that ``valid`` leaves out set to ``-inf``.

    Args:
        logits: ``[batch, heads, group, n_blocks * parts]`` (``parts`` consecutive entries per block), float.
        valid: ``[batch, n_blocks]``, ``torch.bool``, same device; ``None``: ``logits`` unchanged.
    """
    if valid is None:
        return logits
    parts = logits.shape[-1] // valid.shape[-1]
    keep = valid if parts == 1 else valid.repeat_interleave(parts, dim=-1)
    return logits.masked_fill(~keep[:, None, None, :], float("-inf"))


def group_query(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Reshape ``[batch, q_heads, head_dim]`` to ``[batch, kv_heads, q_heads // kv_heads, head_dim]`` (GQA groups)."""
    batch, q_heads, head_dim = query.shape
    return query.view(batch, kv_heads, q_heads // kv_heads, head_dim)


def key_bound_logits(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound of ``q . k`` over the keys of each block, per query head.

    ``sum_d max(q_d * kmin_d, q_d * kmax_d)`` equals ``relu(q) . kmax + min(q, 0) . kmin``, two batched matrix
    products, so no ``[..., n_blocks, head_dim]`` intermediate is built.

    Args:
        query: shape ``[batch, kv_heads, group, head_dim]``.
        kmin: per-block elementwise key minimum, shape ``[batch, n_blocks, kv_heads, head_dim]``.
        kmax: per-block elementwise key maximum, same shape.

    Returns:
        Bounds of shape ``[batch, kv_heads, group, n_blocks]``, float32.
    """
    q = query.float()
    positive, negative = q.clamp(min=0), q.clamp(max=0)
    return torch.einsum("bhgd,bnhd->bhgn", positive, kmax.float()) + torch.einsum(
        "bhgd,bnhd->bhgn", negative, kmin.float()
    )


def unselected_tokens(tokens_ok: torch.Tensor, selection: Selection) -> torch.Tensor:
    """``tokens_ok`` less the blocks a shared selection keeps: the tokens an estimate of the unselected blocks
    covers.

    Args:
        tokens_ok: ``[batch, n, block_tokens]``, ``torch.bool``, compute device.
        selection: a shared selection (``blocks`` and ``keep`` ``[batch, 1, k]``; kept block indices below ``n``).

    Returns:
        ``[batch, n, block_tokens]``, ``torch.bool``.
    """
    batch, n = tokens_ok.shape[:2]
    blocks = torch.where(selection.keep, selection.blocks, n)[:, 0]  # not kept: a spare column, dropped below
    chosen = torch.zeros((batch, n + 1), dtype=torch.bool, device=tokens_ok.device).scatter_(1, blocks, True)
    return tokens_ok & ~chosen[:, :n, None]


def missed_share(selection: Selection, query_heads: int) -> torch.Tensor:
    """The share of a shared selection's estimated attention over the sealed blocks that it leaves out, from the
    scores of a selector with :attr:`Selector.mass_scores`: the masses of the valid blocks it does not keep, over the
    masses of every valid block. Sink and window blocks (``+inf``) are always kept and blocks that may not be attended
    (``-inf``) take no mass, so only finite scores count. An estimate: as good as the selector's masses.

    Args:
        selection: a shared selection with ``scores`` (``[batch, 1, n_blocks]``, float32) and ``blocks`` / ``keep``
            (``[batch, 1, k]``).
        query_heads: query heads of the layer (what each sequence's masses sum to).

    Returns:
        ``[batch]``, float32, compute device; no host synchronisation.
    """
    scores = selection.scores
    n = scores.shape[-1]
    blocks = torch.where(selection.keep, selection.blocks, n)  # not kept: a spare column, dropped below
    chosen = torch.zeros((scores.shape[0], 1, n + 1), dtype=torch.bool, device=scores.device)
    chosen = chosen.scatter_(-1, blocks, True)[..., :n]
    left = torch.where(torch.isfinite(scores) & ~chosen, scores, 0.0).sum(dim=(1, 2))
    return left / query_heads
