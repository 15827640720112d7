#!/bin/bash
# On one H200: where one decode step's device time goes at 64K tokens, batch 12 (8B shape, random bf16 weights, KV
# filled without a prefill, plain quantkey, admission auto, whole-layer CUDA graphs): bench_decode_step.py's
# kernel trace (one layer's period between two scoring launches, by kernel).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/step_trace_h200/run1.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T; nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
timeout -s TERM 150 python3 benchmarks/bench_decode_step.py --context 65536 --batch 12 --transfers kernel --graphs on \
  --lookahead off --selector quantkey --admission auto --device-memory-gib 114 --steps 3 --warmup 2 --profile 3 \
  --profile-trace quantkey_mma --out $OUT/decode_step_64k_b12_graphs.json > $OUT/trace_log.txt 2>&1; echo "trace rc=$?"
tail -2 $OUT/trace_log.txt | cut -c1-300; grep -A70 "kernels per period" $OUT/trace_log.txt | cut -c1-170
date +%T
