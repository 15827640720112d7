#!/bin/bash
# On one H200, at one commit: benchmarks/bench_decode.py at 128K tokens on the 8B shape (random bf16 weights, KV
# filled without a prefill), one process per method: transformers' DynamicCache, StaticCache and
# DynamicCache(offloading=True), OffloadCache with plain quantkey and admission auto (at its best batch, 6, and at
# the headwise baseline's, 4) and the headwise one-copy-per-block baseline; then OffloadCache with the
# default selector at its best batch (5), in its own process.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/summary_h200/run_128k.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 430 python3 benchmarks/bench_decode.py --contexts 131072 --isolate --steps 64 --config-seconds 20 \
  --max-seconds 410 --quantkey-selector quantkey \
  --methods dynamic static quantkey-auto headwise-copy hf-offloaded \
  --method-batches dynamic=4,6 static=4 quantkey-auto=4,6 headwise-copy=4 hf-offloaded=1 \
  --out $OUT/bench_decode_128k_same_run.json 2>&1 | grep -v "^ *$" | cut -c1-200 | tail -14
echo "rc=$? $(date +%T)"
timeout -s TERM 110 python3 benchmarks/bench_decode.py --contexts 131072 --steps 48 --config-seconds 15 \
  --max-seconds 95 --quantkey-selector "quantkey[bits=4,tail_bits=2,tail_near=3]" --methods quantkey-auto \
  --batches 5 --out $OUT/bench_decode_128k_default_b5.json 2>&1 | grep -v "^ *$" | cut -c1-200 | tail -3
echo "rc=$? $(date +%T)"
