"""One layer's kernels of a profiled decode step, by part: the table "One layer's period" of this folder's README,
for the tensor-core estimate (`decode_step_64k_b10_mma.trace.json.gz`) and the Triton `dot` estimate before it
(`../default_trace_h200/decode_step_64k_b10_plan.trace.json.gz`, that folder's run3).

    python results/decode/tail_mma_h200/layer_parts.py
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRACES = {
    "dot": HERE.parent / "default_trace_h200" / "decode_step_64k_b10_plan.trace.json.gz",
    "mma": HERE / "decode_step_64k_b10_mma.trace.json.gz",
}
PARTS = ("the estimate of the unselected blocks", "scoring", "products", "paged attention",
         "other launches of the library", "small torch kernels and copies")  # fmt: skip


def part(name: str) -> str:
    """The part of a layer a kernel (by its name) belongs to."""
    if name in ("tail_mma", "_tail_dot_kernel"):
        return PARTS[0]
    if name == "quantkey_mma":
        return PARTS[1]
    if name.startswith("nvjet") or "splitKreduce" in name or "CUDAFunctor_add<c10::BFloat16" in name:
        return PARTS[2]  # the matrix products, their split-K reductions and the residual additions beside them
    if name.startswith("_paged"):
        return PARTS[3]
    if name.startswith("_") or name == "ranked_topk":
        return PARTS[4]
    return PARTS[5]


def main() -> None:
    rows = {}
    for label, path in TRACES.items():
        with gzip.open(path, "rt") as f:
            trace = json.load(f)
        sums = {p: [0, 0.0] for p in PARTS}
        for k in trace["period"]:
            sums[part(k["name"])][0] += 1
            sums[part(k["name"])][1] += k["us"]
        rows[label] = (sums, len(trace["period"]), trace["period_us"])
    print("| part | " + " | ".join(f"`{label}`: kernels, us" for label in rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for p in PARTS:
        print(f"| {p} | " + " | ".join(f"{s[p][0]}, {s[p][1]:.1f}" for s, _, _ in rows.values()) + " |")
    print("| **one layer** | " + " | ".join(f"**{n}, {us:.1f}**" for _, n, us in rows.values()) + " |")


if __name__ == "__main__":
    main()
