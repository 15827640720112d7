#!/bin/bash
# On one H200, one run of benchmarks/bench_decode.py at 128K tokens on the 8B shape (random bf16 weights, KV filled
# without a prefill), one process per method: transformers' DynamicCache, StaticCache and DynamicCache(offloading=True),
# OffloadCache (plain quantkey, admission auto: the defaults of the fast path) and the headwise one-copy-per-block
# baseline, each at the batches where its best lies (earlier runs: results/decode/bench_decode.json and the
# seal_h200 study), OffloadCache also at the headwise baseline's batch.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/same_run_h200/run_128k.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 575 python3 benchmarks/bench_decode.py --contexts 131072 --isolate --steps 64 --config-seconds 20 \
  --max-seconds 540 --quantkey-selector quantkey \
  --methods dynamic static quantkey-auto headwise-copy hf-offloaded \
  --method-batches dynamic=1,2,4,6 static=2,4,6 quantkey-auto=4,6 headwise-copy=4 hf-offloaded=1 \
  --out $OUT/bench_decode_128k_same_run.json 2>&1 | grep -v "^ *$" | cut -c1-200
echo "rc=$? $(date +%T)"
