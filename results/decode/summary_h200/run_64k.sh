#!/bin/bash
# On one H200, at one commit: benchmarks/bench_decode.py at 64K tokens on the 8B shape (random bf16 weights, KV
# filled without a prefill), one process per method: transformers' DynamicCache, StaticCache and
# DynamicCache(offloading=True), OffloadCache with plain quantkey and admission auto (at its best batch, 12, and at
# the headwise baseline's, 8) and the headwise one-copy-per-block baseline; the end-to-end run with a real chunked
# prefill (batch 1, 32K, DynamicCache against OffloadCache with the library's defaults); then OffloadCache with the
# default selector at its best batch (10), in its own process.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/summary_h200/run_64k.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 430 python3 benchmarks/bench_decode.py --contexts 65536 --isolate --steps 64 --config-seconds 20 \
  --max-seconds 410 --quantkey-selector quantkey --e2e \
  --methods dynamic static quantkey-auto headwise-copy hf-offloaded \
  --method-batches dynamic=8,10,12 static=8 quantkey-auto=8,12 headwise-copy=8 hf-offloaded=1 \
  --out $OUT/bench_decode_64k_same_run.json 2>&1 | grep -v "^ *$" | cut -c1-200 | tail -14
echo "rc=$? $(date +%T)"
timeout -s TERM 110 python3 benchmarks/bench_decode.py --contexts 65536 --steps 48 --config-seconds 15 \
  --max-seconds 95 --quantkey-selector "quantkey[bits=4,tail_bits=2,tail_near=3]" --methods quantkey-auto \
  --batches 10 --out $OUT/bench_decode_64k_default_b10.json 2>&1 | grep -v "^ *$" | cut -c1-200 | tail -3
echo "rc=$? $(date +%T)"
