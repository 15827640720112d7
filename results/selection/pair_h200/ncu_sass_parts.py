"""Reduce Nsight Compute's per-instruction source page of the scoring kernel (``ncu_sass_7e54374.csv``, written by
``ncu --import qk.ncu-rep --page source --csv --print-source sass`` in ``ncu_run.sh``) to its parts, by how often
each instruction ran at 64K tokens, batch 12 (4,096 blocks x 96 (sequence, KV head) rows: once per block, per warp
of 16 blocks, per 8 blocks, per block past the ring's first); prints and writes ``ncu_sass_parts_7e54374.json``.

    python3 results/selection/pair_h200/ncu_sass_parts.py
"""
import collections
import csv
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = {393216: "per block (the loop body)", 24576: "per warp (query preparation, constants, setup)",
         49152: "per 8 blocks (the tile reduction)", 344064: "per block past the ring (copy issue)"}

rows = list(csv.reader(open(HERE / "ncu_sass_7e54374.csv")))
header, data = rows[1], rows[2:]
i_ex, i_s = header.index("Instructions Executed"), header.index("Warp Stall Sampling (All Samples)")
parts = collections.defaultdict(lambda: [0, 0, 0])  # executed warp instructions, stall samples, SASS instructions
for r in data:
    try:
        ex, samples = int(r[i_ex]), int(r[i_s])
    except ValueError:
        continue
    part = parts[NAMES.get(ex, "other")]
    part[0] += ex
    part[1] += samples
    part[2] += 1
total_ex = sum(v[0] for v in parts.values())
total_s = sum(v[1] for v in parts.values())
out = {k: {"sass_instructions": v[2], "executed_warp_instructions": v[0], "share_executed": round(v[0] / total_ex, 3),
           "stall_samples": v[1], "share_samples": round(v[1] / total_s, 3)} for k, v in parts.items()}
result = {"kernel_commit": "7e54374", "executed_warp_instructions": total_ex, "stall_samples": total_s, "parts": out}
(HERE / "ncu_sass_parts_7e54374.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result, indent=1))
