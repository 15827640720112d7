"""CUDA graphs of a layer's decode work: capture into a shared memory pool, replay with fresh inputs.

A decode step of one offloaded layer is about a hundred small device operations (scoring, top-k, slot assignment,
recall, gather, attention); launched one by one from Python they cost several times the device time they need.
While the shapes of that work stay the same, each layer captures it once and replays it: one launch per layer and
step. Everything a captured graph reads must keep its address while the graph lives: the step's shared inputs
(:class:`~hf_offload.attention.inputs.DecodeInputs`), the layer's open block, its summaries and block table (which
grow by whole chunks); what a growth replaces is held by the graph (:class:`CapturedDecode`), and a new graph is
captured. :class:`StaticInputs` gives the arguments of a whole decoder layer's call fixed addresses.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


@dataclass
class CapturedDecode:
    """One layer's captured decode attention.

    Attributes:
        graph: the CUDA graph.
        query: its input, ``[batch, q_heads, 1, head_dim]``, model dtype, CUDA (copied into before each replay).
        out: its output, ``[batch, 1, q_heads, head_dim]`` (overwritten by each replay).
        held: tensors the graph reads that the layer may replace while the graph lives.
    """

    graph: torch.cuda.CUDAGraph | SegmentedGraph
    query: torch.Tensor
    out: torch.Tensor
    held: tuple


class SegmentedGraph:
    """CUDA graphs replayed one after the other with host work between them: what a capture becomes where the
    captured code needs the host part-way (:func:`between_graphs`), e.g. to read blocks from disk between a layer's
    plan and its recall. Replays like one graph."""

    def __init__(self, graphs: list, work: list) -> None:
        if len(graphs) != len(work) + 1:
            raise ValueError("SegmentedGraph: one piece of host work between each two graphs")
        self.graphs, self.work = graphs, work

    def replay(self) -> None:
        for graph, work in zip(self.graphs, self.work):
            graph.replay()
            work()
        self.graphs[-1].replay()


class _Segments:
    """A capture in progress that :func:`between_graphs` may split: its graphs so far, the current one and the
    host work between them."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.done: list = []
        self.work: list = []
        self.graph = torch.cuda.CUDAGraph()

    def split(self, work) -> None:
        self.graph.capture_end()
        self.done.append(self.graph)
        self.work.append(work)
        if self.pool is None:  # the graphs of one capture share its memory pool
            self.pool = self.done[0].pool()
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def result(self):
        return self.graph if not self.done else SegmentedGraph([*self.done, self.graph], self.work)


_CAPTURING: list[_Segments] = []  # the captures of _capture_on in progress (innermost last)


def between_graphs(work) -> None:
    """Run ``work()`` (host work: it may synchronise with the device and launch operations) where it stands in the
    decode step. Op by op that is now; inside a capture of :func:`capture`, :func:`capture_work` or
    :func:`capture_decoder_layer` the capture ends here and a new graph starts, and each replay runs ``work()``
    between the two graphs (:class:`SegmentedGraph`). ``work`` reads and writes only tensors that keep their
    address while the graph lives (those the captured code created are kept alive by ``work``'s closure)."""
    if _CAPTURING and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        _CAPTURING[-1].split(work)
    else:
        work()


