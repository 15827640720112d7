"""The two-tier top-k kernel (``hf_offload.kernels.topk``) with each way of finding its thresholds, and
``torch.topk``, at the shapes of a decode step.

For each ``--shapes`` entry ``BATCHxN:K:RANKED`` (block scores ``[batch, 1, n]``, float32, random normal) it times
``ranked_topk`` with ``SEARCH = "radix"`` and ``"bisect"`` and ``torch.topk(scores, ranked)`` inside a CUDA graph of
``--calls`` launches: CUDA events around one replay, the median of ``--reps`` replays, divided by ``--calls``. The two
searches' results are compared with each other and with ``ranked_topk_reference``. Prints a table (microseconds per
call) and writes JSON (machine, versions, git commit, every timing) to ``--out``.

    python benchmarks/bench_topk_kernel.py --out results/selection/bench_topk_kernel.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload.kernels import topk  # noqa: E402

NO_CUDA = "bench_topk_kernel: no CUDA device (torch.cuda.is_available() is False); nothing was measured"
# 64K and 128K tokens of 16-token blocks at batch 12 and 6; k: the blocks a 2048-token budget selects besides sinks,
# window and the open block (plain quantkey); ranked 4 k: with tail_near=3 (the default selector).
DEFAULT_SHAPES = ["12x4096:108:108", "12x4096:108:432", "6x8192:108:108", "6x8192:108:432"]


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``BATCHxN:K:RANKED`` as four ints; a ``ValueError`` that shows the form otherwise."""
    try:
        size, k, ranked = text.split(":")
        batch, n = size.split("x")
        return int(batch), int(n), int(k), int(ranked)
    except ValueError:
        raise ValueError(f"--shapes entries look like 12x4096:108:432 (BATCHxN:K:RANKED), got {text!r}") from None


def graph_us(fn, calls: int, reps: int) -> float:
    """Median microseconds per call of ``fn`` replayed ``calls`` times in one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="BATCHxN:K:RANKED")
    p.add_argument("--calls", type=int, default=20, help="launches per timed CUDA graph replay")
    p.add_argument("--reps", type=int, default=50, help="timed replays (the median is reported)")
    p.add_argument("--out", default="results/selection/bench_topk_kernel.json")
    args = p.parse_args(argv)
    shapes = [parse_shape(s) for s in args.shapes]
    if not torch.cuda.is_available():
        print(NO_CUDA)
        return 1
    rows = []
    print(f"{'shape':>18} {'radix us':>9} {'bisect us':>10} {'torch.topk us':>14} same")
    for batch, n, k, ranked in shapes:
        g = torch.Generator(device="cuda").manual_seed(n + k)
        scores = torch.randn(batch, 1, n, device="cuda", generator=g)
        want = topk.ranked_topk_reference(scores, k, ranked)
        row = {"batch": batch, "n": n, "k": k, "ranked": ranked}
        results = {}
        saved = topk.SEARCH
        try:
            for search in ("radix", "bisect"):
                topk.SEARCH = search
                results[search] = topk.ranked_topk(scores, k, ranked)
                row[f"{search}_us"] = graph_us(lambda: topk.ranked_topk(scores, k, ranked), args.calls, args.reps)
        finally:
            topk.SEARCH = saved
        row["torch_topk_us"] = graph_us(lambda: torch.topk(scores, ranked, dim=-1), args.calls, args.reps)
        row["same"] = all(torch.equal(results[s][0], want[0]) and torch.equal(results[s][1], want[1])
                          for s in results)  # fmt: skip
        rows.append(row)
        print(f"{f'{batch}x{n}:{k}:{ranked}':>18} {row['radix_us']:9.2f} {row['bisect_us']:10.2f} "
              f"{row['torch_topk_us']:14.2f} {row['same']}")
    write_results(args.out, {"metadata": run_metadata(args), "rows": rows})
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
