#!/bin/bash
# Before/after decode throughput on one H200 in one call: 8B shape, random bf16 weights and random KV, 64K tokens,
# batch 12, plain quantkey with admission "auto" (every block on the device: hit rate 1.0), budget 2048.
# .old/ holds the library and benchmarks at 43d87a7 (before the refactor); the repository root is after.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run() {  # $1: tree, $2: tag
  (cd "$1" && PYTHONPATH=$PWD timeout -s TERM 110 python3 benchmarks/bench_decode.py --contexts 65536 --steps 32 \
    --config-seconds 10 --max-seconds 95 --quantkey-selector quantkey --methods quantkey-auto --batches 12 \
    --out "$OUT/$2.json" > "$OUT/$2.log" 2>&1; echo "$2 rc=$?"; tail -3 "$OUT/$2.log" | cut -c1-160)
}
run .old before_1
run . after_1
run . after_2
run .old before_2
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
rows = []
for tag in ("before_1", "after_1", "after_2", "before_2"):
    try:
        r = json.load(open(f"{out}/{tag}.json"))["runs"][0]
        rows.append((tag, r["tokens_per_s"], r["step_ms_median"], r["hit_rate"]))
    except Exception as e:
        rows.append((tag, None, None, repr(e)[:60]))
for row in rows:
    print(*row, sep="\t")
json.dump(rows, open(f"{out}/ab_summary.json", "w"), indent=1)
PY
