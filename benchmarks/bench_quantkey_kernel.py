"""The ``quantkey`` scoring kernels (block log-sum-exp over quantized keys) at their launch and compile settings.

For one decode shape (default: Llama-3.1-8B, batch 8, 8 KV heads of 4 query heads each, 2048 blocks of 16 tokens,
head_dim 128) and each ``--bits``, on CUDA, it times:

* ``v2``: the Triton kernel, at every launch setting of the grid ``--warps`` x ``--rows-per-thread`` (warps per
  program; token rows of a block per thread), with as many blocks per program as fill the warps (a block is
  spread over a fixed number of threads, see ``_default_config``); the setting ``block_lse`` uses by default is
  marked ``*`` (and timed even where the grid leaves it out);
* ``mma``: the tensor-core CUDA kernel (``hf_offload.kernels.quantkey_mma``), where it takes the shape (2-bit codes, 16-token blocks, bfloat16 summaries, compute capability
  9.0+), and the same loading the next block ahead (``mma-pf``), with 8 warps per program, with a ring of ``S``
  blocks in flight through asynchronous copies (``-sS``, :data:`~hf_offload.kernels.quantkey_mma.STAGES`), with two
  accumulators (``-c2``, ``CHAINS``), with registers capped for ``B`` programs per multiprocessor (``-bB``,
  ``MIN_BLOCKS``), and with each block's log-sum-exp reduced through a tile in shared memory instead of warp
  shuffles (``-t``, ``TRANSPOSE``); their error is also given against ``block_lse_emulated``, the rounding they are
  meant to do;
* ``reference``: the pure-torch ``block_lse_reference`` (one timing).

Kernels are timed inside a CUDA graph of ``--calls`` launches alternating between two sets of inputs (so a call
finds little of its data in L2, as in a decode step where each layer scores its own codes): CUDA events around one
replay, median of ``--reps`` replays after ``--warmup``, divided by ``--calls``. Each kernel's output is checked
against the reference (largest absolute difference). Prints a table (microseconds per call, GB/s of code bytes,
GB/s of all bytes read, speed-up over the first setting, largest error, registers per thread and spilled bytes of the compiled
kernel, seconds of the first call, compilation included) and writes JSON (machine, versions, git commit, settings,
every timing) to ``--out``.

    python benchmarks/bench_quantkey_kernel.py --out results/selection/bench_quantkey_kernel.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload.kernels import quantkey, quantkey_mma  # noqa: E402
from hf_offload.kernels.quantkey import _default_config, _launch_block_lse, block_lse_reference  # noqa: E402

NO_CUDA = "bench_quantkey_kernel: no CUDA device (torch.cuda.is_available() is False); nothing was measured"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (shape, bit widths, launch-setting grid, timing, output)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--blocks", type=int, default=2048, help="blocks per sequence and KV head")
    p.add_argument("--tokens", type=int, default=16, help="tokens per block (a power of two)")
    p.add_argument("--head-dim", type=int, default=128, help="a power of two")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4], choices=[1, 2, 4, 8])
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="dtype of kmin / kstep (the cache dtype)")  # fmt: skip
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8], help="warps per program (powers of two)")
    p.add_argument("--rows-per-thread", type=int, nargs="+", default=[16, 8, 4],
                   help="token rows of a block per thread (powers of two, at most --tokens)")  # fmt: skip
    p.add_argument("--calls", type=int, default=10, help="kernel launches per timed CUDA graph replay")
    p.add_argument("--reps", type=int, default=50, help="timed replays per setting (the median is reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed replays before the timed ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/selection/bench_quantkey_kernel.json")
    args = p.parse_args(argv)
    for name in ("tokens", "head_dim"):
        value = getattr(args, name)
        if value <= 0 or value & (value - 1):
            p.error(f"--{name.replace('_', '-')} must be a power of two")
    for value in (*args.warps, *args.rows_per_thread):
        if value <= 0 or value & (value - 1):
            p.error("--warps and --rows-per-thread values must be powers of two")
    if min(args.batch, args.kv_heads, args.group, args.blocks, args.calls, args.reps) <= 0:
        p.error("sizes, --calls and --reps must be positive")
    return args


def make_inputs(args, bits: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Random codes (uniform bytes), block minima and steps, and pre-scaled queries on CUDA."""
    dtype = getattr(torch, args.dtype)
    b, n, h, t, d = args.batch, args.blocks, args.kv_heads, args.tokens, args.head_dim
    codes = torch.randint(0, 256, (b, n, h, t, d * bits // 8), dtype=torch.uint8, generator=g).cuda()
    kmin = (torch.randn(b, n, h, d, generator=g) - 2).to(dtype).cuda()
    kstep = (torch.rand(b, n, h, d, generator=g) * 4 / ((1 << bits) - 1)).to(dtype).cuda()
    query = (torch.randn(b, h, args.group, d, generator=g) * d**-0.5).cuda()
    return {"query": query, "codes": codes, "kmin": kmin, "kstep": kstep}


def graph_time(launch, sets: list[dict], outs: list[torch.Tensor], args) -> float:
    """Median seconds per launch: ``args.calls`` launches (alternating input sets) captured in one CUDA graph."""
    for s, o in zip(sets, outs):  # compiles outside the capture
        launch(s, o)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(args.calls):
            launch(sets[i % len(sets)], outs[i % len(outs)])
    for _ in range(args.warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / args.calls)
    del graph
    return statistics.median(times)


def compiled_stats(variant: str) -> dict:
    """Registers per thread, spilled bytes and shared memory of the kernel compiled last for ``variant``."""
    fn = {"v2": "_block_lse_kernel"}
    try:
        cache = getattr(quantkey, fn[variant]).device_caches[torch.cuda.current_device()][0]
        kernel = list(cache.values())[-1]
        kernel = kernel.result() if hasattr(kernel, "result") else kernel
        return {"n_regs": kernel.n_regs, "n_spills": kernel.n_spills, "shared_bytes": kernel.metadata.shared}
    except Exception:  # statistics only: a Triton without these attributes leaves them out
        return {}


def settings(args, bits: int) -> list[dict]:
    """The launch settings to time for one bit width: ``v2`` over the grid (its default included), then ``mma``."""
    chosen = []
    for warps in args.warps:
        for rows in sorted({min(r, args.tokens) for r in args.rows_per_thread}, reverse=True):
            config = _default_config(args.tokens, args.head_dim, bits, args.group, warps, rows)
            chosen.append({"variant": "v2", **config})
    mine = {"variant": "v2", **_default_config(args.tokens, args.head_dim, bits, args.group)}
    if mine not in chosen:
        chosen.append(mine)
    # The tensor-core CUDA kernel, where it takes the shape (2-bit codes, ...): its default, then one change at a
    # time (loading the next block ahead, two blocks per loop iteration, 8 warps per program, ...).
    base = {"variant": "mma", "block_n": None, "num_warps": 4, "rows_per_thread": None, "prefetch": False, "unroll": 1,
            "stages": 0, "chains": 1, "min_blocks": 0, "transpose": False}  # fmt: skip
    for change in ({}, {"prefetch": True}, {"num_warps": 8}, {"stages": 2}, {"stages": 3}, {"stages": 4},
                   {"chains": 2}, {"stages": 2, "min_blocks": 8}, {"stages": 2, "chains": 2},
                   {"transpose": True}, {"stages": 2, "transpose": True}, {"stages": 3, "transpose": True},
                   {"stages": 4, "transpose": True}, {"stages": 2, "transpose": True, "num_warps": 8},
                   {"stages": 2, "transpose": True, "min_blocks": 8}, {"stages": 2, "transpose": True, "chains": 2},
                   {"stages": 3, "transpose": True, "min_blocks": 7}):  # fmt: skip
        chosen.append({**base, **change})
    return chosen


def bench_bits(args, bits: int, g: torch.Generator) -> dict:
    """Time every setting of one bit width; returns the shape's byte counts, the reference and each setting's row."""
    sets = [make_inputs(args, bits, g) for _ in range(2)]
    first = sets[0]
    code_bytes = first["codes"].numel()
    read_bytes = code_bytes + 2 * first["kmin"].numel() * first["kmin"].element_size() + first["query"].numel() * 4
    reference = block_lse_reference(first["query"], first["codes"], first["kmin"], first["kstep"], bits)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    block_lse_reference(first["query"], first["codes"], first["kmin"], first["kstep"], bits)
    end.record()
    end.synchronize()
    ref_s = start.elapsed_time(end) / 1e3
    outs = [torch.empty_like(reference) for _ in sets]
    default = {"variant": "v2", **_default_config(args.tokens, args.head_dim, bits, args.group)}
    if quantkey_mma.mma_supported(first["query"], first["codes"], first["kmin"], bits):  # what block_lse runs
        default = {"variant": "mma", "block_n": None, "num_warps": quantkey_mma.WARPS, "rows_per_thread": None,
                   "prefetch": quantkey_mma.PREFETCH, "unroll": quantkey_mma.UNROLL, "stages": quantkey_mma.STAGES,
                   "chains": quantkey_mma.CHAINS, "min_blocks": quantkey_mma.MIN_BLOCKS,
                   "transpose": quantkey_mma.TRANSPOSE}  # fmt: skip
    rows = []
    for setting in settings(args, bits):

        def launch(s, o, setting=setting):
            if setting["variant"] == "mma":  # compile-time settings of the CUDA kernel
                quantkey_mma.PREFETCH, quantkey_mma.UNROLL = setting["prefetch"], setting["unroll"]
                quantkey_mma.WARPS, quantkey_mma.STAGES = setting["num_warps"], setting["stages"]
                quantkey_mma.CHAINS, quantkey_mma.MIN_BLOCKS = setting["chains"], setting["min_blocks"]
                quantkey_mma.TRANSPOSE = setting["transpose"]
            compile_time = ("prefetch", "unroll", "stages", "chains", "min_blocks", "transpose")
            options = {k: v for k, v in setting.items() if k not in compile_time}
            _launch_block_lse(s["query"], s["codes"], s["kmin"], s["kstep"], bits, o, **options)

        row = {**setting, "default": setting == default}
        if setting["variant"] == "mma" and not quantkey_mma.mma_supported(
            first["query"], first["codes"], first["kmin"], bits
        ):
            continue
        try:
            started = time.perf_counter()
            launch(first, outs[0])
            torch.cuda.synchronize()
            row["first_call_seconds"] = time.perf_counter() - started
            row.update(compiled_stats(setting["variant"]))
            row["seconds"] = graph_time(launch, sets, outs, args)
            launch(first, outs[0])
            row["max_abs_err"] = (outs[0] - reference).abs().max().item()
            if setting["variant"] == "mma":  # against the rounding the kernel is meant to do
                emulated = quantkey_mma.block_lse_emulated(first["query"], first["codes"], first["kmin"], first["kstep"],
                                                           bits)
                row["max_abs_err_vs_emulated"] = (outs[0] - emulated).abs().max().item()
        except Exception as e:  # recorded (a setting the compiler rejects, say); the sweep goes on
            row["error"] = f"{type(e).__name__}: {e}"[-800:]
        rows.append(row)
        print(table_line(row, code_bytes, read_bytes, rows[0].get("seconds")), flush=True)
    return {"bits": bits, "code_bytes": code_bytes, "read_bytes": read_bytes, "reference_seconds": ref_s,
            "rows": rows}  # fmt: skip


HEADER = f"{'variant':<9} {'blk':>4} {'warps':>5} {'rows':>4} {'us/call':>9} {'code GB/s':>9} {'read GB/s':>9} " \
         f"{'x 1st':>6} {'max err':>9} {'regs':>4} {'spill':>5} {'first s':>7}"  # fmt: skip


def table_line(row: dict, code_bytes: int, read_bytes: int, first_seconds: float | None) -> str:
    """One row of the table: setting, microseconds per call, GB/s of codes and of all bytes read, speed-up, error."""
    name = row["variant"] + ("*" if row.get("default") else "") + ("-pf" if row.get("prefetch") else "")
    name += f"-u{row['unroll']}" if row.get("unroll", 1) > 1 else ""
    name += f"-s{row['stages']}" if row.get("stages") else ""
    name += "-c2" if row.get("chains", 1) > 1 else ""
    name += f"-b{row['min_blocks']}" if row.get("min_blocks") else ""
    name += "-t" if row.get("transpose") else ""
    head = f"{name:<9} {row['block_n'] or '-':>4} {row['num_warps'] or '-':>5} {row['rows_per_thread'] or '-':>4}"
    if "error" in row:
        return f"{head} failed: {row['error'][:120]}"
    s = row["seconds"]
    ratio = f"{first_seconds / s:.2f}" if first_seconds else "-"
    return f"{head} {s * 1e6:>9.1f} {code_bytes / s / 1e9:>9.0f} {read_bytes / s / 1e9:>9.0f} {ratio:>6} " \
           f"{row['max_abs_err']:>9.2e} {row.get('n_regs', '-'):>4} {row.get('n_spills', '-'):>5} " \
           f"{row['first_call_seconds']:>7.1f}"  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(args.seed)
    results = []
    for bits in args.bits:
        shape = f"batch {args.batch}, {args.kv_heads} KV heads x {args.group}, {args.blocks} blocks x {args.tokens}"
        print(f"\nbits {bits}: {shape} tokens, head_dim {args.head_dim}; * = block_lse's default\n{HEADER}",
              flush=True)  # fmt: skip
        result = bench_bits(args, bits, g)
        results.append(result)
        s = result["reference_seconds"]
        print(f"{'reference':<25} {s * 1e6:>9.1f} {result['code_bytes'] / s / 1e9:>9.0f} "
              f"{result['read_bytes'] / s / 1e9:>9.0f}", flush=True)  # fmt: skip
        timed = [r for r in result["rows"] if r["variant"] == "v2" and "seconds" in r]
        if timed:
            best = min(timed, key=lambda r: r["seconds"])
            print(f"fastest v2: block_n {best['block_n']}, {best['num_warps']} warps, {best['rows_per_thread']} rows "
                  f"per thread, {best['seconds'] * 1e6:.1f} us", flush=True)  # fmt: skip
        mma = [r for r in result["rows"] if r["variant"] == "mma" and "seconds" in r]
        if timed and mma:
            print(f"fastest mma against fastest v2: {best['seconds'] / min(r['seconds'] for r in mma):.2f} x",
                  flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    import triton

    meta = run_metadata(args, device=torch.cuda.get_device_name(), torch_version=torch.__version__,
                        triton_version=triton.__version__, cuda_runtime=torch.version.cuda,
                        timing={"method": "CUDA graph of --calls launches over 2 alternating input sets, CUDA events "
                                "around each replay, median of --reps replays after --warmup, per launch"})  # fmt: skip
    write_results(args.out, {"metadata": meta, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
