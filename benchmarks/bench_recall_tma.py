"""Host-to-device recall through Hopper's TMA (tensor memory accelerator) reading pinned host memory, against the
gather kernel and a bulk copy, in one run.

Why: the gather kernel (``hf_offload.kernels.gather.copy_pieces``) reaches only 0.91-0.93x of a bulk pinned copy
on an H200 at every block size and launch shape. The working hypothesis is PCIe framing: every transaction layer
packet carries roughly 20-30 bytes of header, sequence number, CRC and framing on top of its payload, so completions
of 128 bytes deliver about 84 % of the link's bytes as data and completions of 256 bytes about 91 %; the ratio of
the two, about 0.92, is what was measured, if loads from the SMs reach the host as reads of at most one 128-byte
line while the copy engines ask for more at once. The TMA unit moves a whole box per instruction and may therefore
ask for larger reads; nothing documents what it does against system memory, which is what this script measures.

For each block size it times, on one pinned host pool (a single pinned tensor, since a tensor descriptor has one
base address) and the same random distinct block ids (CUDA events, median of ``--reps`` after ``--warmup`` runs,
on a non-default stream):

* ``bulk``: one contiguous pinned -> device ``copy_`` of the same number of bytes (the reference);
* ``kernel``: one launch of the gather kernel, which reads pinned memory with plain loads;
* ``tma*``: one launch of a Triton kernel that reads every selected block with descriptor loads (TMA) and writes
  the device destination. The variant name spells its settings::

      tma_{host|dev}_r{row bytes}_b{box}_{st|tma}_{box|pK}_w{warps}s{stages}     (2-D descriptor)
      tma1d_host_e{element bytes}_b{box}_{st|tma}_{box|pK}_w{warps}s{stages}   (1-D descriptor)

  ``host``: the source descriptor is built on the host (``triton.tools.tensor_descriptor.TensorDescriptor``, passed
  to the kernel as a grid constant); ``dev``: built in the kernel with ``tl.make_tensor_descriptor`` from the pool's
  address (needs ``triton.set_allocator`` for its scratch). A 2-D descriptor views the pool as rows of ``r`` bytes
  (32-bit elements) and loads a box of ``box / r`` rows; a 1-D one views it as elements of ``e`` bytes and loads
  ``box / e`` of them. ``st``: the box is written with plain ``tl.store``; ``tma``: with a second descriptor's store.
  What the hardware moves per TMA instruction is Triton's choice: on sm_90 Triton 3.6 gives these 2-D loads a
  128-byte swizzle, so a hardware box is at most 128 bytes wide and 256 rows high; a box of wider rows is fetched as
  several 128-byte column strips, which is why 128-byte rows (each hardware box one contiguous span) lead the sweep.
  A 1-D descriptor gets no swizzle and hardware boxes of up to 256 elements (2 KiB of 8-byte elements).
  ``box``: one program per box (a block of ``B`` bytes is ``B / box`` programs); ``pK``: ``K`` programs per SM, each
  looping over boxes ``pid, pid + grid, ...`` with a software pipeline of ``stages`` stages (several loads in
  flight). A box larger than the block is cut to the block; variants that become the same are measured once.

Every variant is checked bit-exact against the source blocks once per block size, outside the timing. ``bulk`` and
``kernel`` are measured for every block size first and the results are written before any TMA kernel runs. Then a
child process runs one variant of each TMA kind on a small pool (``--probe-timeout``), so a TMA access that faults
or hangs cannot take the main process down; kinds that fail there are recorded and skipped. Any other failing
variant records its error text and the run goes on; after an error that leaves the CUDA context unusable the
remaining variants are recorded as skipped. Prints a table (GB/s and ratio to bulk) per block size and a summary of
the ratios, and writes raw JSON (machine, versions, git commit, settings, probe, raw times) to ``--out``, again after
every block size.

    python benchmarks/bench_recall_tma.py --out results/recall/bench_recall_tma.json
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import cuda_event_ms, run_metadata, write_results  # noqa: E402
from hf_offload.kernels.gather import copy_pieces, kernels_available  # noqa: E402

try:  # Triton is optional: the script still imports (and explains itself) without it.
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - exercised on CPU-only installs
    triton = tl = TensorDescriptor = None

KIB, MIB = 1 << 10, 1 << 20
INT32_MAX = 2**31 - 1
NO_CUDA = "bench_recall_tma: no CUDA device (torch.cuda.is_available() is False); nothing was measured"
PROBE_MARK = "PROBE_JSON "


@dataclasses.dataclass(frozen=True)
class TmaConfig:
    """One TMA variant.

    Args:
        rank: 2 (pool viewed as ``[rows, row_bytes / 4]`` 32-bit elements) or 1 (``[pool_bytes / elem_bytes]``).
        box_bytes: bytes one descriptor load moves (a power of two, at most the block size).
        row_bytes: bytes per row of a 2-D view (a power of two, >= 16); unused for rank 1.
        elem_bytes: bytes per element of a 1-D view (4 or 8); 2-D views use 4.
        device_desc: build the source descriptor in the kernel (``tl.make_tensor_descriptor``) instead of on the host.
        desc_store: write the device side through a second descriptor (TMA store) instead of ``tl.store``.
        programs_per_sm: 0: one program per box; ``K`` > 0: ``K`` programs per SM loop over the boxes.
        num_warps: warps per program.
        num_stages: software-pipeline stages of the box loop (1: none).
    """

    rank: int = 2
    box_bytes: int = 4 * KIB
    row_bytes: int = 128
    elem_bytes: int = 4
    device_desc: bool = False
    desc_store: bool = False
    programs_per_sm: int = 0
    num_warps: int = 4
    num_stages: int = 1

    @property
    def kind(self) -> str:
        """The probe kind: descriptor rank, where the source descriptor is built, how the box is stored."""
        return f"rank{self.rank}_{'dev' if self.device_desc else 'host'}_{'tma' if self.desc_store else 'st'}"

    @property
    def name(self) -> str:
        box = f"{self.box_bytes // KIB}k" if self.box_bytes >= KIB else f"{self.box_bytes}"
        shape = f"r{self.row_bytes}" if self.rank == 2 else f"e{self.elem_bytes}"
        grid = f"p{self.programs_per_sm}" if self.programs_per_sm else "box"
        return (f"tma{'' if self.rank == 2 else '1d'}_{'dev' if self.device_desc else 'host'}_{shape}_b{box}_"
                f"{'tma' if self.desc_store else 'st'}_{grid}_w{self.num_warps}s{self.num_stages}")  # fmt: skip

    def for_block(self, block_bytes: int) -> TmaConfig:
        """This variant with its box cut to ``block_bytes`` (and a 2-D row cut to the box)."""
        box = min(self.box_bytes, block_bytes)
        return dataclasses.replace(self, box_bytes=box, row_bytes=min(self.row_bytes, box))


def default_sweep() -> list[TmaConfig]:
    """The TMA variants measured at every block size (cut to the block, duplicates dropped)."""
    c = TmaConfig
    return [
        # box size, one program per box, 128-byte rows (each hardware box one contiguous span)
        c(box_bytes=2 * KIB), c(box_bytes=4 * KIB), c(box_bytes=8 * KIB), c(box_bytes=16 * KIB),
        # wider rows (each hardware box a 128-byte column strip of the rows)
        c(box_bytes=4 * KIB, row_bytes=256), c(box_bytes=16 * KIB, row_bytes=256), c(box_bytes=16 * KIB, row_bytes=512),
        # TMA store on the device side
        c(box_bytes=4 * KIB, desc_store=True), c(box_bytes=16 * KIB, desc_store=True),
        # warps
        c(box_bytes=4 * KIB, num_warps=1), c(box_bytes=16 * KIB, num_warps=8),
        # a few programs per SM, each with several loads in flight
        c(box_bytes=2 * KIB, programs_per_sm=8, num_stages=4), c(box_bytes=4 * KIB, programs_per_sm=4, num_stages=3),
        c(box_bytes=16 * KIB, programs_per_sm=2, num_stages=3),
        # descriptor built in the kernel
        c(box_bytes=4 * KIB, device_desc=True), c(box_bytes=4 * KIB, device_desc=True, programs_per_sm=4, num_stages=3),
        # 1-D descriptors (no swizzle; 8-byte elements make a hardware box of 2 KiB)
        c(rank=1, box_bytes=1 * KIB, elem_bytes=4), c(rank=1, box_bytes=2 * KIB, elem_bytes=8),
        c(rank=1, box_bytes=8 * KIB, elem_bytes=8, programs_per_sm=4, num_stages=3),
    ]  # fmt: skip


def probe_sweep() -> list[TmaConfig]:
    """One variant of each kind, run in the probe child."""
    c = TmaConfig
    return [c(), c(desc_store=True), c(device_desc=True, programs_per_sm=4, num_stages=3), c(rank=1, elem_bytes=8)]


def config_error(cfg: TmaConfig, block_bytes: int, pool_bytes: int, dst_bytes: int) -> str | None:
    """Why ``cfg`` (already cut to the block) cannot describe this pool and block size, or ``None``."""
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if cfg.rank not in (1, 2):
        return f"rank {cfg.rank}: 1 or 2"
    if not pow2(cfg.box_bytes) or block_bytes % cfg.box_bytes:
        return f"box of {cfg.box_bytes} bytes must be a power of two dividing the block ({block_bytes} bytes)"
    if cfg.rank == 2 and (not pow2(cfg.row_bytes) or cfg.row_bytes < 16 or cfg.box_bytes % cfg.row_bytes):
        return f"row of {cfg.row_bytes} bytes must be a power of two >= 16 dividing the box"
    if cfg.rank == 1 and cfg.elem_bytes not in (4, 8):
        return f"1-D element of {cfg.elem_bytes} bytes: 4 or 8"
    unit = cfg.row_bytes if cfg.rank == 2 else cfg.elem_bytes
    if max(pool_bytes, dst_bytes) // unit > INT32_MAX:
        return f"descriptor extent {max(pool_bytes, dst_bytes) // unit} exceeds int32 (coordinates are 32-bit)"
    return None


if triton is not None:

    @triton.jit
    def tma_gather_2d_kernel(
        src_desc,  # host descriptor of the pool, int32 [pool_rows, ROW_WORDS]; None when DEVICE_DESC
        pool_addr,  # int64: UVA address of the pool (used when DEVICE_DESC)
        pool_rows,
        dst_desc,  # host descriptor of the destination, int32 [dst_rows, ROW_WORDS]; None unless DESC_STORE
        dst_ptr,  # int32 view of the destination; None when DESC_STORE
        ids_ptr,  # int64 [n]: pool block id per destination block
        total_boxes,
        boxes_per_block,
        block_rows,
        ITERS: tl.constexpr,
        BOX_ROWS: tl.constexpr,
        ROW_WORDS: tl.constexpr,
        DEVICE_DESC: tl.constexpr,
        DESC_STORE: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):
        if DEVICE_DESC:
            src = tl.make_tensor_descriptor(pool_addr.to(tl.pointer_type(tl.int32)), shape=[pool_rows, ROW_WORDS],
                                            strides=[ROW_WORDS, 1], block_shape=[BOX_ROWS, ROW_WORDS])  # fmt: skip
        else:
            src = src_desc
        span = tl.arange(0, BOX_ROWS)[:, None] * ROW_WORDS + tl.arange(0, ROW_WORDS)[None, :]
        for i in tl.range(0, ITERS, num_stages=NUM_STAGES):
            t = tl.minimum(tl.program_id(0) + i * tl.num_programs(0), total_boxes - 1)  # the tail repeats the last box
            piece = t // boxes_per_block
            block_id = tl.load(ids_ptr + piece)
            row = block_id * block_rows + (t - piece * boxes_per_block) * BOX_ROWS
            x = src.load([row.to(tl.int32), 0])
            if DESC_STORE:
                dst_desc.store([(t * BOX_ROWS).to(tl.int32), 0], x)
            else:
                tl.store(dst_ptr + t.to(tl.int64) * (BOX_ROWS * ROW_WORDS) + span, x)

    @triton.jit
    def tma_gather_1d_kernel(
        src_desc,  # host descriptor of the pool, [pool_elems] of 4- or 8-byte integers
        dst_desc,  # host descriptor of the destination, [dst_elems]; None unless DESC_STORE
        dst_ptr,  # the destination as the same element type; None when DESC_STORE
        ids_ptr,  # int64 [n]: pool block id per destination block
        total_boxes,
        boxes_per_block,
        block_elems,
        ITERS: tl.constexpr,
        BOX: tl.constexpr,
        DESC_STORE: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):
        span = tl.arange(0, BOX)
        for i in tl.range(0, ITERS, num_stages=NUM_STAGES):
            t = tl.minimum(tl.program_id(0) + i * tl.num_programs(0), total_boxes - 1)  # the tail repeats the last box
            piece = t // boxes_per_block
            block_id = tl.load(ids_ptr + piece)
            at = block_id * block_elems + (t - piece * boxes_per_block) * BOX
            x = src_desc.load([at.to(tl.int32)])
            if DESC_STORE:
                dst_desc.store([(t * BOX).to(tl.int32)], x)
            else:
                tl.store(dst_ptr + t.to(tl.int64) * BOX + span, x)


def _scratch_allocator(size: int, alignment: int, stream):
    """Device memory for in-kernel tensor descriptors (``triton.set_allocator``)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def make_tma_gather(cfg: TmaConfig, pool: torch.Tensor, ids: torch.Tensor, dst: torch.Tensor, block_bytes: int,
                    sm_count: int = 132):  # fmt: skip
    """A function that copies pool block ``ids[i]`` to row ``i`` of ``dst`` in one TMA kernel launch (descriptors and
    grid prepared here, so a call only launches).

    Args:
        cfg: the variant, already cut to the block (:meth:`TmaConfig.for_block`).
        pool: the host pool, shape ``[pool_bytes]``, ``torch.uint8``, CPU (pinned on CUDA runs), 16-byte aligned.
        ids: pool block ids (block ``b`` is bytes ``[b * block_bytes, (b + 1) * block_bytes)``), all valid, shape
            ``[n]``, ``torch.int64``, on ``dst``'s device.
        dst: the destination, shape ``[n, block_bytes]``, ``torch.uint8``, contiguous, CUDA (or CPU under
            ``TRITON_INTERPRET=1``).
        block_bytes: bytes per block.
        sm_count: SMs of the device (grid of the ``pK`` variants).

    Returns:
        A function of no arguments that launches the copy on the current stream.
    """
    if triton is None:
        raise RuntimeError("the TMA kernels need Triton")
    error = config_error(cfg, block_bytes, pool.numel(), dst.numel())
    if error:
        raise ValueError(error)
    if not dst.is_contiguous() or pool.data_ptr() % 16 or dst.data_ptr() % 16:
        raise ValueError("pool and destination must be contiguous and 16-byte aligned")
    n = ids.numel()
    boxes_per_block = block_bytes // cfg.box_bytes
    total = n * boxes_per_block
    grid = (min(total, cfg.programs_per_sm * sm_count) if cfg.programs_per_sm else total,)
    opts = dict(ITERS=triton.cdiv(total, grid[0]), DESC_STORE=cfg.desc_store, NUM_STAGES=cfg.num_stages,
                num_warps=cfg.num_warps)
    if cfg.rank == 2:
        words, box_rows = cfg.row_bytes // 4, cfg.box_bytes // cfg.row_bytes
        pool2d = pool.view(torch.int32).view(-1, words)
        dst2d = dst.view(-1).view(torch.int32).view(-1, words)
        box_shape = [box_rows, words]
        src_desc = None if cfg.device_desc else TensorDescriptor(pool2d, list(pool2d.shape), [words, 1], box_shape)
        dst_desc = TensorDescriptor(dst2d, list(dst2d.shape), [words, 1], box_shape) if cfg.desc_store else None
        if cfg.device_desc and dst.is_cuda:
            triton.set_allocator(_scratch_allocator)
        args = (src_desc, pool.data_ptr(), pool2d.shape[0], dst_desc, None if cfg.desc_store else dst2d, ids, total,
                boxes_per_block, block_bytes // cfg.row_bytes)  # fmt: skip
        return lambda: tma_gather_2d_kernel[grid](*args, BOX_ROWS=box_rows, ROW_WORDS=words,
                                                  DEVICE_DESC=cfg.device_desc, **opts)  # fmt: skip
    if cfg.device_desc:
        raise ValueError("the 1-D kernel takes host descriptors only")
    dtype, box = {4: torch.int32, 8: torch.int64}[cfg.elem_bytes], cfg.box_bytes // cfg.elem_bytes
    pool1d, dst1d = pool.view(dtype), dst.view(-1).view(dtype)
    src_desc = TensorDescriptor(pool1d, [pool1d.numel()], [1], [box])
    dst_desc = TensorDescriptor(dst1d, [dst1d.numel()], [1], [box]) if cfg.desc_store else None
    args = (src_desc, dst_desc, None if cfg.desc_store else dst1d, ids, total, boxes_per_block,
            block_bytes // cfg.elem_bytes)  # fmt: skip
    return lambda: tma_gather_1d_kernel[grid](*args, BOX=box, **opts)


def pointer_info(t: torch.Tensor) -> dict:
    """How the driver sees a pinned tensor's address: memory type and device pointer (``cuPointerGetAttribute``)."""
    out = {"host_ptr": t.data_ptr()}
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        mem_type, dev_ptr = ctypes.c_uint(0), ctypes.c_uint64(0)
        lib.cuPointerGetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        get = lambda dest, attr: lib.cuPointerGetAttribute(ctypes.addressof(dest), attr, t.data_ptr())  # noqa: E731
        code_t = get(mem_type, 2)  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE
        code_p = get(dev_ptr, 3)  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        out.update(memory_type={1: "host", 2: "device", 3: "array", 4: "unified"}.get(mem_type.value, mem_type.value),
                   memory_type_result=code_t, device_ptr=dev_ptr.value, device_ptr_result=code_p,
                   device_ptr_equals_host_ptr=code_p == 0 and dev_ptr.value == t.data_ptr())  # fmt: skip
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, validated (block sizes divide the pool and the moved bytes, which fit the pool)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-kib", type=int, nargs="+", default=[2, 4, 16, 64, 256])
    p.add_argument("--pool-mib", type=int, default=4096, help="pinned host pool (one tensor) the blocks are drawn from")
    p.add_argument("--total-mib", type=int, default=512, help="bytes moved per repetition")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None, help="measure only the TMA variants whose name contains one of "
                   "these strings")  # fmt: skip
    p.add_argument("--probe-timeout", type=float, default=90.0, help="seconds the TMA probe child may take; 0: none")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/recall/bench_recall_tma.json")
    args = p.parse_args(argv)
    for kib in args.block_kib:
        if kib <= 0 or (args.pool_mib * MIB) % (kib * KIB) or (args.total_mib * MIB) % (kib * KIB):
            p.error(f"--block-kib {kib} must divide --pool-mib and --total-mib")
    if args.total_mib > args.pool_mib:
        p.error("--total-mib must not exceed --pool-mib (the moved blocks are distinct)")
    return args


def make_pool(pool_bytes: int) -> torch.Tensor:
    """A pinned pool of ``pool_bytes`` random bytes, shape ``[pool_bytes]``, ``torch.uint8``, CPU (filled from the GPU
    in 64 MiB pieces)."""
    pool = torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=True)
    step = min(pool_bytes, 64 * MIB)
    for a in range(0, pool_bytes, step):
        part = pool[a : a + step].view(torch.int32)
        part.copy_(torch.randint(-(2**31), 2**31 - 1, part.shape, dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    return pool


def run_probe(args) -> dict:
    """In the probe child: one variant of each kind on a small pool at 16 KiB blocks; bit-exactness or the error."""
    block_bytes, n = 16 * KIB, 256
    pool = make_pool(n * 2 * block_bytes)
    ids = torch.randperm(2 * n, generator=torch.Generator().manual_seed(args.seed))[:n]
    expected = pool.view(-1, block_bytes)[ids].cuda()
    dst = torch.empty((n, block_bytes), dtype=torch.uint8, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {"pointer": pointer_info(pool), "kinds": {}}
    for cfg in probe_sweep():
        rec = out["kinds"][cfg.kind] = {"variant": cfg.name}
        try:
            dst.fill_(0xA5)
            make_tma_gather(cfg.for_block(block_bytes), pool, ids.cuda(), dst, block_bytes, sms)()
            torch.cuda.synchronize()
            rec["bit_exact"] = bool(torch.equal(dst, expected))
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"
            if not context_alive():
                rec["context_lost"] = True
                break
    return out


def probe_in_child(args) -> dict:
    """Run :func:`run_probe` in a child process under ``--probe-timeout``; its report, or why there is none."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", "--seed", str(args.seed)]
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.probe_timeout)
    except subprocess.TimeoutExpired as e:
        return {"error": f"probe timed out after {args.probe_timeout:g} s", "stderr_tail": str(e.stderr or "")[-2000:]}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith(PROBE_MARK)]
    if done.returncode or not lines:
        return {"error": f"probe exited with {done.returncode} and no report", "stderr_tail": done.stderr[-2000:]}
    report = json.loads(lines[-1][len(PROBE_MARK) :])
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def context_alive() -> bool:
    """Whether CUDA still works in this process (a faulting kernel leaves a sticky error behind)."""
    try:
        torch.cuda.synchronize()
        return torch.ones(1, device="cuda").item() == 1.0
    except Exception:
        return False


class Bench:
    """The pool, the per-block-size state and the measurements of one run."""

    def __init__(self, args):
        self.args, self.device = args, torch.device("cuda")
        self.pool = make_pool(args.pool_mib * MIB)
        self.addrs = torch.tensor([self.pool.data_ptr()], dtype=torch.int64, device=self.device)
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.g = torch.Generator().manual_seed(args.seed)
        self.rows: dict[int, dict] = {}
        self.ids: dict[int, torch.Tensor] = {}
        self.broken: str | None = None

    def setup(self, kib: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Device ids, destination and expected bytes at one block size (ids drawn once per size)."""
        block_bytes = kib * KIB
        if kib not in self.ids:
            n = self.args.total_mib * MIB // block_bytes
            self.ids[kib] = torch.randperm(self.pool.numel() // block_bytes, generator=self.g)[:n]
            self.rows[kib] = {"block_bytes": block_bytes, "blocks": n, "bytes": n * block_bytes, "variants": {}}
        ids = self.ids[kib]
        expected = self.pool.view(-1, block_bytes)[ids].to(self.device)
        dst = torch.empty_like(expected)
        return ids.to(self.device), dst, expected

    def measure(self, kib: int, name: str, build, dst: torch.Tensor, expected: torch.Tensor) -> dict:
        """Check ``build()``'s launch function once for bit-exactness, then time it; the record, or the error."""
        rec = self.rows[kib]["variants"][name] = {}
        if self.broken:
            rec["error"] = f"skipped: the CUDA context was lost at {self.broken}"
            return rec
        try:
            fn = build()
            dst.fill_(0xA5)
            fn()
            torch.cuda.synchronize()
            rec["bit_exact"] = bool(torch.equal(dst, expected))
            times = cuda_event_ms(fn, self.args.warmup, self.args.reps)
        except Exception as e:  # record and go on: one failing variant must not end the run
            rec["error"] = f"{type(e).__name__}: {e}"
            if not context_alive():
                self.broken = f"{kib} KiB {name}"
            return rec
        nbytes = self.rows[kib]["bytes"]
        rec["times_ms"], rec["median_ms"] = times, statistics.median(times)
        rec["gbps"] = nbytes / (rec["median_ms"] * 1e-3) / 1e9
        bulk = self.rows[kib]["variants"].get("bulk", {}).get("gbps")
        if bulk:
            rec["over_bulk"] = rec["gbps"] / bulk
        return rec

    def reference_rows(self, kib: int) -> None:
        """``bulk`` and ``kernel`` at one block size."""
        ids, dst, expected = self.setup(kib)
        block_bytes = kib * KIB
        words, n = block_bytes // 4, len(ids)
        bulk_src = torch.empty(expected.numel(), dtype=torch.uint8, pin_memory=True)
        bulk_src.copy_(self.pool.view(-1, block_bytes)[self.ids[kib]].view(-1))
        self.measure(kib, "bulk", lambda: lambda: dst.view(-1).copy_(bulk_src, non_blocking=True), dst, expected)
        zeros, offs = torch.zeros_like(ids), torch.arange(n, device=self.device, dtype=torch.int64) * words

        def kernel():
            if not kernels_available(self.device):
                raise RuntimeError("the gather kernel needs Triton")
            chunk_blocks = self.pool.numel() // block_bytes
            return lambda: copy_pieces(self.addrs, chunk_blocks, words, ids, zeros, dst, offs, words, False)

        self.measure(kib, "kernel", kernel, dst, expected)

    def tma_rows(self, kib: int, sweep: list[TmaConfig], skip_kinds: dict[str, str]) -> None:
        """The TMA variants at one block size (kinds that failed the probe recorded as skipped)."""
        ids, dst, expected = self.setup(kib)
        block_bytes, seen = kib * KIB, set()
        for spec in sweep:
            cfg = spec.for_block(block_bytes)
            if cfg.name in seen:
                continue
            seen.add(cfg.name)
            if cfg.kind in skip_kinds:
                self.rows[kib]["variants"][cfg.name] = {"error": f"skipped: probe: {skip_kinds[cfg.kind]}"}
                continue
            rec = self.measure(kib, cfg.name, lambda: make_tma_gather(cfg, self.pool, ids, dst, block_bytes, self.sms),
                               dst, expected)  # fmt: skip
            rec["config"] = dataclasses.asdict(cfg)


def cell(rec: dict | None) -> str:
    """``GB/s ratio`` of one record (``!``: not bit-exact), ``error``, or ``-`` where not measured."""
    if rec is None:
        return "-"
    if "gbps" not in rec:
        return "error"
    return f"{rec['gbps']:.1f} {rec.get('over_bulk', float('nan')):.3f}" + ("" if rec.get("bit_exact") else "!")


def block_lines(kib: int, row: dict) -> list[str]:
    """The printed table of one block size: one line per variant (GB/s, ratio to bulk, or the error's start)."""
    lines = [f"-- {kib} KiB blocks, {row['blocks']} blocks"]
    for name, rec in row["variants"].items():
        text = cell(rec) if "gbps" in rec else rec.get("error", "?")[:110]
        lines.append(f"  {name:<42} {text}")
    return lines


def summary_lines(rows: dict[int, dict]) -> list[str]:
    """Ratio to bulk per variant (rows) and block size (columns); ``!``: not bit-exact."""
    kibs = list(rows)
    names = list(dict.fromkeys(n for r in rows.values() for n in r["variants"]))
    lines = [f"{'ratio to bulk':<42}" + "".join(f"{f'{k} KiB':>9}" for k in kibs)]
    for name in names:
        cells = []
        for k in kibs:
            rec = rows[k]["variants"].get(name)
            if rec is None:
                cells.append("-")
            elif "over_bulk" in rec:
                cells.append(f"{rec['over_bulk']:.3f}" + ("" if rec.get("bit_exact") else "!"))
            else:
                cells.append("err")
        lines.append(f"{name:<42}" + "".join(f"{c:>9}" for c in cells))
    return lines


def selected_sweep(only: list[str] | None) -> list[TmaConfig]:
    """:func:`default_sweep`, narrowed to names containing one of ``only`` (as cut to no block)."""
    sweep = default_sweep()
    return [c for c in sweep if any(s in c.name for s in only)] if only else sweep


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 0
    if args.probe:
        with torch.cuda.stream(torch.cuda.Stream()):
            report = run_probe(args)
        print(PROBE_MARK + json.dumps(report), flush=True)
        return 0
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    sweep = selected_sweep(args.only)
    meta_extra = dict(cuda_runtime=torch.version.cuda, sweep=[c.name for c in sweep], probe=None)

    def save(bench: Bench, phase: str) -> None:
        meta = run_metadata(args, **meta_extra, phase=phase, seconds=round(time.perf_counter() - t0, 1),
                            sm_count=bench.sms, pool_pointer=pointer_info(bench.pool))  # fmt: skip
        write_results(args.out, {"metadata": meta, "block_sizes": list(bench.rows.values())})

    with torch.cuda.stream(torch.cuda.Stream()):
        bench = Bench(args)
        print(f"pool {args.pool_mib} MiB (one pinned tensor), {args.total_mib} MiB per repetition, {bench.sms} SMs; "
              f"{len(sweep)} TMA variants; cells: GB/s, ratio to bulk ('!': not bit-exact)", flush=True)  # fmt: skip
        for kib in args.block_kib:
            bench.reference_rows(kib)
            print("\n".join(block_lines(kib, bench.rows[kib])), flush=True)
        torch.cuda.empty_cache()
        save(bench, "bulk and kernel done; TMA pending")
        skip_kinds: dict[str, str] = {}
        if triton is None:
            skip_kinds = {c.kind: "no Triton" for c in sweep}
        elif args.probe_timeout > 0:
            probe = meta_extra["probe"] = probe_in_child(args)
            kinds = probe.get("kinds", {})
            for c in sweep:
                rec = kinds.get(c.kind)
                if "error" in probe:
                    skip_kinds[c.kind] = probe["error"]
                elif rec is None:
                    skip_kinds[c.kind] = "not reached (an earlier kind lost the CUDA context)"
                elif "error" in rec or not rec.get("bit_exact"):
                    skip_kinds[c.kind] = rec.get("error", "not bit-exact")
            print(f"probe ({probe.get('seconds', '?')} s): " + (probe["error"] if "error" in probe else ", ".join(
                f"{k}: {'ok' if r.get('bit_exact') else r.get('error', 'not bit-exact')[:80]}"
                for k, r in kinds.items())), flush=True)  # fmt: skip
        for kib in args.block_kib:
            bench.tma_rows(kib, sweep, skip_kinds)
            lines = block_lines(kib, bench.rows[kib])
            print("\n".join(lines[:1] + lines[3:]), flush=True)
            save(bench, "TMA running")
            torch.cuda.empty_cache()
    print("\n".join(summary_lines(bench.rows)))
    save(bench, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
