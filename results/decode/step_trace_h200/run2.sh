#!/bin/bash
# On one H200: skinny products of the 8B shape at batch 12 (cuBLAS against a Triton split-K kernel), the block
# scores' row statistics by tile and warps (results/decode/step_trace_h200/gemm_probe.py), and the host profile of 32 decode steps at 64K,
# batch 12 (bench_decode.py --profile-seal: where the host time between two steps goes).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/step_trace_h200/run2.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 200 python3 results/decode/step_trace_h200/gemm_probe.py 2>&1 | grep -v "^ *$" | cut -c1-160
echo "probe rc=$? $(date +%T)"
timeout -s TERM 120 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 \
  --steps 32 --quantkey-selector quantkey --config-seconds 30 --max-seconds 100 --profile-seal 32 \
  --out $OUT/bench_decode_64k_b12.json > $OUT/bench_log.txt 2>&1; echo "bench rc=$? $(date +%T)"
tail -4 $OUT/bench_log.txt | cut -c1-250
ls $OUT
