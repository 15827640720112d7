"""Host-to-device recall through the copy engines in one batched driver call, against the gather kernel, in one run.

For each block size it times, on one pinned host pool and the same random distinct block ids (CUDA events, median
of ``--reps`` after ``--warmup`` runs, on a non-default stream):

* ``bulk``: one contiguous pinned -> device ``copy_`` of the same number of bytes (the reference);
* ``kernel``: one launch of the gather kernel (``hf_offload.kernels.gather.copy_pieces``), reading pinned memory;
* ``batch_build``: one ``cuMemcpyBatchAsync`` call (the copy engines), timed together with building its host
  pointer arrays from the block ids; ``batch_launch``: the same call with the arrays built beforehand;
* ``split_F``: a share ``F`` of the blocks through the batched call on one stream and the rest through the kernel on
  another (arrays built beforehand), from a common start event to the later of the two end events.

Every variant is checked bit-exact against the source blocks once per block size, outside the timing (``bulk``
copies a pinned copy of the same blocks). A variant that fails (driver symbol missing, call rejected, no Triton)
records its error and the run goes on. Prints a table (GB/s and ratio to bulk) and writes raw JSON (machine,
versions, git commit, settings, raw times) to ``--out``.

    python benchmarks/bench_recall_batch.py --out results/recall/bench_recall_batch.json
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import cuda_event_ms, run_metadata, write_results  # noqa: E402
from hf_offload.kernels.gather import copy_pieces, kernels_available  # noqa: E402

KIB, MIB = 1 << 10, 1 << 20
ORDER_STREAM, ORDER_ANY = 1, 3  # CUmemcpySrcAccessOrder
LOC_NONE, LOC_DEVICE, LOC_HOST = 0, 1, 2  # CUmemLocationType
NO_CUDA = "bench_recall_batch: no CUDA device (torch.cuda.is_available() is False); nothing was measured"


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", CUmemLocation), ("dstLocHint", CUmemLocation),
                ("flags", ctypes.c_uint)]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, validated (block sizes divide a chunk, the moved blocks fit the pool as distinct ids)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-kib", type=int, nargs="+", default=[2, 4, 16, 64, 256])
    p.add_argument("--pool-mib", type=int, default=4096, help="pinned host pool the random blocks are drawn from")
    p.add_argument("--total-mib", type=int, default=512, help="bytes moved per repetition")
    p.add_argument("--chunk-mib", type=int, default=64, help="bytes of one pinned pool allocation")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--split", type=float, default=0.5, help="share of the blocks the batched copy moves in split "
                   "(0.25 and 0.75 are always swept as well)")  # fmt: skip
    p.add_argument("--batch-symbol", choices=["auto", "cuMemcpyBatchAsync_v2", "cuMemcpyBatchAsync"], default="auto")
    p.add_argument("--max-count", type=int, default=0, help="copies per driver call; 0: all blocks in one call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/recall/bench_recall_batch.json")
    args = p.parse_args(argv)
    if not 0.0 <= args.split <= 1.0:
        p.error("--split must lie in [0, 1]")
    if args.pool_mib % args.chunk_mib:
        p.error("--pool-mib must be a multiple of --chunk-mib")
    for kib in args.block_kib:
        if kib <= 0 or (args.chunk_mib * MIB) % (kib * KIB) or (args.total_mib * MIB) % (kib * KIB):
            p.error(f"--block-kib {kib} must divide --chunk-mib and --total-mib")
    if args.total_mib > args.pool_mib:
        p.error("--total-mib must not exceed --pool-mib (the moved blocks are distinct)")
    return args


def split_fractions(split: float) -> list[float]:
    """The split shares to sweep: ``split`` and 0.25 / 0.75, ascending, no duplicates."""
    return sorted({round(split, 6), 0.25, 0.75})


def pointer_arrays(ids: np.ndarray, chunk_addrs: np.ndarray, chunk_blocks: int, block_bytes: int, dst_base: int,
                   dst_rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Host arrays of one batched copy: block ``ids[i]`` of the pool to row ``dst_rows[i]`` of the destination.

    Args:
        ids: pool block ids, shape ``[n]``, ``np.int64``, host; block ``b`` is row ``b % chunk_blocks`` of chunk
            ``b // chunk_blocks``.
        chunk_addrs: addresses of the pool's chunks (UVA, bytes), shape ``[n_chunks]``, ``np.uint64``, host.
        chunk_blocks: blocks per chunk.
        block_bytes: bytes per block.
        dst_base: address of the destination buffer (device memory, bytes).
        dst_rows: destination row (in blocks) per copy, shape ``[n]``, ``np.int64``; ``None``: ``0 .. n-1``.

    Returns:
        ``(dsts, srcs, sizes)``: contiguous ``np.uint64`` arrays of shape ``[n]`` (addresses and sizes in bytes).
    """
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    rows = np.arange(len(ids), dtype=np.uint64) if dst_rows is None else np.asarray(dst_rows, dtype=np.uint64)
    bb = np.uint64(block_bytes)
    srcs = chunk_addrs[ids // chunk_blocks] + (ids % chunk_blocks).astype(np.uint64) * bb
    dsts = np.uint64(dst_base) + rows * bb
    return np.ascontiguousarray(dsts), np.ascontiguousarray(srcs), np.full(len(ids), bb, dtype=np.uint64)


def host_gather(chunks: list[torch.Tensor], chunk_blocks: int, ids: torch.Tensor) -> torch.Tensor:
    """The blocks ``ids`` of the pool, gathered on the host (the expected destination).

    Args:
        chunks: the pool's chunks, each shape ``[chunk_blocks, block_bytes]``, ``torch.uint8``, CPU.
        chunk_blocks: blocks per chunk.
        ids: block ids, shape ``[n]``, ``torch.int64``, CPU.

    Returns:
        Shape ``[n, block_bytes]``, ``torch.uint8``, CPU.
    """
    out = torch.empty((len(ids), chunks[0].shape[1]), dtype=torch.uint8)
    chunk_of, row = ids // chunk_blocks, ids % chunk_blocks
    for c in chunk_of.unique().tolist():
        sel = (chunk_of == c).nonzero().flatten()
        out[sel] = chunks[c][row[sel]]
    return out


def resolve_batch_symbol(lib, symbol: str = "auto") -> tuple[str, object, bool]:
    """The batched-copy entry point of ``lib`` (``libcuda.so.1``) with its argument types set.

    CUDA 13 exports ``cuMemcpyBatchAsync_v2`` (8 arguments); CUDA 12.8/12.9 export ``cuMemcpyBatchAsync`` with a
    ``size_t* failIdx`` before the stream (9 arguments). ``"auto"`` prefers the former. Returns ``(name, function,
    has_fail_idx)``.
    """
    names = [("cuMemcpyBatchAsync_v2", False), ("cuMemcpyBatchAsync", True)]
    for name, fail_idx in names if symbol == "auto" else [n for n in names if n[0] == symbol]:
        fn = getattr(lib, name, None)
        if fn is None:
            continue
        fn.restype = ctypes.c_int
        p, n = ctypes.c_void_p, ctypes.c_size_t
        fn.argtypes = [p, p, p, n, p, p, n] + ([p] if fail_idx else []) + [p]
        return name, fn, fail_idx
    raise RuntimeError(f"libcuda.so.1 exports no {' / '.join(n for n, _ in names)} (symbol={symbol}; needs a "
                       "driver for CUDA >= 12.8)")  # fmt: skip


def attr_candidates(device_index: int) -> list[tuple[str, CUmemcpyAttributes]]:
    """Attributes to try, in order: stream order without hints, with host/device hints, then any order."""
    none, host, dev = CUmemLocation(LOC_NONE, 0), CUmemLocation(LOC_HOST, 0), CUmemLocation(LOC_DEVICE, device_index)
    return [("stream, no hints", CUmemcpyAttributes(ORDER_STREAM, none, none, 0)),
            ("stream, src host / dst device hints", CUmemcpyAttributes(ORDER_STREAM, host, dev, 0)),
            ("any order, no hints", CUmemcpyAttributes(ORDER_ANY, none, none, 0))]  # fmt: skip


class BatchCopier:
    """``cuMemcpyBatchAsync`` through ctypes on ``libcuda.so.1``, on the current torch stream (never the legacy one)."""

    def __init__(self, symbol: str = "auto", max_count: int = 0):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.name, self.fn, self.has_fail_idx = resolve_batch_symbol(self.lib, symbol)
        self.lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.max_count, self.attrs, self.attrs_label, self.attempts, self.fail_at = max_count, None, None, [], ""

    def error_name(self, code: int) -> str:
        """``cuGetErrorName`` of a CUresult."""
        s = ctypes.c_char_p()
        ok = self.lib.cuGetErrorName(code, ctypes.byref(s)) == 0 and s.value
        return s.value.decode() if ok else f"CUresult {code}"

    def call(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, attrs: CUmemcpyAttributes) -> int:
        """Enqueue the copies (``np.uint64`` arrays of shape ``[n]``: addresses, bytes); the first error code or 0."""
        idx, fail = ctypes.c_size_t(0), ctypes.c_size_t(0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        step = self.max_count or max(1, len(dsts))
        for a in range(0, len(dsts), step):
            d, s, z = dsts[a : a + step], srcs[a : a + step], sizes[a : a + step]
            head = (d.ctypes.data, s.ctypes.data, z.ctypes.data, len(d), ctypes.byref(attrs), ctypes.byref(idx), 1)
            code = self.fn(*head, ctypes.byref(fail), stream) if self.has_fail_idx else self.fn(*head, stream)
            if code:
                self.fail_at = f"failIdx {a + fail.value}" if self.has_fail_idx else f"the call from copy {a}"
                return code
        return 0

    def choose_attrs(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Try :func:`attr_candidates` on a probe copy of ``src`` (pinned, CPU) to ``dst`` (same shape and dtype,
        CUDA); keep the first set the driver accepts and that copies the bytes exactly, and record every attempt."""
        arrays = [np.array([a], dtype=np.uint64) for a in (dst.data_ptr(), src.data_ptr(), src.nbytes)]
        for label, attrs in attr_candidates(torch.cuda.current_device()):
            dst.zero_()
            code = self.call(*arrays, attrs)
            torch.cuda.synchronize()
            exact = code == 0 and torch.equal(dst.cpu(), src)
            self.attempts.append({"attrs": label, "result": self.error_name(code) if code else "CUDA_SUCCESS",
                                  "probe_bit_exact": exact})  # fmt: skip
            if exact:
                self.attrs, self.attrs_label = attrs, label
                return
        raise RuntimeError(f"{self.name} failed with every attribute set: {self.attempts}")

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        """One batched copy on the current stream with the chosen attributes; raises with the CUresult name."""
        self.last = (dsts, srcs, sizes)  # kept alive until the next call, should the driver read them late
        if len(dsts) and (code := self.call(dsts, srcs, sizes, self.attrs)):
            raise RuntimeError(f"{self.name} returned {self.error_name(code)} ({code}), {self.fail_at}")


def driver_versions() -> dict:
    """``cuDriverGetVersion`` (e.g. 13000) and the NVIDIA driver release from nvidia-smi, ``None`` where unknown."""
    out, v = {"cuda_driver_api": None, "nvidia_driver": None}, ctypes.c_int(0)
    try:
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(v)) == 0:
            out["cuda_driver_api"] = v.value
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        lines = subprocess.run(smi, capture_output=True, text=True, timeout=30).stdout.split()
        out["nvidia_driver"] = lines[0] if lines else None
    except Exception:
        pass
    return out


def two_stream_times(kernel_fn, batch_fn, s_kernel, s_batch, warmup: int, reps: int) -> list[tuple[float, float]]:
    """``(kernel_ms, batch_ms)`` per repetition: both streams start from one event recorded on the current stream,
    the kernel is launched first (its launch is short), each stream's end event is timed from that start."""
    out = []
    for i in range(warmup + reps):
        start, ek, eb = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        s_kernel.wait_event(start)
        s_batch.wait_event(start)
        with torch.cuda.stream(s_kernel):
            kernel_fn()
        with torch.cuda.stream(s_batch):
            batch_fn()
        ek.record(s_kernel)
        eb.record(s_batch)
        ek.synchronize()
        eb.synchronize()
        if i >= warmup:
            out.append((start.elapsed_time(ek), start.elapsed_time(eb)))
    return out


def bench_block(args, kib: int, pool: list[torch.Tensor], copier: BatchCopier | None, g: torch.Generator) -> dict:
    """Every variant at one block size (see the module docstring).

    Args:
        args: the parsed command line; kib: block size in KiB.
        pool: the pinned host pool's chunks, each shape ``[chunk_mib * 2**20]``, ``torch.uint8``, CPU (pinned).
        copier: the batched copy with its attributes chosen, or ``None`` (its error is in the metadata).
        g: CPU generator of the random block ids.

    Returns:
        Sizes, and per variant raw and median ms, GB/s, ratio to bulk and bit-exactness, or the error.
    """
    device = torch.device("cuda")
    block_bytes, chunk_bytes = kib * KIB, args.chunk_mib * MIB
    chunk_blocks = chunk_bytes // block_bytes
    n = args.total_mib * MIB // block_bytes
    ids = torch.randperm(len(pool) * chunk_blocks, generator=g)[:n]
    ids_np, nbytes = ids.numpy(), n * block_bytes
    expected = host_gather([c.view(chunk_blocks, block_bytes) for c in pool], chunk_blocks, ids)
    addrs_np = np.array([c.data_ptr() for c in pool], dtype=np.uint64)
    addrs_dev = torch.from_numpy(addrs_np.view(np.int64)).to(device)
    dst = torch.empty((n, block_bytes), dtype=torch.uint8, device=device)
    words = block_bytes // 4
    ids_dev = ids.to(device)
    zeros, offs = torch.zeros_like(ids_dev), torch.arange(n, device=device, dtype=torch.int64) * words
    bulk_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).copy_(expected.view(-1))  # checkable too
    row = {"block_bytes": block_bytes, "blocks": n, "bytes": nbytes, "variants": {}}

    def kernel(lo: int = 0, hi: int = n):
        copy_pieces(addrs_dev, chunk_blocks, words, ids_dev[lo:hi], zeros[lo:hi], dst, offs[lo:hi], words, False)

    def arrays(lo: int = 0, hi: int = n):
        return pointer_arrays(ids_np[lo:hi], addrs_np, chunk_blocks, block_bytes, dst.data_ptr(), np.arange(lo, hi))

    def measure(name: str, fn, timer=cuda_event_ms) -> None:
        rec = row["variants"][name] = {}
        try:
            if name.startswith(("kernel", "split")) and not kernels_available(device):
                raise RuntimeError("the gather kernel needs Triton")
            if name.startswith(("batch", "split")) and copier is None:
                raise RuntimeError("no batched copy, see metadata.batch_api.error")
            dst.fill_(0xA5)
            timer(fn, 0, 1)
            torch.cuda.synchronize()
            rec["bit_exact"] = bool(torch.equal(dst.cpu(), expected))
            times = timer(fn, args.warmup, args.reps)
        except Exception as e:  # record and go on: one failing variant must not end the run
            rec["error"] = f"{type(e).__name__}: {e}"
            try:
                torch.cuda.synchronize()
            except Exception:  # a sticky CUDA error: the variants after this one will record it too
                pass
            return
        if times and isinstance(times[0], tuple):
            rec["kernel_ms"], rec["batch_ms"] = [t[0] for t in times], [t[1] for t in times]
            times = [max(t) for t in times]
        rec["times_ms"], rec["median_ms"] = times, statistics.median(times)
        rec["gbps"] = nbytes / (rec["median_ms"] * 1e-3) / 1e9

    measure("bulk", lambda: dst.view(-1).copy_(bulk_src, non_blocking=True))
    measure("kernel", kernel)
    measure("batch_build", lambda: copier.copy(*arrays()))
    prebuilt = arrays()
    measure("batch_launch", lambda: copier.copy(*prebuilt))
    s_kernel, s_batch = torch.cuda.Stream(), torch.cuda.Stream()
    for f in split_fractions(args.split):
        m = round(f * n)  # the batched copy moves blocks [0, m), the kernel [m, n)
        part = arrays(0, m)

        def timer(fn, warmup, reps, m=m, part=part):
            return two_stream_times(lambda: kernel(m, n), lambda: copier.copy(*part), s_kernel, s_batch, warmup, reps)

        measure(f"split_{f:g}", None, timer=timer)
        row["variants"][f"split_{f:g}"]["batch_blocks"] = m
    bulk = row["variants"]["bulk"].get("gbps")
    for rec in row["variants"].values():
        if bulk and "gbps" in rec:
            rec["over_bulk"] = rec["gbps"] / bulk
    return row


def table_lines(kib: int, row: dict, header: bool) -> list[str]:
    """The printed table: GB/s and ratio to bulk per variant (``!`` marks a result that is not bit-exact)."""
    def cell(rec):
        if "gbps" not in rec:
            return "error"
        return f"{rec['gbps']:.1f} {rec.get('over_bulk', float('nan')):.3f}" + ("" if rec.get("bit_exact") else "!")

    lines = [f"{'KiB':>4}  " + "".join(f"{name:>15}" for name in row["variants"])] if header else []
    return lines + [f"{kib:>4}  " + "".join(f"{cell(rec):>15}" for rec in row["variants"].values())]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    main_stream = torch.cuda.Stream()  # cuMemcpyBatchAsync refuses the legacy default stream
    copier, copier_error, rows = None, None, []
    with torch.cuda.stream(main_stream):
        pool = []
        for _ in range(args.pool_mib // args.chunk_mib):
            pool.append(torch.empty(args.chunk_mib * MIB, dtype=torch.uint8, pin_memory=True))
            rand = torch.randint(-(2**31), 2**31 - 1, (args.chunk_mib * MIB // 4,), dtype=torch.int32, device="cuda")
            pool[-1].view(torch.int32).copy_(rand)
        torch.cuda.synchronize()
        try:
            copier = BatchCopier(args.batch_symbol, args.max_count)
            copier.choose_attrs(pool[0][: 4 * KIB], torch.empty(4 * KIB, dtype=torch.uint8, device="cuda"))
        except Exception as e:  # recorded; the batch and split variants report it
            copier_error = f"{type(e).__name__}: {e}"
        ready = copier if copier is not None and copier.attrs is not None else None
        print(f"pool {args.pool_mib} MiB, {args.total_mib} MiB per repetition; batched copy: "
              f"{f'{ready.name}, {ready.attrs_label}' if ready else copier_error}\ncells: GB/s, ratio to bulk")
        for kib in args.block_kib:
            rows.append(bench_block(args, kib, pool, ready, g))
            print("\n".join(table_lines(kib, rows[-1], header=len(rows) == 1)), flush=True)
            torch.cuda.empty_cache()
    batch_api = {"symbol": copier.name if copier else None, "error": copier_error,
                 "attrs": copier.attrs_label if copier else None, "attempts": copier.attempts if copier else []}
    meta = run_metadata(args, cuda_runtime=torch.version.cuda, driver=driver_versions(),
                        batch_api=batch_api, split_fractions=split_fractions(args.split))  # fmt: skip
    write_results(args.out, {"metadata": meta, "block_sizes": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
