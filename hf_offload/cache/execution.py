"""How one offloaded layer runs, resolved from the config and the device of its first update.

:class:`LayerExecution` is the one object every part of a layer reads these decisions from (the transfer path, the
paged decode attention, the side streams, lookahead, CUDA graphs, the fused kernels of the decoder layer call and
the block capacity a decode step scores); the layer resolves it at its first update and again when
``OffloadCache.set_options`` changes a setting.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..config import OffloadConfig
from ..patches.norms import fused_norms_active
from ..patches.projections import fused_projections_active, projections_on
from ..patches.rotary import fused_rotary_active
from ..store import transfer

# Blocks by which a decode step's scored blocks grow (decode_capacity_blocks=None and a selector with masks_invalid):
# one graph capture per this many seals where the layer replays CUDA graphs, and the same rounding op by op, so that a
# step's sums run over the same blocks with graphs or without.
GRAPH_CAPACITY_BLOCKS = 64

# With decode_capacity_blocks=None, the step grows with the context: at least the sealed blocks over this, rounded down
# to a power of two. A step scores at most 1/16 more blocks than are sealed, and a long context recaptures its graphs
# once per as many seals (at 64K tokens in 16-token blocks, every 4,096 tokens instead of every 1,024).
GRAPH_CAPACITY_SHARE = 16


@dataclass
class LayerExecution:
    """The execution decisions of one offloaded layer.

    Attributes:
        use_kernels: blocks move through the Triton kernels (CUDA with a pinned host pool, or Triton's CPU
            interpreter); else through portable torch copies.
        paged: decode steps attend through the paged kernel, reading admitted blocks in place.
        streams: the side streams of the device (kernel path on CUDA only), else ``None``: every copy synchronous.
        lookahead: decode steps prefetch the next offloaded layer's likely blocks.
        graphs: decode steps replay captured CUDA graphs.
        fusions: ``(norms, rotary, projections)`` run fused in the decoder layer's calls; ``None`` until the device
            is known (each call then decides from its hidden states).
        capacity_blocks: a decode step scores the sealed blocks rounded up to a multiple of this.
        capacity_share: with it, the multiple is at least the sealed blocks over it, rounded down to a power of two
            (0: ``capacity_blocks`` alone).
    """

    use_kernels: bool = False
    paged: bool = False
    streams: transfer.TransferStreams | None = None
    lookahead: bool = False
    graphs: bool = False
    fusions: tuple[bool, bool, bool] | None = None
    capacity_blocks: int = 1
    capacity_share: int = 0


def decode_capacity(n: int, k: int, capacity_blocks: int, share: int = 0) -> int:
    """Blocks a decode step with ``n`` sealed blocks, ``k`` of them selected, scores: ``n`` rounded up to a multiple
    of ``capacity_blocks``, or with ``share`` of the largest power of two up to ``n // share`` where that is larger
    (the blocks past ``n`` are never valid); ``n`` when every block is selected. Never smaller for a larger ``n``."""
    if k >= n or capacity_blocks == 1:
        return n
    step = capacity_blocks
    if share and n // share > step:
        step = 1 << ((n // share).bit_length() - 1)
    return -(-n // step) * step


def want_kernels(config: OffloadConfig, device: torch.device, pinned: bool) -> bool:
    """Whether blocks move through the kernels (``config.transfer``) on ``device`` with a host pool that is
    ``pinned`` or not.

    Raises:
        RuntimeError: ``transfer="kernel"`` where the kernels cannot run.
    """
    from ..kernels.gather import kernels_available  # looked up at call time (benchmarks stand in for it)

    # On CUDA the kernels read and write host memory through unified addressing, which needs pinned memory.
    possible = kernels_available(device) and (pinned or device.type == "cpu")
    if config.transfer == "kernel" and not possible:
        raise RuntimeError(
            "transfer='kernel' needs a CUDA device, a pinned host pool and Triton; use transfer='auto' or 'torch'."
        )
    return possible and config.transfer != "torch"


def want_paged(config: OffloadConfig, use_kernels: bool, device: torch.device, pool_data: torch.Tensor) -> bool:
    """Whether decode steps attend through :func:`~hf_offload.kernels.paged.paged_decode` (admitted blocks read in
    place); see ``OffloadConfig.decode_attention``.

    Raises:
        RuntimeError: ``decode_attention="paged"`` where the paged kernel cannot run.
    """
    from ..kernels.paged import paged_decode_supported

    wanted = config.decode_attention
    if wanted == "pool":
        return False
    possible = use_kernels and paged_decode_supported(pool_data)
    if wanted == "paged" and not possible:
        raise RuntimeError(
            "decode_attention='paged' needs the kernel transfer path (CUDA, a pinned host pool and Triton), a "
            "float16, bfloat16 or float32 cache and a power-of-two head_dim >= 16; use decode_attention='auto' "
            "or 'pool'."
        )
    return possible and (wanted == "paged" or device.type == "cuda")


def resolve(execution: LayerExecution, config: OffloadConfig, device: torch.device | None, masks_invalid: bool) -> None:
    """Set ``lookahead``, ``graphs``, ``fusions`` and ``capacity_blocks`` of ``execution`` from ``config``: ``None``
    means on with the kernel path on CUDA (for graphs: unless timing is on or lookahead is with
    ``graph_scope="attention"``).

    Args:
        device: the layer's device, ``None`` before its first update.
        masks_invalid: the selector scores blocks past the sealed ones masked (a capacity above 1 is allowed).

    Raises:
        RuntimeError: ``cuda_graphs=True`` where graphs cannot run.
    """
    kernels_on_cuda = execution.use_kernels and device is not None and device.type == "cuda"
    wanted = config.lookahead
    execution.lookahead = bool(kernels_on_cuda if wanted is None else wanted)
    graphs = config.cuda_graphs
    if graphs and device is not None and not kernels_on_cuda:
        raise RuntimeError(
            "cuda_graphs=True needs a CUDA device and the kernel transfer path (pinned host pool and Triton); "
            "use cuda_graphs=None (on where it can run) or False."
        )
    # The disk tier reads blocks on the host between a layer's plan and its recall: its captured steps are two
    # graphs with that host work between them. Lookahead runs inside the graphs of whole decoder layers (the
    # prefetch forked and joined in the layer's graph), not in graphs of the attention alone.
    execution.graphs = bool(kernels_on_cuda and graphs is not False and not config.timing
                            and not (execution.lookahead and config.graph_scope != "layer"))  # fmt: skip
    execution.fusions = None if device is None else fusions_on(config, device)
    capacity = config.decode_capacity_blocks
    execution.capacity_share = 0
    if capacity is None:
        capacity = GRAPH_CAPACITY_BLOCKS if masks_invalid else 1
        execution.capacity_share = GRAPH_CAPACITY_SHARE if masks_invalid else 0
    execution.capacity_blocks = capacity


def hidden_states(args: tuple, kwargs: dict):
    """The hidden states of a decoder layer call (its first positional argument or ``hidden_states``)."""
    return args[0] if args else kwargs.get("hidden_states")


def call_fusions(config: OffloadConfig, args: tuple, kwargs: dict) -> tuple[bool, bool, bool]:
    """Whether a decoder layer call runs its RMS norms and its rotary embedding with the kernels and its sibling
    projections as one product: :func:`fusions_on` for the device of its hidden states."""
    hidden = hidden_states(args, kwargs)
    return fusions_on(config, hidden.device) if isinstance(hidden, torch.Tensor) else (False, False, False)


def fusions_on(config: OffloadConfig, device: torch.device) -> tuple[bool, bool, bool]:
    """Whether decoder layer calls on ``device`` run their RMS norms (``config.fused_norms``) and their rotary
    embedding (``config.fused_rotary``) with the kernels, and their sibling projections as one product
    (``config.fused_projections``, :func:`projections_on`).

    Raises:
        RuntimeError: either set to ``True`` where Triton cannot run.
    """
    from ..kernels.gather import kernels_available  # looked up at call time (benchmarks stand in for it)

    triton_here = kernels_available(device)
    on = []
    for name in ("fused_norms", "fused_rotary"):
        setting = getattr(config, name)
        if setting and not triton_here:
            raise RuntimeError(
                f"{name}=True needs Triton on the layer's device ({device}); use {name}=None (on where Triton runs on "
                "CUDA) or False."
            )
        on.append(bool(triton_here and (device.type == "cuda" if setting is None else setting)))
    return on[0], on[1], projections_on(config, device)


@contextlib.contextmanager
def fused(fusions: tuple[bool, bool, bool]):
    """Run the enclosed decoder layer call with its norms, rotary embedding and projections fused as ``fusions``
    says (:func:`fusions_on`)."""
    with fused_norms_active(fusions[0]), fused_rotary_active(fusions[1]), fused_projections_active(fusions[2]):
        yield
