"""Moving KV bytes between tiers; no policy here (which blocks move is decided by selectors and the cache).

The portable path: a host-side gather into a (pinned) staging buffer followed by one host-to-device copy, and one
device-to-host copy per sealed group of blocks. It runs anywhere torch runs and is the reference that the kernel
path (a copy kernel reading and writing pinned memory directly, below) must match bit for bit.

On CUDA the kernel path runs on side streams (:class:`TransferStreams`): sealed blocks are written to the host on an
offload stream and speculative recalls run on a prefetch stream, each launch queued behind everything issued so
far on the compute stream and followed by an event that the consumers wait on (:func:`launch_on`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from .device import DeviceSlotPool
from .host import HostBlockPool


def offload_blocks(host: HostBlockPool, ids: torch.Tensor, blocks: torch.Tensor) -> int:
    """Write sealed blocks to the host pool.

    Args:
        host: the layer's host pool.
        ids: destination block ids, shape ``[n]``, ``torch.int64``, CPU.
        blocks: shape ``[n, 2, kv_heads, block_tokens, head_dim]``, the cache dtype, compute device.

    Returns:
        Bytes written.
    """
    host.write(ids, blocks)
    return len(ids) * host.block_bytes


def recall_blocks(
    host: HostBlockPool,
    pool: DeviceSlotPool,
    ids: torch.Tensor,
    batch_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    head_idx: torch.Tensor | None = None,
) -> int:
    """Copy host blocks (or single heads of blocks) into device slots.

    Args:
        host: the layer's host pool.
        pool: the layer's device slot pool.
        ids: host block ids to read, shape ``[n]``, ``torch.int64``, CPU.
        batch_idx: destination sequence per id, shape ``[n]``, ``torch.int64``, pool device.
        slot_idx: destination slot per id, shape ``[n]``, ``torch.int64``, pool device.
        head_idx: ``None`` to copy whole blocks (all KV heads, one contiguous span each); else the KV head per id,
            shape ``[n]``, ``torch.int64``, pool device (K and V of one head: two pieces per id).

    Returns:
        Bytes moved host-to-device.
    """
    if len(ids) == 0:
        return 0
    if head_idx is None:
        staged = host.read(ids)  # [n, 2, H, T, D]
        # Indices around a slice: the indexed dimension comes first, [n, 2, H, T, D] like the staged blocks.
        pool.data[:, batch_idx, :, slot_idx] = staged.to(pool.data.device, non_blocking=True)
        return staged.numel() * staged.element_size()
    staged = host.read(ids, heads=head_idx.cpu())  # [n, 2, T, D]
    pool.data[:, batch_idx, head_idx, slot_idx] = staged.to(pool.data.device, non_blocking=True).transpose(0, 1)
    return staged.numel() * staged.element_size()


# ------------------------------------------------------------------------------------- kernel path (CUDA, pinned)
def offload_blocks_kernel(host: HostBlockPool, ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Write sealed blocks straight into pinned host memory in one launch (current stream, no host sync).

    Args:
        host: the layer's host pool (pinned).
        ids: destination block ids, shape ``[n]``, ``torch.int64``, on the blocks' device.
        blocks: shape ``[n, 2, kv_heads, block_tokens, head_dim]``, contiguous, CUDA.
    """
    from ..kernels.gather import copy_pieces

    words = host.block_words
    offsets = torch.arange(len(ids), device=blocks.device, dtype=torch.int64) * words
    copy_pieces(
        host.chunk_addrs(blocks.device), host.chunk_blocks, words, ids, torch.zeros_like(ids), blocks.contiguous(),
        offsets, words, to_host=True,
    )  # fmt: skip


RECALL_LAUNCH = {"words_per_program": 512, "num_warps": 2}
"""Launch settings of the recall kernel: the fastest of those swept (``benchmarks/sweep_gather_kernel.py``) both for
pinned host memory and for blocks that ``admission="auto"`` keeps on the device."""


