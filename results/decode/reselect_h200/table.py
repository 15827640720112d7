"""The tables of this folder's README from its JSON files: decode throughput of plain ``quantkey`` at 64K tokens,
batch 12, by ``reselect_every``, with the steps that chose and the steps that reused apart, and the ratios to
``DynamicCache`` in the same call (``run2``); then the runs of ``run3.sh`` (other contexts and batches).

    python results/decode/reselect_h200/table.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent


def row(path: Path, dynamic: float | None) -> str:
    data = json.loads(path.read_text())
    run, meta = data["runs"][0], data["metadata"]
    every = meta.get("reselect_every", 1)
    each = run["step_ms_each"]
    # Timed step i is decode step warmup + i + 1 of the layer; its kind follows from the reuse pattern only between
    # seals, so the two kinds are told apart by time: the reusing steps skip scoring and top-k (under 9 ms here).
    reuse = [ms for ms in each if ms < 9.0] if every > 1 else []
    choose = [ms for ms in each if ms >= 9.0] if every > 1 else each
    ratio = f"{run['tokens_per_s'] / dynamic:.2f}x" if dynamic else "-"
    reusing = f"{statistics.median(reuse):.2f}" if reuse else "-"
    cells = [f"`{path.name}`", f"`{meta['git_commit'][:7]}`", every, run["warmup_steps"], run["steps"],
             f"{run['tokens_per_s']:.1f}", f"{run['step_ms']:.2f}", f"{statistics.median(choose):.2f}", reusing,
             f"{max(each):.1f}", run["stats"]["reused_selections"], ratio]  # fmt: skip
    return "| " + " | ".join(map(str, cells)) + " |"


def main() -> None:
    dyn = json.loads((HERE / "bench_decode_64k_b12_dynamic.json").read_text())["runs"][0]
    print(f"DynamicCache, 64K, batch 12 (run2): {dyn['tokens_per_s']:.1f} tok/s, {dyn['step_ms']:.2f} ms per step")
    print()
    print("| file | commit | reselect_every | warm-up | steps | tok/s | mean ms | median ms, choosing steps | "
          "median ms, reusing steps | slowest ms | reused layer steps | / DynamicCache |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in sorted(HERE.glob("bench_decode_64k_b12_r*.json")):
        print(row(path, None))
    for path in sorted(HERE.glob("bench_decode_64k_b12_w8_r*.json")):
        print(row(path, dyn["tokens_per_s"]))


def run3() -> None:
    """``run3.sh``: 128K, batch 6 (every block on the device) and 64K, batches 14 and 16 (part of the KV in host
    memory), one process each."""
    print("| file | commit | context | batch | reselect_every | steps | tok/s | mean ms | median ms | KV on host GiB | "
          "read from host MB/step | hit rate | reused layer steps |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for path in sorted(HERE.glob("run3_bench_decode_*.json")):
        data = json.loads(path.read_text())
        run, meta = data["runs"][0], data["metadata"]
        cells = [f"`{path.name}`", f"`{meta['git_commit'][:7]}`", run["context"], run["batch"],
                 meta.get("reselect_every", 1), run["steps"], f"{run['tokens_per_s']:.1f}", f"{run['step_ms']:.2f}",
                 f"{run['step_ms_median']:.2f}", f"{run['host_kv_bytes'] / 2**30:.1f}",
                 f"{run['host_recalled_bytes_per_step'] / 1e6:.0f}", f"{run['hit_rate']:.2f}",
                 run["stats"]["reused_selections"]]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
    print()
    run3()
