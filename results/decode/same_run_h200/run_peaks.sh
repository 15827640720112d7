#!/bin/bash
# On one H200, after the planner's step transient (DynamicCache's concatenation of one layer, StaticCache's SDPA
# repeating one layer's keys and values to every query head) became part of the benchmark's predicted peak:
# DynamicCache, StaticCache and OffloadCache (plain quantkey, admission auto) at 64K / batch 12, StaticCache at
# 128K / batch 6, each in its own process.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/same_run_h200/run_peaks.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 300 python3 benchmarks/bench_decode.py --contexts 65536 --isolate --steps 64 --config-seconds 10 \
  --max-seconds 280 --quantkey-selector quantkey --methods dynamic static quantkey-auto --batches 12 \
  --out $OUT/bench_decode_64k_peaks.json 2>&1 | grep -v "^ *$" | grep -v "^wrote /tmp" | cut -c1-200
timeout -s TERM 120 python3 benchmarks/bench_decode.py --contexts 131072 --steps 64 --config-seconds 10 \
  --max-seconds 110 --methods static --batches 6 --out $OUT/bench_decode_128k_peaks.json 2>&1 | grep -v "^ *$" | cut -c1-200
echo "rc=$? $(date +%T)"