def block_piece_offsets(
    host: HostBlockPool, pool: DeviceSlotPool, batch_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts of a whole-block recall's word offsets that do not depend on the slots: per entry and piece
    ``(kv, h)``, the host offset inside the block and the device offset of slot 0 of the entry's sequence.

    Args:
        host: the layer's host pool.
        pool: the layer's device slot pool.
        batch_idx: destination sequence per entry, ``[n]``, ``torch.int64``, pool device.

    Returns:
        ``(host_off, dev_base)``, each ``[n, 2 * kv_heads]``, ``torch.int64``, contiguous, pool device; a piece's
        device offset is ``dev_base + slot * piece_words``.
    """
    _, batch, heads, total, _, _ = pool.data.shape
    piece = host.block_words // (2 * heads)  # 32-bit words of one head's K (or V) of one block
    # Piece (kv, h) of an entry: host word offset (kv * H + h) * piece inside its block; device word offset
    # (((kv * B + b) * H + h) * total + slot) * piece.
    kv_h = pool.piece_index(batch_idx.device)  # [2 * H]: kv * H + h
    h, kv = kv_h % heads, kv_h // heads
    host_off = (kv_h * piece).expand(len(batch_idx), -1).contiguous()
    dev_base = ((kv[None, :] * batch + batch_idx[:, None]) * heads + h[None, :]) * (total * piece)
    return host_off, dev_base


_SEQUENCE_ORDER: OrderedDict[tuple, tuple] = OrderedDict()  # sequence_order_indices: key -> (batch, slot, offsets)
SEQUENCE_ORDER_BYTES = 8 << 20
"""Device bytes the kept index sets of :func:`sequence_order_indices` take at most, together (least recently used
dropped first); a set larger than a quarter of it is made for its call and not kept."""


def sequence_order_indices(
    host: HostBlockPool, pool: DeviceSlotPool, batch: int, n: int
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """``(batch_idx, slot_idx, offsets)`` of a recall of ``n`` whole blocks per sequence into slots ``0 .. n - 1`` of
    ``pool`` in order (sequence-major: entry ``b * n + j`` is block ``j`` of sequence ``b``), with
    :func:`block_piece_offsets` of them: what a later prefill chunk's recall of its earlier blocks into a scratch pool
    (:meth:`~hf_offload.cache.blocks.BlockStore.sealed_kv`) passes to :func:`recall_blocks_kernel`. They depend only
    on the shapes, so small sets are kept per device, within :data:`SEQUENCE_ORDER_BYTES` (a question over the same
    prefix, chunk after chunk, reuses them instead of a dozen small operations per layer; :func:`forget_sequence_order`
    frees them). Read-only: callers must not write into them."""
    _, pool_batch, heads, total, _, _ = pool.data.shape
    device = pool.data.device
    key = (device, batch, n, pool_batch, heads, total, host.block_words)
    # A graph being captured makes its own (the kept ones may be dropped while the graph lives).
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    found = None if capturing else _SEQUENCE_ORDER.get(key)
    if found is not None:
        _SEQUENCE_ORDER.move_to_end(key)
        return found
    slot_idx = torch.arange(n, device=device).repeat(batch)
    batch_idx = torch.arange(batch, device=device).repeat_interleave(n)
    found = (batch_idx, slot_idx, block_piece_offsets(host, pool, batch_idx))
    size = _index_bytes(found)
    if size <= SEQUENCE_ORDER_BYTES // 4 and not capturing:  # made inside a graph: its values exist only there
        _SEQUENCE_ORDER[key] = found
        while sum(_index_bytes(v) for v in _SEQUENCE_ORDER.values()) > SEQUENCE_ORDER_BYTES:
            _SEQUENCE_ORDER.popitem(last=False)
    return found


def _index_bytes(found: tuple) -> int:
    batch_idx, slot_idx, (host_off, dev_base) = found
    return sum(t.numel() * t.element_size() for t in (batch_idx, slot_idx, host_off, dev_base))


def forget_sequence_order() -> None:
    """Free the index sets :func:`sequence_order_indices` keeps."""
    _SEQUENCE_ORDER.clear()


def recall_blocks_kernel(
    host: HostBlockPool,
    pool: DeviceSlotPool,
    ids: torch.Tensor,
    batch_idx: torch.Tensor,
    slot_idx: torch.Tensor,
    head_idx: torch.Tensor | None = None,
    offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Gather host blocks (or single heads) into device slots in one launch; entries with id ``-1`` are skipped.

    A host block is one contiguous span ``[2, kv_heads, block_tokens, head_dim]``; in the slot pool the K and V of each
    head of a slot are ``block_tokens * head_dim`` contiguous elements (``[2, batch, kv_heads, slots, ...]``), so an
    entry moves as ``2 * kv_heads`` pieces (2 for a single head), read from consecutive host addresses.

    Args:
        host: the layer's host pool (pinned).
        pool: the layer's device slot pool.
        ids: host block id per entry or ``-1``, shape ``[n]``, ``torch.int64``, pool device.
        batch_idx: destination sequence per entry, shape ``[n]``, ``torch.int64``, pool device.
        slot_idx: destination slot per entry, shape ``[n]``, ``torch.int64``, pool device.
        head_idx: ``None`` for whole blocks (one contiguous span each); else the KV head per entry, shape ``[n]``:
            its K and V are copied as two pieces.
        offsets: whole blocks only: :func:`block_piece_offsets` of ``batch_idx``, kept by a caller that recalls
            into the same entries at every step (then the launch computes one offset tensor instead of ten);
            ``None``: computed here.
    """
    from ..kernels.gather import copy_pieces

    words = host.block_words
    _, batch, heads, total, _, _ = pool.data.shape
    piece = words // (2 * heads)  # 32-bit words of one head's K (or V) of one block
    addrs = host.chunk_addrs(pool.data.device)
    # Offsets as in block_piece_offsets; a single head's K and V are its pieces (0, h) and (1, h).
    if head_idx is None:
        host_off, dev_base = offsets if offsets is not None else block_piece_offsets(host, pool, batch_idx)
        dev_off = torch.add(dev_base, slot_idx[:, None], alpha=piece)
        ids = ids[:, None].expand(-1, 2 * heads)
    else:
        kv = torch.arange(2, device=ids.device)[None, :]
        host_off = (kv * heads + head_idx[:, None]) * piece
        dev_off = (((kv * batch + batch_idx[:, None]) * heads + head_idx[:, None]) * total + slot_idx[:, None]) * piece
        ids = ids[:, None].expand(-1, 2)  # K and V piece of each entry (expand: no host synchronisation)
    copy_pieces(addrs, host.chunk_blocks, words, ids.flatten(), host_off.flatten(), pool.data, dev_off.flatten(),
                piece, False, **RECALL_LAUNCH)  # fmt: skip


# ------------------------------------------------------------------------------------------- streams and events
class TransferStreams:
    """The side streams of one CUDA device, shared by every cache of the process on that device
    (:func:`device_streams`).

    Attributes:
        offload: device-to-host writes of sealed blocks.
        prefetch: speculative host-to-device recalls (layer-ahead lookahead).
        capture: the stream CUDA graphs are captured on.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.offload = torch.cuda.Stream(device)
        self.prefetch = torch.cuda.Stream(device)
        self.capture = torch.cuda.Stream(device)


_STREAMS: dict[int, TransferStreams] = {}


def device_streams(device: torch.device) -> TransferStreams:
    """The side streams of a CUDA device, made once per process and device and shared by every cache.

    One set per device, not per cache: the device keeps state per stream that no cache can free. cuBLAS keeps a
    workspace (32 MiB on Hopper) for every stream a matrix product ran on, captured ones included, until the process
    ends, and the caching allocator reuses a freed block only on the stream that freed it. Streams made per cache
    came from PyTorch's pool of 32 per device, so every new cache added a workspace until the pool wrapped (about
    1 GiB on the H200). Work of different caches on one stream runs in the order it was queued, which the caches'
    events already assume.
    """
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = TransferStreams(torch.device("cuda", index))
    return _STREAMS[index]


def launch_on(
    stream: torch.cuda.Stream | None,
    launch: Callable[[], None],
    uses: tuple[torch.Tensor, ...] = (),
    wait_for: tuple[torch.cuda.Event | None, ...] = (),
) -> torch.cuda.Event | None:
    """Run ``launch`` on a side stream, after all work queued so far on the current stream; returns its event.

    Stream order: the side stream first waits for the current (compute) stream, so the inputs of ``launch`` and
    every earlier read or write of its destination are complete before it runs; it also waits for ``wait_for``
    (e.g. the host writes of the blocks it reads). Tensors made on the compute stream and read by ``launch`` are
    ``record_stream``-ed, so the caching allocator does not hand out their memory before the side stream is done.
    Consumers wait on the returned event (``torch.cuda.current_stream().wait_event``), never on the host.

    Args:
        stream: the side stream; ``None`` runs ``launch`` synchronously on the current stream (CPU, tests) and
            returns ``None``.
        launch: enqueues the work; tensors it allocates are used on the side stream only.
        uses: tensors allocated on the compute stream that ``launch`` reads or writes (any device tensors).
        wait_for: events the side stream waits on besides the compute stream (``None`` entries are skipped).
    """
    if stream is None:
        launch()
        return None
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    for event in wait_for:
        if event is not None:
            stream.wait_event(event)
    with torch.cuda.stream(stream):
        launch()
    for tensor in uses:
        tensor.record_stream(stream)
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_event(event: torch.cuda.Event | None, device: torch.device) -> None:
    """Make the current stream of ``device`` wait for ``event`` (no host synchronisation); ``None``: no-op."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
