"""The graph runner of one offloaded layer: capture a decode step once per geometry, replay it after.

Three kinds of graph, each keyed by what it depends on besides buffer contents:

* the decode attention (``(n, k, query shape and dtype, scale, input rows, storage key, reuse)``): plan, recall
  and attention of one step (:meth:`GraphRunner.run_decode`);
* the whole decoder layer around it (``graph_scope="layer"``): norms, projections, MLP, the cache update and the
  attention in one replay (:meth:`GraphRunner.run_decoder_layer`);
* the seal of a block that a replayed step filled (:meth:`GraphRunner.seal_replayed`).

A graph reads buffers at fixed addresses (the block store's open block, summaries and tables, the step's shared
inputs); what a growth replaces is held by the graph and changes the storage key, so a new graph is captured. Side
stream work a graph depends on is waited for outside it (a graph cannot wait on events recorded outside it).
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..attention.handoff import OffloadMask, plain_causal, take_handoff
from ..attention.prefill import left_padding
from ..config import OffloadConfig
from ..selectors import Selector
from ..store import transfer
from .blocks import BlockStore
from ..attention.inputs import DecodeInputs
from .capture import (CapturedDecode, CapturedLayer, Padding, StaticInputs, call_signature, replay_layer,
                      replay_layer_in_place)  # fmt: skip
from .execution import LayerExecution, hidden_states
from .planner import DecodePlanner
from .recaller import Recaller
from .stats import LayerStats


@dataclass
class LayerCapture:
    """What a decode step of a whole decoder layer being captured uses: the step's shared inputs, the blocks it
    scores, the blocks the budget selects, whether it reuses the layer's kept selection (``reselect_every``), and
    the next layer's recaller where the attention starts that layer's prefetch from this layer's query
    (``lookahead_query="same"``, or no predicted query)."""

    inputs: DecodeInputs
    n: int
    k: int
    reuse: bool = False
    ahead: Recaller | None = None  # the next layer, prefetched for from this layer's query (lookahead in the graph)


# Questions over a shared prefix (a fork's later prefill chunks) of at most this many tokens replay a graph of the
# whole decoder layer; the graph of a chunk runs it padded to the next power of two from QUESTION_MIN_TOKENS.
QUESTION_GRAPH_TOKENS = 512
QUESTION_MIN_TOKENS = 32
# Question graphs kept per layer (least recently used dropped first).
QUESTION_GRAPHS = 4


def question_tokens(q_len: int) -> int:
    """The tokens a question of ``q_len`` tokens runs as in its graph: the next power of two, at least
    :data:`QUESTION_MIN_TOKENS` (one graph serves every length up to it)."""
    return max(QUESTION_MIN_TOKENS, 1 << (q_len - 1).bit_length())


class NotCapturable(Exception):
    """Raised inside a question's capture where its attention would take a path that synchronises with the host
    (the tiled one: soft-capping, sink logits): the layer's questions run op by op."""


@dataclass
class QuestionCapture:
    """A question's decoder layer being captured (or run once before its capture): the chunk's keys and values as
    the layer's update received them (``[batch, tokens, kv_heads, head_dim]`` views), for the append after each
    replay."""

    kv: tuple | None = None


