#!/bin/bash
# reselect_every 1 and 2 at 128K tokens, batch 6 (every block on the device) and at 64K, batch 14 (past the batch
# whose KV fits the device: admission auto offloads the rest), plain quantkey, 8B shape, random bf16 weights, KV
# filled without a prefill, one process each, the default warm-up (3 + reselect_every steps).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/reselect_h200/run3.sh ["CONTEXT BATCH EVERY" ...] (default: all four)
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
date +%T
[ $# -gt 0 ] || set -- "131072 6 1" "131072 6 2" "65536 14 1" "65536 14 2"
for spec in "$@"; do
  set -- $spec
  timeout 100 python3 benchmarks/bench_decode.py --contexts $1 --steps 48 --config-seconds 10 --max-seconds 90 \
    --quantkey-selector quantkey --methods quantkey-auto --batches $2 --reselect-every $3 \
    --out $OUT/bench_decode_${1}_b$2_r$3.json > /tmp/l.txt 2>&1
  echo "$1 b$2 r$3 rc=$? $(date +%T)"; grep -E "^quantkey-auto +[0-9]|skip|Error" /tmp/l.txt | cut -c1-160
done
