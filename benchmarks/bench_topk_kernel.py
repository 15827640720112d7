"""The two-tier top-k of a decode step's block scores: the Triton kernel against the CUDA kernel at several thread
layouts, in one run (``hf_offload/kernels/topk.py``).

For each (batch, blocks, k, ranked) shape it times each kernel inside a CUDA graph of ``--calls`` calls (median of
``--reps`` replays, per call) on random scores with a few ``+inf`` entries (the forced sink and window blocks), and
checks every result against ``ranked_topk_reference`` bit for bit. Prints one line per kernel and writes JSON
(machine, versions, git commit, every timing) to ``--out``.

    python benchmarks/bench_topk_kernel.py --out results/selection/topk_h200/bench_topk_kernel.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import cuda_graph_us, run_metadata, write_results  # noqa: E402
from hf_offload.kernels import topk  # noqa: E402

SHAPES = [(12, 4096, 128, 128), (12, 4096, 128, 512), (6, 8192, 128, 128), (8, 2048, 128, 128),
          (1, 8200, 120, 2040), (4, 8200, 120, 2040), (1, 16400, 120, 2040), (12, 4096, 120, 2040)]  # fmt: skip
"""(batch, blocks, k, ranked): 64K tokens at batch 12 (plain ``quantkey``, and the default selector's near blocks),
128K at batch 6, 32K at batch 8; 16-token blocks, a 2,048-token budget. Then the default selector's (its near blocks
16 times its selection) at batch 1 and 4 just past 128K (a decode past 8,192 blocks), batch 1 past 256K, and batch
12 at 64K."""

LAYOUTS = [None, (512, 8), (256, 16), (1024, 4), (128, 32), (1024, 8)]
"""CUDA thread layouts (threads, entries per thread) timed besides the default one (``None``), where they cover the
row (512 x 8 and 1,024 x 8: the first defaults at 4,096 and 8,192 entries)."""


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default="results/selection/bench_topk_kernel.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_topk_kernel: no CUDA device; nothing was measured")
    rows = []
    default_layout = topk._cuda_layout
    try:
        for batch, n, k, ranked in SHAPES:
            scores = torch.rand(batch, 1, n, device="cuda")
            scores[:, :, :2] = float("inf")
            scores[:, :, -8:] = float("inf")
            want = topk.ranked_topk_reference(scores, k, ranked)
            variants = [("triton", None)] + [("cuda", lay) for lay in LAYOUTS
                                             if lay is None or (lay[0] * lay[1] >= n and lay != default_layout(n))]
            for name, lay in variants:
                topk.BACKEND = name
                topk._cuda_layout = (lambda m, lay=lay: lay) if lay else default_layout
                got = topk.ranked_topk_keep(scores, k, ranked)
                same = torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
                us = cuda_graph_us(lambda i: topk.ranked_topk_keep(scores, k, ranked), args.calls, args.reps)
                layout = lay or (default_layout(n) if name == "cuda" else None)
                label = name if layout is None else f"{name} {layout[0]}x{layout[1]}"
                print(f"[{batch}, 1, {n}] k {k} ranked {ranked} {label:16s}: {us:6.2f} us  same {same}", flush=True)
                rows.append({"batch": batch, "n": n, "k": k, "ranked": ranked, "kernel": name, "layout": layout,
                             "default_layout": lay is None, "us": us, "same_as_reference": same})
    finally:
        topk._cuda_layout, topk.BACKEND = default_layout, None
    write_results(args.out, {"metadata": run_metadata(args), "rows": rows})


if __name__ == "__main__":
    main()