class GraphRunner:
    """Captures and replays one offloaded layer's decode steps.

    Args:
        config: the cache's settings (``cuda_graphs``, ``graph_scope``, sink and window).
        selector: the selection policy (its branch is part of a step's geometry).
        layer_idx: index of the layer in the model (for messages).
        blocks, planner, recaller: the layer's other parts.
        execution: the layer's execution decisions (``graphs``; a failed capture turns it off).
        stats: the layer's counters.
        decode_inputs: returns the cache's shared :class:`~hf_offload.cache.capture.DecodeInputs` of a device.
        capture_graph: ``(device, body, query, held) -> CapturedDecode``: captures a decode step in the memory pool
            the cache's graphs on that device share.
        capture_layer: ``(device, forward, args, kwargs, held) -> CapturedLayer``: likewise a whole decoder layer.
        capture_work: ``(device, enqueue, held) -> CapturedWork``: likewise work without arguments (a seal).

    Attributes:
        layer_capture: set while a whole decoder layer is being captured (the cache update and the attention
            record their step's work as this says).
        layer_graphs: ``False`` once a capture of the whole decoder layer failed.
        ahead_graphs: ``False`` once a capture of the whole layer with the next layer's prefetch in it failed (the
            layer's graphs then hold no lookahead).
        seal_graphs: whether seals after replayed steps replay captured graphs; ``False`` once a capture failed.
        warm_geometries: :meth:`warm_for` values of the decode steps run op by op.
    """

    def __init__(
        self,
        config: OffloadConfig,
        selector: Selector,
        layer_idx: int,
        blocks: BlockStore,
        planner: DecodePlanner,
        recaller: Recaller,
        execution: LayerExecution,
        stats: LayerStats,
        decode_inputs: Callable[[torch.device], DecodeInputs],
        capture_graph: Callable,
        capture_layer: Callable,
        capture_work: Callable,
    ):
        self.config = config
        self.selector = selector
        self.layer_idx = layer_idx
        self.blocks = blocks
        self.planner = planner
        self.recaller = recaller
        self.execution = execution
        self.stats = stats
        self.decode_inputs = decode_inputs
        self._capture_graph = capture_graph
        self._capture_layer = capture_layer
        self._capture_work = capture_work
        self.graphs: dict[tuple, object] = {}
        self.warm_geometries: set[tuple] = set()
        self.layer_capture: LayerCapture | None = None
        self.layer_graphs = True
        self.ahead_graphs = True  # False once a capture with the next layer's prefetch in it failed
        self.seal_graphs = True
        self.last_key: tuple | None = None  # the graph key of this layer's last decode step
        # Questions over a shared prefix: the tokens of the prefix a refilled fork continues (OffloadCache.fork(into=
        # ...) sets it at each refill), whose first later prefill chunk replays a graph; None: not a refilled fork,
        # or its questions run op by op. Their graphs by key, least recently used first; the one being captured.
        self.questions: int | None = None
        self.question_graphs_on = True  # False once a question's capture failed
        self.question_graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.question_capture: QuestionCapture | None = None
        # The block capacity of the first decode step since the layer was allocated or recycled: its graphs are kept
        # beside those of the current capacity, so that the next cache that takes this layer (parking) finds them.
        self.entry_n: int | None = None
        self.warned_rounds = False

    def note_rounds(self, k: int, slots: int) -> None:
        """A decode step whose ``k`` selected blocks exceed the ``slots`` of the slot pool runs in rounds, op by op:
        where ``cuda_graphs=True`` asked for graphs, say so once (per layer 0: once per cache)."""
        if self.config.cuda_graphs is True and self.execution.graphs and not self.warned_rounds and not self.layer_idx:
            self.warned_rounds = True
            warnings.warn(
                f"cuda_graphs=True: a decode step selects {k} blocks but the slot pool holds {slots}, so it runs "
                f"in rounds without CUDA graphs. Raise pool_tokens to at least {k} blocks ({k} x block_tokens) or "
                "leave it unset (1.25 x the budget).",
                RuntimeWarning,
                stacklevel=4,
            )

    def clear(self) -> None:
        """Drop every captured graph (each is captured again at its next step)."""
        self.graphs.clear()
        self.question_graphs.clear()

    def reset(self) -> None:
        """Drop the graphs and what the layer's earlier steps taught (a reset cache starts afresh)."""
        self.graphs.clear()
        self.question_graphs.clear()
        self.warm_geometries.clear()
        self.last_key = None
        self.entry_n = None

    def recycle(self, live_rows: set[int]) -> None:
        """Keep the graphs for the next cache of the model (:meth:`OffloadLayer.recycle`), except those that can never
        replay again: keyed by buffers replaced since (a storage key of older summary, block-table or chunk-table
        buffers: their counters only grow) or by step inputs no longer kept (``live_rows``: the addresses of the
        rows buffers the step's shared inputs keep). The next cache's first decode step sets the entry capacity."""
        now = self.blocks.storage_key()[:2]

        def live(key: tuple) -> bool:
            if key[0] == "seal":
                return key[1][:2] == now
            attention = key[2] if key[1] == "layer" else key
            return attention[5] in live_rows and attention[6][:2] == now

        self.graphs = {key: graph for key, graph in self.graphs.items() if live(key)}
        # A question's graph reads only buffers that the storage key names (a refilled fork keeps them).
        self.question_graphs = OrderedDict((key, g) for key, g in self.question_graphs.items() if key[4][:2] == now)
        self.questions = None  # a fork's refill sets it again
        self.entry_n = None
        self.warned_rounds = False

    def _kept_capacities(self, n: int) -> tuple:
        """The block capacities whose graphs a capture at capacity ``n`` keeps: ``n`` and the entry capacity."""
        return (n, n if self.entry_n is None else self.entry_n)

    def _before_key(self, n: int) -> None:
        """Before a decode step at block capacity ``n`` reads its storage key: note the entry capacity, and grow the
        buffers where the next seal would (:meth:`BlockStore.grow_for_next_seal`), so that the step's graph serves
        the seals to come."""
        if self.entry_n is None:
            self.entry_n = n
        self.blocks.grow_for_next_seal()

    # --------------------------------------------------------------------------------------------- decode attention
    def warm_for(self, n: int, k: int, query: torch.Tensor, scaling: float, reuse: bool = False) -> tuple:
        """What a decode step's work compiles and plans for, besides buffer addresses: the selected blocks, the
        query's shape and dtype, the scale, the branches that depend on the number of sealed blocks ``n`` (everything
        selected; the selector's branch, :meth:`Selector.decode_branch
        <hf_offload.selectors.base.Selector.decode_branch>`) and the integer specialisations Triton compiles for
        (``n`` equal to 1, or a multiple of 16), and whether the step reuses the kept selection (``reuse``). A
        geometry whose value is in :attr:`warm_geometries` has run op by op before and can be captured without
        running it op by op first."""
        return (k, tuple(query.shape), query.dtype, scaling, k >= n, n == 1, n % 16 == 0,
                self.selector.decode_branch(n, k), reuse)  # fmt: skip

    def run_decode(
        self,
        n: int,
        k: int,
        query: torch.Tensor,
        scaling: float,
        inputs: DecodeInputs,
        reuse: bool,
        op_by_op: Callable[[], torch.Tensor],
        body: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """One decode step of the layer's attention: replayed where a graph of its geometry exists, else run op by
        op (``op_by_op()``) and captured (``body(query_buffer)``) where graphs are on.

        A geometry whose kind this layer has already run op by op (:meth:`warm_for`) is captured right away and
        replayed for the step itself; otherwise the step first runs op by op (compiling kernels and planning what a
        capture must not), then is captured.

        Args:
            n, k: blocks the step scores and selects.
            query: ``[batch, q_heads, 1, head_dim]``, model dtype, compute device.
            scaling: softmax scale.
            inputs: the step's shared inputs.
            reuse: the step attends the kept selection.
            op_by_op: runs the step's work now (with timing and lookahead) and returns its output.
            body: enqueues the step's work for a capture given the query buffer; returns the output buffer.

        Returns:
            ``[batch, 1, q_heads, head_dim]``, ``query.dtype``.
        """
        if self.execution.graphs:
            self._before_key(n)
        key = (n, k, tuple(query.shape), query.dtype, scaling, inputs.rows.data_ptr(), self.blocks.storage_key(), reuse)
        self.last_key = key
        graph = self.graphs.get(key) if self.execution.graphs else None
        warm = self.warm_for(n, k, query, scaling, reuse)
        if graph is None and self.execution.graphs and warm in self.warm_geometries:
            start = time.perf_counter()
            graph = self._capture_decode(key, body, query, inputs, retry_op_by_op=True)
            self.stats.add(("graph_capture_us",), round((time.perf_counter() - start) * 1e6))
        if graph is not None:
            return self.replay(graph, query)
        start = time.perf_counter()
        out = op_by_op()
        self.warm_geometries.add(warm)
        if self.execution.graphs:
            self._capture_decode(key, body, query, inputs)
            self.stats.add(("graph_capture_us",), round((time.perf_counter() - start) * 1e6))
        return out

    def replay(self, graph: CapturedDecode, query: torch.Tensor) -> torch.Tensor:
        """One decode step of this layer's attention from its captured graph.

        Args:
            graph: a captured decode step.
            query: ``[batch, q_heads, 1, head_dim]``, model dtype, CUDA.

        Returns:
            ``[batch, 1, q_heads, head_dim]``: the graph's output buffer (overwritten by its next replay).
        """
        self.recaller.wait_side_streams()
        graph.query.copy_(query)
        graph.graph.replay()
        self.stats.add(("decode_steps", "graph_replays"), 1)
        return graph.out

    def _capture_decode(self, key: tuple, body: Callable[[torch.Tensor], torch.Tensor], query: torch.Tensor,
                        inputs: DecodeInputs, retry_op_by_op: bool = False) -> CapturedDecode | None:
        """Capture ``body`` (this layer's decode attention) for ``key``; returns the graph, or ``None``.

        Graphs of an earlier geometry are dropped. If the capture fails, this layer runs op by op from then on
        (with ``cuda_graphs=True``: the error is raised), unless ``retry_op_by_op``: then the failure is only counted
        (``graph_capture_retries``) and the caller runs the step op by op and captures again.
        """
        kept = self._kept_capacities(key[0])
        self.graphs = {g: v for g, v in self.graphs.items() if g[0] in kept or g[0] == "seal"}
        self.stats.prepare_capture(self.blocks.device, self.blocks.batch)
        self.recaller.wait_side_streams()
        held = (*self.blocks.held_buffers(), *self.recaller.held_buffers(), inputs.rows, inputs.valid, inputs.forced,
                inputs.sequence)
        try:
            self.graphs[key] = self._capture_graph(self.blocks.device, body, query, held)
            self.stats.add(("graph_captures",), 1)
            return self.graphs[key]
        except Exception as error:
            if retry_op_by_op:
                self.stats.add(("graph_capture_retries",), 1)
                return None
            if self.config.cuda_graphs:
                raise RuntimeError(f"Layer {self.layer_idx}: capturing the decode step failed: {error}") from error
            warnings.warn(
                f"Layer {self.layer_idx}: capturing the decode step into a CUDA graph failed ({error}); this layer "
                "runs op by op from now on.",
                RuntimeWarning,
                stacklevel=3,
            )
            self.execution.graphs = False
            self.graphs.clear()
            return None

    # ----------------------------------------------------------------------------------------- whole decoder layers
    def layer_step(self, args: tuple, kwargs: dict) -> tuple | None:
        """``(graph key, shared inputs, blocks scored, blocks selected, flattened arguments)`` of a decoder layer call
        that a graph of the whole layer can serve, or ``None``: not a decode step of one token per sequence on this
        layer's device, a mask other than plain causal, gradients on, or a geometry whose attention graph does not
        exist (the attention was never captured for it, or runs another path: soft-capping, sink logits, a
        selection larger than the slot pool)."""
        store = self.blocks
        if not (self.execution.graphs and self.layer_graphs and self.config.graph_scope == "layer"):
            return None
        if not store.is_initialized or not store.n_blocks or torch.is_grad_enabled() or len(args) > 1:
            return None
        hidden = hidden_states(args, kwargs)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[:2] != (store.batch, 1):
            return None
        recent = store.keys.shape[-2] + 1  # this step's token included (block_tokens: it fills the open block)
        if hidden.device != store.device:
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and not (isinstance(mask, OffloadMask) and plain_causal(mask)):
            return None
        last = self.last_key
        if last is None:
            return None
        n_before = store.n_blocks
        k = self.planner.decode_blocks(n_before, recent)
        n = self.planner.decode_capacity(n_before, k)
        inputs = self.decode_inputs(store.device).update(
            store.batch, n_before, store.block_tokens, n_before * store.block_tokens, recent,
            None if mask is None else mask.padding, self.config.sink_blocks, self.config.window_blocks, store.device,
            step=mask, capacity=n,
        )  # fmt: skip
        reuse = self.planner.reuses_selection(store.n_tokens, n_before, k, n)
        self._before_key(n)
        attention_key = (n, k, *last[2:5], inputs.rows.data_ptr(), store.storage_key(), reuse)
        # The step's attention must have run (and been captured) at this very key before: by an earlier step of this
        # cache, or of the cache that parked this layer (the first decode step of a later generate() call).
        if attention_key not in self.graphs:
            return None
        flat = tree_flatten((args, kwargs))  # read once: by the signature and by the replay's copies
        # Lookahead in the graph: it reads the next layer's buffers, whose change means another graph.
        ahead = self.recaller.ahead_in_graph(n_before, n, k) if self.ahead_graphs else None
        ahead_key = None if ahead is None else ahead.blocks.storage_key()
        return (n, "layer", attention_key, call_signature(args, kwargs, flat), ahead_key), inputs, n, k, flat

    def run_decoder_layer(self, step: tuple, forward: Callable, args: tuple, kwargs: dict):
        """Run a decoder layer call that :meth:`layer_step` accepted (``step``): replay its graph (captured now if
        it is the first step of its key), then do what the cache update and the attention do on the host in a step
        run op by op: count the token, seal a block it filled, put sealed blocks into the slot pool."""
        key, inputs, n, k, flat = step
        graph = self.graphs.get(key)
        if graph is None:
            graph = self._capture_whole_layer(key, forward, args, kwargs, inputs, n, k)
            if graph is None:
                return forward(*args, **kwargs)
        if key[2][-1]:
            self.stats.add(("reused_selections",), 1)
        store = self.blocks
        store.selectable_written = store.last_write
        self.recaller.wait_side_streams()
        if key[4] is not None:  # the graph prefetches for the next layer: its host blocks must be written
            self._wait_for_next()
        out = replay_layer(graph, args, kwargs, flat)
        left = store.keys.shape[-2] + 1
        store.n_tokens += 1
        if left == store.block_tokens:
            # The token filled the open block: seal it now. A step run op by op seals it in update(), before its
            # attention, which still reads it as recent tokens and selects among the blocks sealed before; so the
            # same graph serves this step, and the seal (summaries, host write, slot) follows it.
            self.seal_replayed()
            left = 0
        store.keys, store.values = store.open_k[:, :, :left], store.open_v[:, :, :left]
        self.stats.add(("decode_steps", "graph_replays", "layer_graph_replays"), 1)
        self.recaller.wait_prefetch()  # the slot written next may be one a prefetch was filling
        store.finish_step()
        return out

    def _capture_whole_layer(self, key: tuple, forward: Callable, args: tuple, kwargs: dict, inputs: DecodeInputs,
                             n: int, k: int) -> CapturedLayer | None:
        """Capture the whole decoder layer's decode step for ``key``; returns the graph, or ``None`` after warning
        once (the layer's code could not be captured: from then on this layer replays only its attention's graph).
        Graphs of the whole layer for other keys are dropped, except the one that differs from ``key`` only in
        whether the step reuses the kept selection (``reselect_every``: the two alternate)."""

        def twin(g: tuple) -> bool:  # the same geometry, signature and buffers; the other kind of step
            return g[0] == key[0] and g[2][:-1] == key[2][:-1] and g[3:] == key[3:]

        entry = self._kept_capacities(key[0])[1]
        # Of the whole-layer graphs: this key's twin, and those of the entry capacity while this one is another.
        self.graphs = {g: v for g, v in self.graphs.items()
                       if g[1:2] != ("layer",) or twin(g) or g[0] == entry != key[0]}  # fmt: skip
        store = self.blocks
        self.stats.prepare_capture(store.device, store.batch)
        store.selectable_written = store.last_write
        self.recaller.wait_side_streams()
        held = (*store.held_buffers(), *self.recaller.held_buffers(), inputs.rows, inputs.valid, inputs.forced,
                inputs.sequence, inputs.open_pos)
        ahead = None if key[4] is None else self.recaller.ahead_in_graph(store.n_blocks, n, k)
        plain = forward
        if ahead is not None:
            ahead.stats.prepare_capture(store.device, store.batch)
            ahead.prefetch_marks()
            held = (*held, *ahead.blocks.held_buffers(), *ahead.held_buffers())
            self._wait_for_next()
            forward = self._with_lookahead(forward, ahead, inputs, n, k)
        start = time.perf_counter()
        self.layer_capture = LayerCapture(inputs, n, k, key[2][-1])
        try:
            graph = self._capture_layer(store.device, forward, args, kwargs, held)
        except Exception as error:
            take_handoff()  # an update the failed capture left for an attention that never ran
            if ahead is not None:  # the layer without the next layer's prefetch, before giving up on its graphs
                self.ahead_graphs = False
                warnings.warn(
                    f"Layer {self.layer_idx}: capturing the next layer's prefetch inside the whole decoder layer's "
                    f"CUDA graph failed ({error}); this layer's graphs run without it (lookahead op by op only).",
                    RuntimeWarning,
                    stacklevel=4,
                )
                self.layer_capture = None
                return self._capture_whole_layer((*key[:4], None), plain, args, kwargs, inputs, n, k)
            self.layer_graphs = False
            warnings.warn(
                f"Layer {self.layer_idx}: capturing the whole decoder layer into a CUDA graph failed ({error}); this "
                "layer replays only its attention's graph from now on (graph_scope='attention').",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        finally:
            self.layer_capture = None
        self.graphs[key] = graph
        self.stats.add(("layer_graph_captures",), 1)
        self.stats.add(("graph_capture_us",), round((time.perf_counter() - start) * 1e6))
        return graph

    # ------------------------------------------------------------------------------ questions over a shared prefix
    def question_step(self, args: tuple, kwargs: dict) -> tuple | None:
        """``(padding, arguments, flattened arguments, signature)`` of a decoder layer call that a question graph
        serves (:meth:`run_question` makes its key), or
        ``None``: not the first chunk of a refilled fork after its prefix (:attr:`questions`: a question; later
        chunks, such as the turns of a conversation, would each need a graph of their own) of 2 to
        :data:`QUESTION_GRAPH_TOKENS` tokens per sequence on this layer's device, after sealed blocks, with a plain
        causal mask and no padding, gradients off; on CUDA, the kernel path without a disk tier (the one whose
        recall of the earlier blocks does not synchronise with the host).

        The graph's key holds what its work depends on besides buffer contents: the padded length, the sealed
        blocks before the chunk and the open block's tokens (the same after every refill of a fork from one
        prefix), the buffers (:meth:`BlockStore.storage_key`, read once the forward has made room on the device)
        and the call's signature."""
        store = self.blocks
        if self.questions is None or not (self.question_graphs_on and self.execution.graphs):
            return None
        if not store.is_initialized or store.n_tokens != self.questions or not store.n_blocks:
            return None
        if self.config.cuda_graphs is False or torch.is_grad_enabled() or len(args) > 1:
            return None
        hidden = hidden_states(args, kwargs)
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[0] != store.batch:
            return None
        tokens = hidden.shape[1]
        if not 1 < tokens <= QUESTION_GRAPH_TOKENS or hidden.device != store.device:
            return None
        if store.device.type == "cuda" and (not self.execution.use_kernels or store.host.disk_chunks):
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if not (isinstance(mask, OffloadMask) and plain_causal(mask)):
                return None
            left_padded, starts = left_padding(mask, store.n_tokens + tokens)
            if not left_padded or starts is not None:  # padded sequences: op by op
                return None
        pad = Padding(tokens, question_tokens(tokens), store.batch)
        kwargs = {**kwargs, "attention_mask": None} if "attention_mask" in kwargs else kwargs
        flat = tree_flatten((args, kwargs))
        return pad, args, kwargs, flat, call_signature(args, kwargs, flat, pad)

    def run_question(self, step: tuple, forward: Callable, note_forward: Callable[[int], None]):
        """Run a decoder layer call that :meth:`question_step` accepted: replay its graph (captured first if it is
        the first call of its key), then append the chunk's keys and values to the cache as an update run op by op
        does (sealing the blocks they fill) and count what it counts. ``None`` where the layer's questions turn out
        not to be capturable (the caller runs the call op by op; this layer's questions stay op by op).

        Args:
            step: :meth:`question_step`'s value.
            forward: the decoder layer's own forward.
            note_forward: the layer's bookkeeping at the start of a forward, given the chunk's tokens.
        """
        pad, args, kwargs, flat, signature = step
        store = self.blocks
        note_forward(pad.tokens)  # may move admitted chunks to the host: the buffers are read after it
        key = ("question", pad.padded, store.n_blocks, store.keys.shape[-2], store.storage_key(), signature)
        # The chunk reads only blocks sealed before it: their host writes are waited for here, outside the graph.
        transfer.wait_event(store.last_write, store.device)
        store.selectable_written = None
        self.recaller.wait_side_streams()
        found, reference = self.question_graphs.get(key), None
        if found is None:
            captured = self._capture_question(key, pad, forward, args, kwargs)
            if captured is None:
                return None
            found, reference = captured
        else:
            self.question_graphs.move_to_end(key)
        graph, counted = found
        # The keys and values are appended below, before any other replay: read in place; the output is copied.
        out, keys, values = replay_layer_in_place(graph, args, kwargs, flat, pad)
        out = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)
        replayed = reference is None or _same_outputs((out, keys, values), reference, pad)
        if not replayed:
            # The first replay must give what the same padded call gave op by op: where it does not, the layer's
            # questions run op by op from now on, and this one takes the op-by-op results.
            self.question_graphs.pop(key, None)
            self.question_graphs_on = False
            warnings.warn(
                f"Layer {self.layer_idx}: a question's replayed CUDA graph did not reproduce the same call run op by "
                "op; this layer's questions over a shared prefix run op by op from now on.",
                RuntimeWarning,
                stacklevel=4,
            )
            out, keys, values = (pad.trim(t) for t in reference)
        store.append(keys.transpose(1, 2), values.transpose(1, 2))
        self.recaller.wait_prefetch()
        store.finish_step()
        for name, value in counted.items():
            self.stats.add((name,), value)
        self.stats.add(("question_graph_replays",), int(replayed))
        return out

    def _capture_question(self, key: tuple, pad: Padding, forward: Callable, args: tuple, kwargs: dict):
        """Capture the question graph of ``key``: the padded call run once op by op in the capture's mode first
        (kernels compiled and checked, nothing of the cache changed), then captured. Returns ``((graph, counts),
        reference)``: the counters that one call adds (added again at each replay) and the op-by-op run's outputs
        (the first replay is checked against them), or ``None`` after turning this layer's question graphs off
        (with a warning where the capture itself failed)."""
        store = self.blocks

        def padded_forward(*a, **kw):
            self.question_capture = QuestionCapture()
            try:
                out = forward(*a, **kw)
                keys, values = self.question_capture.kv
            finally:
                self.question_capture = None
            return out, keys, values

        totals = self.stats.totals_snapshot()
        start = time.perf_counter()
        try:
            with torch.no_grad():
                # The padded call in buffers of its own (zeros past the call's tokens), run op by op: kernels
                # compiled, checks run.
                _, padded_args, padded_kwargs = StaticInputs().load(args, kwargs, pad=pad)
                reference = padded_forward(*padded_args, **padded_kwargs)
            counted = self.stats.totals_delta(totals)
            held = (*store.held_buffers(), *self.recaller.held_buffers(), store.open_k, store.open_v)
            graph = self._capture_layer(store.device, padded_forward, args, kwargs, held, pad=pad)
        except NotCapturable:
            take_handoff()
            self.question_graphs_on = False
            return None
        except Exception as error:  # noqa: BLE001 -- reported once; the layer runs op by op
            take_handoff()  # an update the failed capture left for an attention that never ran
            self.question_graphs_on = False
            warnings.warn(
                f"Layer {self.layer_idx}: capturing a question's decoder layer into a CUDA graph failed ({error}); "
                "this layer's questions over a shared prefix run op by op from now on.",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        finally:
            self.stats.restore_totals(totals)
        self.question_graphs[key] = (graph, counted)
        while len(self.question_graphs) > QUESTION_GRAPHS:
            self.question_graphs.popitem(last=False)
        self.stats.add(("question_graph_captures",), 1)
        self.stats.add(("graph_capture_us",), round((time.perf_counter() - start) * 1e6))
        return (graph, counted), reference

    def _with_lookahead(self, forward: Callable, ahead: Recaller, inputs: DecodeInputs, n: int, k: int) -> Callable:
        """``forward`` with the next layer's prefetch in it, for a capture of the whole layer: started from the next
        layer's query predicted from this layer's input (``lookahead_query="next"``) before the layer's work, else
        by the attention from this layer's query (:attr:`LayerCapture.ahead`); joined after the layer's work, so that
        the recall runs behind it on the prefetch stream and the graph ends with it done."""
        recaller = self.recaller

        def forward_with_lookahead(*args, **kwargs):
            predicted = recaller.predicted_query(args, kwargs)
            if predicted is not None:
                ahead.prefetch_in_graph(*predicted, inputs, n, k)
            elif self.layer_capture is not None:
                self.layer_capture.ahead = ahead
            try:
                return forward(*args, **kwargs)
            finally:
                ahead.wait_prefetch()  # the fork joined inside the capture

        return forward_with_lookahead

    def _wait_for_next(self) -> None:
        """Before a graph that prefetches for the next layer: the compute stream waits for that layer's host writes
        (events outside the graph) and its pending prefetch."""
        nxt = self.recaller.next
        nxt.wait_prefetch()
        transfer.wait_event(nxt.blocks.last_write, nxt.blocks.device)

    # --------------------------------------------------------------------------- seals after a replayed decode step
    def seal_key(self) -> tuple:
        """What a captured seal depends on: the buffers it writes and the host pool's chunk tables (the storage
        key, which also says whether every chunk is admitted to the device: then the block's write is part of the
        graph) and the batch."""
        return ("seal", self.blocks.storage_key(), self.blocks.batch)

    def seal_replayed(self) -> None:
        """Seal the open block that a replayed decode step filled (``block_tokens`` tokens in every sequence).

        The device work of a seal (:meth:`BlockStore.seal_work`: the block's copy, its summaries, its block-table
        column) is a few dozen small operations; launched one by one from Python, the seals of every layer cost the
        host several decode steps' worth of time. That work reads the block's position and host ids from a device
        buffer (filled by one copy), so one CUDA graph serves every seal of one :meth:`seal_key`: the first seal of
        a key runs it op by op (so that every kernel in it has run before the capture) and captures it, the later
        ones replay it. A block whose host pool is not wholly admitted to the device is written to the host by the
        offload stream after the work.
        """
        store = self.blocks
        ids = store.allocate_seal_ids()
        if not (self.seal_graphs and self.execution.graphs and store.holds_next_block()):
            store.seal(store.open_k, store.open_v, 1, ids=ids)
            return
        key = self.seal_key()
        graph = self.graphs.get(key)
        if graph is None:
            store.seal_from(ids, store.seal_work)
            self._capture_seal(key)
            return

        def replay() -> torch.Tensor:
            graph.graph.replay()
            return graph.out

        store.seal_from(ids, replay)
        self.stats.add(("seal_graph_replays",), 1)

    def _capture_seal(self, key: tuple) -> None:
        """Capture the block store's seal work for ``key``, dropping the seal graph of an earlier key; warns once
        and turns :attr:`seal_graphs` off if the capture fails."""
        self.graphs = {k: g for k, g in self.graphs.items() if k[0] != "seal"}
        store = self.blocks
        held = (*store.held_buffers(), store.seal_buffer())
        try:
            graph = self._capture_work(store.device, store.seal_work, held)
        except Exception as error:
            self.seal_graphs = False
            warnings.warn(
                f"Layer {self.layer_idx}: capturing the seal of a block into a CUDA graph failed ({error}); this "
                "layer seals op by op from now on.",
                RuntimeWarning,
                stacklevel=5,
            )
            return
        self.graphs[key] = graph
        self.stats.add(("seal_graph_captures",), 1)


def _same_outputs(got: tuple, reference: tuple, pad: Padding) -> bool:
    """Whether a question's first replay (``(out, keys, values)``, cut to the call's tokens) gave the padded call's
    op-by-op outputs ``reference`` (the same kernels on the same inputs: equal but for a reduction order)."""
    for a, b in zip(tree_flatten(got)[0], tree_flatten(reference)[0]):
        if isinstance(a, torch.Tensor):
            b = pad.trim(b)
            if a.shape != b.shape or not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2):
                return False
    return True
