"""What a decode step of the offloaded layers shares, and the CUDA graphs that replay a layer's decode attention.

A decode step of one offloaded layer is about a hundred small device operations (scoring, top-k, slot assignment,
recall, gather, attention). Launched one by one from Python they cost several times the device time they need (an
8B-shaped model at 32K and batch 8 spends ~95 ms per step, almost all of it host-side launch work;
``docs/results/decode.md``). While the shapes of that work stay the same, each layer captures it once into a CUDA
graph and replays it: one launch per layer and step. The shapes follow the number of blocks a step scores, the
sealed blocks rounded up to ``OffloadConfig.decode_capacity_blocks`` (64 with graphs: one capture per 64 seals
instead of one per seal), the blocks past the sealed ones masked out of the selection and the attention.

Everything a captured graph reads must keep its address while the graph lives. :class:`DecodeInputs` holds what
every offloaded layer of one decode step shares (which tokens may be attended, which blocks may and must be
selected) in buffers that keep their address while the step's block capacity does; the layer's open block lives in
a fixed buffer (:class:`~hf_offload.cache.OffloadLayer`), its summaries and block table in buffers that grow by
whole chunks; what is replaced when one of those grows (and the host pool's chunk tables) is held by the graph
(:class:`CapturedDecode`), and a new graph is captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


def forced_blocks(valid: torch.Tensor, sink_blocks: int, window_blocks: int, n_blocks: int | None = None) -> torch.Tensor:
    """Blocks every selection keeps: the sink (the first ``sink_blocks`` blocks holding a real token of each
    sequence, so left padding shifts it) and the window (the newest ``window_blocks`` of the ``n_blocks`` sealed
    ones); only valid blocks.

    Args:
        valid: blocks with a token that may be attended, ``[batch, capacity]``, ``torch.bool``, any device (blocks
            from ``n_blocks`` on are past the sealed ones and not valid).
        n_blocks: sealed blocks; ``None``: ``capacity``.

    Returns:
        ``[batch, capacity]``, ``torch.bool``, ``valid``'s device.
    """
    capacity = valid.shape[-1]
    n = capacity if n_blocks is None else n_blocks
    idx = torch.arange(capacity, device=valid.device)
    start = valid.int().argmax(dim=-1, keepdim=True)  # the first block holding a real token
    forced = (idx >= start) & (idx < start + sink_blocks)
    forced |= idx >= n - window_blocks
    return forced & valid


class DecodeInputs:
    """The inputs every offloaded layer of one decode step shares, built once per step.

    A step scores ``capacity`` blocks: the ``n_blocks`` sealed ones, then blocks past them that nothing may attend
    (``capacity`` is ``n_blocks`` rounded up to ``OffloadConfig.decode_capacity_blocks``), so that the shapes, and a
    captured graph, stay the same over several seals.

    Attributes:
        rows: which tokens may be attended, ``[batch, capacity + 2, block_tokens]``, ``torch.bool``, compute device.
            Row ``j < n_blocks``: sealed block ``j`` (left padding masks tokens); rows ``n_blocks`` to ``capacity -
            1``: nothing; row ``capacity`` (:attr:`open_row`): the open block (its filled positions that are not
            padding); row ``capacity + 1``: nothing (entries not selected).
        valid: blocks with at least one token that may be attended, ``[batch, capacity]``, ``torch.bool``.
        forced: blocks every selection keeps (sink and window), ``[batch, capacity]``, ``torch.bool``.
        sequence: ``arange(batch)`` shaped ``[batch, 1, 1]``, ``torch.int64`` (row index of ``rows``).
        open_pos: where this step's token goes in the open block, ``[1]``, ``torch.int64`` (``n_recent - 1``; what a
            graph of a whole decoder layer writes the token at).
        capacity: blocks a step scores (the open block's row).

    The buffers keep their address while ``batch``, ``capacity`` and ``block_tokens`` stay the same; a step with new
    values fills them in place.
    """

    def __init__(self) -> None:
        self._step: tuple | None = None
        self._shape: tuple | None = None
        self._plain_n: int | None = None  # sealed rows hold "every token" up to this block, nothing past it
        self.rows = self.valid = self.forced = self.sequence = self.open_pos = None
        self.capacity = 0

    @property
    def open_row(self) -> int:
        """The row of :attr:`rows` that holds the open block (``capacity``)."""
        return self.capacity

    def invalidate(self) -> None:
        """Forget the step the buffers were filled for (the cache was reset); the next step fills them again."""
        self._step = None
        self._plain_n = None

    def update(
        self,
        batch: int,
        n_blocks: int,
        block_tokens: int,
        first_recent: int,
        n_recent: int,
        padding: torch.Tensor | None,
        sink_blocks: int,
        window_blocks: int,
        device: torch.device,
        step: object,
        capacity: int | None = None,
    ) -> "DecodeInputs":
        """Fill the buffers for one decode step (a no-op for the later layers of the same step).

        Args:
            batch, n_blocks, block_tokens: the geometry (sequences, sealed blocks before this step, tokens per block).
            first_recent: position of the open block's first token.
            n_recent: tokens in the open block, this step's new token included (1 to ``block_tokens``).
            padding: the forward's 2D padding mask, ``[batch, >= first_recent + n_recent]``, ``torch.bool``, any
                device; ``None``: no padding.
            sink_blocks, window_blocks: blocks forced at the start (after left padding) and at the end.
            device: compute device.
            step: identifies the forward (the layers of one forward pass the same object).
            capacity: blocks the step scores, ``>= n_blocks``; ``None``: ``n_blocks``.
        """
        capacity = n_blocks if capacity is None else capacity
        if capacity < n_blocks:
            raise ValueError(f"DecodeInputs.update: capacity {capacity} is below the {n_blocks} sealed blocks.")
        key = (batch, n_blocks, capacity, block_tokens, first_recent, n_recent, id(step))
        if key == self._step:
            return self
        shape = (batch, capacity, block_tokens, device)
        if shape != self._shape:
            self.rows = torch.zeros((batch, capacity + 2, block_tokens), dtype=torch.bool, device=device)
            self.valid = torch.zeros((batch, capacity), dtype=torch.bool, device=device)
            self.forced = torch.zeros((batch, capacity), dtype=torch.bool, device=device)
            self.sequence = torch.arange(batch, device=device)[:, None, None]
            self.open_pos = torch.zeros(1, dtype=torch.int64, device=device)
            self.capacity = capacity
            self._shape = shape
            self._plain_n = None
        rows, n, T, C = self.rows, n_blocks, block_tokens, capacity
        if padding is None:
            if self._plain_n != n:  # sealed rows: every token (once per seal while no padding comes)
                rows[:, :n] = True
                rows[:, n:C] = False
                self._plain_n = n
            rows[:, C] = torch.arange(T, device=device) < n_recent
        else:
            padding = padding.to(device)
            rows[:, :n].copy_(padding[:, : n * T].view(batch, n, T))
            rows[:, n:C] = False
            rows[:, C, :n_recent] = padding[:, first_recent : first_recent + n_recent]
            rows[:, C, n_recent:] = False
            self._plain_n = None
        torch.any(rows[:, :C], dim=-1, out=self.valid)
        self.open_pos.fill_(n_recent - 1)
        self.forced.copy_(forced_blocks(self.valid, sink_blocks, window_blocks, n))
        self._step = key
        return self


@dataclass
class CapturedDecode:
    """One layer's captured decode attention.

    Attributes:
        graph: the CUDA graph.
        query: its input, ``[batch, q_heads, 1, head_dim]``, model dtype, CUDA (copied into before each replay).
        out: its output, ``[batch, 1, q_heads, head_dim]`` (overwritten by each replay).
        held: tensors the graph reads that the layer may replace while the graph lives.
    """

    graph: torch.cuda.CUDAGraph
    query: torch.Tensor
    out: torch.Tensor
    held: tuple


def _capture_on(stream_device: torch.device, enqueue, pool, stream: torch.cuda.Stream | None):
    """Capture ``enqueue()`` into a CUDA graph on ``stream`` (``None``: a new one); returns ``(graph, output)``."""
    graph = torch.cuda.CUDAGraph()
    current = torch.cuda.current_stream(stream_device)
    stream = stream if stream is not None else torch.cuda.Stream(stream_device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            out = enqueue()
        except BaseException:
            try:
                graph.capture_end()
            except Exception:
                pass  # the capture was invalidated by the failure being raised (the caller starts a new pool)
            raise
        graph.capture_end()
    current.wait_stream(stream)
    return graph, out


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

    graph: torch.cuda.CUDAGraph
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

    graph: torch.cuda.CUDAGraph
    statics: list
    inputs: "StaticInputs"
    out: object
    held: tuple


def capture_decoder_layer(forward, args: tuple, kwargs: dict, statics: "StaticInputs", pool, held: tuple,
                  stream: torch.cuda.Stream | None = None) -> CapturedLayer:
    """Capture one call ``forward(*args, **kwargs)`` of a decoder layer into a CUDA graph, its tensor arguments read
    from ``statics``' buffers (filled with this call's values first, on the current stream).

    Args:
        forward: the decoder layer's own forward.
        args, kwargs: the call's arguments (tensors on one CUDA device; any other value is fixed in the graph).
        statics: the fixed-address input buffers (shared by the layers of a cache on one device).
        pool, held, stream: as for :func:`capture`.
    """
    buffers, static_args, static_kwargs = statics.load(args, kwargs)
    device = next(b.device for b in buffers if b is not None)
    graph, out = _capture_on(device, lambda: forward(*static_args, **static_kwargs), pool, stream)
    return CapturedLayer(graph=graph, statics=buffers, inputs=statics, out=out, held=held)


def replay_layer(captured: CapturedLayer, args: tuple, kwargs: dict, flat: tuple | None = None):
    """Fill the buffers ``captured`` reads with this call's tensor arguments, replay it and return fresh copies of
    its outputs (the graph's own outputs are overwritten by its next replay). ``flat``: ``tree_flatten((args,
    kwargs))`` where the caller has it (:func:`call_signature` made it)."""
    buffers, _, _ = captured.inputs.load(args, kwargs, flat=flat, rebuild=False)
    if any(a is not b for a, b in zip(buffers, captured.statics)):
        raise RuntimeError("replay_layer: the static input buffers changed since the capture (shapes differ?)")
    captured.graph.replay()
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, captured.out)


def call_signature(args: tuple, kwargs: dict, flat: tuple | None = None) -> tuple:
    """What a captured decoder-layer call depends on besides tensor contents: each tensor argument's position,
    shape, dtype and device, and each other argument's type (its value, for a bool, number, string or ``None``).
    ``flat``: ``tree_flatten((args, kwargs))`` if the caller has it."""
    leaves, spec = tree_flatten((args, kwargs)) if flat is None else flat
    sig = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            sig.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
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
        self, args: tuple, kwargs: dict, flat: tuple | None = None, rebuild: bool = True
    ) -> tuple[list, tuple | None, dict | None]:
        """Copy the tensor arguments into their buffers (on the current stream).

        Args:
            args, kwargs: the call's arguments.
            flat: ``tree_flatten((args, kwargs))`` if the caller has it.
            rebuild: also return the arguments rebuilt around the buffers (a capture needs them, a replay not).

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
            slot = (i, tuple(leaf.shape), leaf.dtype, leaf.device)
            buffer = self._buffers.get(slot)
            if buffer is None:
                buffer = self._buffers[slot] = torch.empty_like(leaf, memory_format=torch.contiguous_format)
                self._last.pop(slot, None)
            if self._last.get(slot) is not leaf:
                buffer.copy_(leaf)
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