def _capture_on(stream_device: torch.device, enqueue, pool, stream: torch.cuda.Stream | None):
    """Capture ``enqueue()`` into a CUDA graph on ``stream`` (``None``: a new one); returns ``(graph, output)``:
    a :class:`SegmentedGraph` where the captured code asked for host work part-way (:func:`between_graphs`)."""
    segments = _Segments(pool)
    current = torch.cuda.current_stream(stream_device)
    stream = stream if stream is not None else torch.cuda.Stream(stream_device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        segments.graph.capture_begin(pool=pool)
        _CAPTURING.append(segments)
        try:
            out = enqueue()
        except BaseException:
            try:
                segments.graph.capture_end()
            except Exception:
                pass  # the capture was invalidated by the failure being raised (the caller starts a new pool)
            _end_generator_capture()
            raise
        finally:
            _CAPTURING.remove(segments)
        segments.graph.capture_end()
    current.wait_stream(stream)
    return segments.result(), out


def _end_generator_capture() -> None:
    """Take the device's default random generator out of capture mode after a failed capture.

    A capture registers the current device's default CUDA generator, and only a capture that ends cleanly releases
    it: after a failed one every later draw on that device (``generate(do_sample=True)``, a module's initialisation)
    raises "Offset increment outside graph capture encountered unexpectedly". An empty capture that ends cleanly,
    on the stream the failed one used, releases it.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the graph is empty: it is meant to be
            empty = torch.cuda.CUDAGraph()
            empty.capture_begin()
            empty.capture_end()
    except Exception:  # the failure being raised is the one the caller reports
        pass


def capture(body, query: torch.Tensor, pool, held: tuple, stream: torch.cuda.Stream | None = None) -> CapturedDecode:
    """Capture ``body(query_buffer)`` into a CUDA graph on a side stream; nothing runs on the device.

    Args:
        body: enqueues the work; takes the static query buffer and returns the output tensor. It must not
            synchronise with the host, allocate pinned memory or create tensors that outlive it outside the graph.
        query: an example input, ``[batch, q_heads, 1, head_dim]``, model dtype, CUDA (its shape, dtype and
            device are the graph's).
        pool: the memory pool handle shared by the graphs of one cache (``torch.cuda.graph_pool_handle()``).
        held: tensors to keep alive with the graph.
        stream: the side stream to capture on; ``None``: a new one. Graphs that share ``pool`` should share this
            stream too: the caching allocator reuses a freed block only for allocations on the stream that freed it,
            so captures on different streams cannot share their temporaries.

    Raises:
        Whatever the capture raised; the stream is out of capture mode either way.
    """
    static = query.detach().clone()
    graph, out = _capture_on(query.device, lambda: body(static), pool, stream)
    return CapturedDecode(graph=graph, query=static, out=out, held=held)


@dataclass
class CapturedWork:
    """Captured work that takes no arguments: it reads and writes buffers that keep their address while the graph
    lives (a layer's seal of a full block: :meth:`~hf_offload.cache.OffloadLayer.seal_work`).

    Attributes:
        graph: the CUDA graph.
        out: what the captured function returned (tensors overwritten by each replay).
        held: tensors the graph reads that their owner may replace while the graph lives.
    """

    graph: torch.cuda.CUDAGraph | SegmentedGraph
    out: object
    held: tuple


def capture_work(
    enqueue, device: torch.device, pool, held: tuple, stream: torch.cuda.Stream | None = None
) -> CapturedWork:
    """Capture ``enqueue()`` into a CUDA graph on a side stream; nothing runs on the device.

    Args:
        enqueue: enqueues the work on the current stream; the same rules as for :func:`capture`'s ``body``.
        device: the CUDA device it runs on.
        pool, held, stream: as for :func:`capture`.
    """
    graph, out = _capture_on(device, enqueue, pool, stream)
    return CapturedWork(graph=graph, out=out, held=held)


# ------------------------------------------------------------------------------------------- whole decoder layers
@dataclass
class CapturedLayer:
    """One decoder layer's captured decode step (``OffloadConfig.graph_scope="layer"``).

    Attributes:
        graph: the CUDA graph.
        statics: the fixed-address input buffers it reads, one per flattened argument (``None`` for a non-tensor).
        inputs: the :class:`StaticInputs` that owns those buffers.
        out: its outputs (the decoder layer's return value, tensors overwritten by each replay).
        held: tensors the graph reads that the cache may replace while the graph lives.
    """

    graph: torch.cuda.CUDAGraph | SegmentedGraph
    statics: list
    inputs: "StaticInputs"
    out: object
    held: tuple


def capture_decoder_layer(forward, args: tuple, kwargs: dict, statics: "StaticInputs", pool, held: tuple,
                  stream: torch.cuda.Stream | None = None, pad: Padding | None = None) -> CapturedLayer:
    """Capture one call ``forward(*args, **kwargs)`` of a decoder layer into a CUDA graph, its tensor arguments read
    from ``statics``' buffers (filled with this call's values first, on the current stream).

    Args:
        forward: the decoder layer's own forward.
        args, kwargs: the call's arguments (tensors on one CUDA device; any other value is fixed in the graph).
        statics: the fixed-address input buffers (shared by the layers of a cache on one device).
        pool, held, stream: as for :func:`capture`.
        pad: the call's tokens padded to more (a later prefill chunk's graph serves every length up to its own).
    """
    buffers, static_args, static_kwargs = statics.load(args, kwargs, pad=pad)
    device = next(b.device for b in buffers if b is not None)
    graph, out = _capture_on(device, lambda: forward(*static_args, **static_kwargs), pool, stream)
    return CapturedLayer(graph=graph, statics=buffers, inputs=statics, out=out, held=held)


def replay_layer(captured: CapturedLayer, args: tuple, kwargs: dict, flat: tuple | None = None,
                 pad: Padding | None = None):
    """Fill the buffers ``captured`` reads with this call's tensor arguments, replay it and return fresh copies of
    its outputs (the graph's own outputs are overwritten by its next replay). ``flat``: ``tree_flatten((args,
    kwargs))`` where the caller has it (:func:`call_signature` made it). ``pad``: the call's tokens padded as at
    the capture; the outputs are then cut back to the call's tokens (:meth:`Padding.trim`)."""
    out = replay_layer_in_place(captured, args, kwargs, flat, pad)
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, out)


