#!/bin/bash
# On one H200: one run of benchmarks/bench_decode.py at 64K tokens on the 8B shape (random bf16 weights, KV filled
# without a prefill), one process per method: transformers' DynamicCache at its two best batches of the earlier runs
# (10, 12), StaticCache (8) and DynamicCache(offloading=True) (1), OffloadCache (plain quantkey, admission auto) at
# 12; then OffloadCache alone at 128K, batch 6. (The CUDA tests of the changed kernels ran in run3.sh.)
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/step_trace_h200/run5.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 330 python3 benchmarks/bench_decode.py --contexts 65536 --isolate --steps 64 --config-seconds 25 \
  --max-seconds 310 --quantkey-selector quantkey --methods dynamic static quantkey-auto hf-offloaded \
  --method-batches dynamic=10,12 static=8 quantkey-auto=12 hf-offloaded=1 \
  --out $OUT/bench_decode_64k_same_run.json 2>&1 | grep -v "^ *$" | cut -c1-200 | tail -12
echo "rc=$? $(date +%T)"
timeout -s TERM 80 python3 benchmarks/bench_decode.py --contexts 131072 --steps 64 --config-seconds 25 \
  --max-seconds 70 --quantkey-selector quantkey --methods quantkey-auto --batches 6 \
  --out $OUT/bench_decode_128k_b6.json 2>&1 | grep -v "^ *$" | cut -c1-200 | tail -3
echo "rc=$? $(date +%T)"
