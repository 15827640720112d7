#!/bin/bash
# On one H200, with cuda_graphs=None as the default: what OffloadCache(model, budget_tokens=2048) gives with its
# defaults (the default selector, every sealed block in pinned host memory, admission "always") at 64K tokens and
# batch 8, graphs as the default has them and with cuda_graphs=False, one process each; then plain quantkey with
# admission auto at batch 12 once more (8B shape, random bf16 weights, KV filled without a prefill).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/graphs_default_h200/run2.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
for graphs in default off; do
  timeout -s TERM 170 python3 benchmarks/bench_decode.py --contexts 65536 --steps 16 --config-seconds 10 \
    --max-seconds 160 --methods quantkey --quantkey-selector "quantkey[bits=4,tail_bits=2,tail_near=3]" \
    --batches 8 --cuda-graphs $graphs --out $OUT/bench_decode_64k_b8_default_graphs_$graphs.json 2>&1 \
    | grep -v "^ *$" | tail -2 | cut -c1-200
  echo "graphs $graphs rc=$? $(date +%T)"
done
timeout -s TERM 120 python3 benchmarks/bench_decode.py --contexts 65536 --steps 64 --config-seconds 20 \
  --max-seconds 110 --quantkey-selector quantkey --methods quantkey-auto --batches 12 \
  --out $OUT/bench_decode_64k_b12_auto.json 2>&1 | grep -v "^ *$" | tail -2 | cut -c1-200
echo "rc=$? $(date +%T)"