def replay_layer_in_place(captured: CapturedLayer, args: tuple, kwargs: dict, flat: tuple | None = None,
                          pad: Padding | None = None):  # fmt: skip
    """:func:`replay_layer` without the copies: the graph's own outputs (cut back to the call's tokens with
    ``pad``), valid until its next replay (or that of a graph sharing its memory pool)."""
    buffers, _, _ = captured.inputs.load(args, kwargs, flat=flat, rebuild=False, pad=pad)
    if any(a is not b for a, b in zip(buffers, captured.statics)):
        raise RuntimeError("replay_layer: the static input buffers changed since the capture (shapes differ?)")
    captured.graph.replay()
    trim = (lambda x: x) if pad is None else pad.trim
    return tree_map(lambda x: trim(x) if isinstance(x, torch.Tensor) else x, captured.out)


@dataclass(frozen=True)
class Padding:
    """A decoder-layer call of ``tokens`` tokens per sequence run as one of ``padded`` tokens (a later prefill
    chunk's graph, captured once for every length up to ``padded``): each tensor argument with the tokens along
    :meth:`token_dim` is read from a buffer of ``padded`` tokens whose first ``tokens`` are the call's. The padded
    tokens come after the real ones, so under a causal mask no real token reads them; their outputs are cut off
    (:meth:`trim`), their keys and values never stored."""

    tokens: int
    padded: int
    batch: int

    def token_dim(self, tensor: torch.Tensor) -> int | None:
        """The dimension of ``tensor`` that runs over the call's tokens: 1 for ``[batch or 1, tokens, ...]`` (the
        hidden states, rotary embeddings, position ids), 0 for ``[tokens]`` (cache positions); ``None``: not
        padded."""
        if tensor.dim() >= 2 and tensor.shape[1] == self.tokens and tensor.shape[0] in (1, self.batch):
            return 1
        if tensor.dim() == 1 and tensor.shape[0] == self.tokens:
            return 0
        return None

    def shape(self, tensor: torch.Tensor, dim: int | None = -1) -> tuple:
        """The shape of ``tensor``'s buffer (``dim``: its :meth:`token_dim` where the caller has it)."""
        dim = self.token_dim(tensor) if dim == -1 else dim
        shape = list(tensor.shape)
        if dim is not None:
            shape[dim] = self.padded
        return tuple(shape)

    def trim(self, tensor: torch.Tensor) -> torch.Tensor:
        """An output of the padded call, ``[batch, padded, ...]``, cut back to the call's tokens (any other
        shape as it is)."""
        if tensor.dim() >= 2 and tensor.shape[1] == self.padded:
            return tensor.narrow(1, 0, self.tokens)
        return tensor


def call_signature(args: tuple, kwargs: dict, flat: tuple | None = None, pad: Padding | None = None) -> tuple:
    """What a captured decoder-layer call depends on besides tensor contents: each tensor argument's position,
    shape, dtype and device, and each other argument's type (its value, for a bool, number, string or ``None``).
    ``flat``: ``tree_flatten((args, kwargs))`` if the caller has it; ``pad``: shapes as padded."""
    leaves, spec = tree_flatten((args, kwargs)) if flat is None else flat
    sig = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            shape = tuple(leaf.shape) if pad is None else pad.shape(leaf)
            sig.append((shape, leaf.dtype, leaf.device, leaf.requires_grad))
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            sig.append((type(leaf), leaf))
        else:
            sig.append(type(leaf))
    return (str(spec), tuple(sig))


class StaticInputs:
    """The fixed-address input buffers of the decoder-layer graphs of one cache on one device.

    A buffer belongs to an argument position (in the flattened ``(args, kwargs)``), shape and dtype, and is shared
    by every layer: the layers replay one after the other on one stream, so the copy of layer ``i + 1``'s hidden
    states into the buffer is ordered after layer ``i``'s replay read it. An argument whose tensor is the very
    object copied last (the rotary embeddings, positions: one tensor per forward for every layer) is not copied
    again.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._last: dict[tuple, torch.Tensor] = {}

    def load(
        self, args: tuple, kwargs: dict, flat: tuple | None = None, rebuild: bool = True, pad: Padding | None = None
    ) -> tuple[list, tuple | None, dict | None]:
        """Copy the tensor arguments into their buffers (on the current stream).

        Args:
            args, kwargs: the call's arguments.
            flat: ``tree_flatten((args, kwargs))`` if the caller has it.
            rebuild: also return the arguments rebuilt around the buffers (a capture needs them, a replay not).
            pad: buffers of the padded length for the arguments that run over the tokens, the call's values copied
                into their first tokens (made zero-filled: the rest holds zeros or an earlier call's values, finite
                either way).

        Returns:
            ``(buffers, static_args, static_kwargs)``: one buffer (or ``None``) per flattened argument, and the
            arguments with every tensor replaced by its buffer (``None, None`` without ``rebuild``).
        """
        leaves, spec = tree_flatten((args, kwargs)) if flat is None else flat
        buffers, static = [], []
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                buffers.append(None)
                static.append(leaf)
                continue
            dim = None if pad is None else pad.token_dim(leaf)
            shape = tuple(leaf.shape) if dim is None else pad.shape(leaf, dim)
            slot = (i, shape, leaf.dtype, leaf.device)
            buffer = self._buffers.get(slot)
            if buffer is None:
                buffer = torch.empty_like(leaf, memory_format=torch.contiguous_format) if dim is None else (
                    torch.zeros(shape, dtype=leaf.dtype, device=leaf.device))  # fmt: skip
                self._buffers[slot] = buffer
                self._last.pop(slot, None)
            if self._last.get(slot) is not leaf:
                (buffer if dim is None else buffer.narrow(dim, 0, leaf.shape[dim])).copy_(leaf)
                self._last[slot] = leaf
            buffers.append(buffer)
            static.append(buffer)
        if not rebuild:
            return buffers, None, None
        static_args, static_kwargs = tree_unflatten(static, spec)
        return buffers, static_args, static_kwargs

    def clear(self) -> None:
        """Forget the buffers (graphs that read them keep them alive)."""
        self._buffers.clear()
        self._last.clear()

    def forget_last(self) -> None:
        """Keep the buffers but copy every argument into them at the next call (another cache's tensors may sit at
        the addresses of the last ones)."""
        self._last.clear()
