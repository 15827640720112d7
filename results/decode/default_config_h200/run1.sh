#!/bin/bash
# On one H200: what OffloadCache(model, budget_tokens=2048) gives with its defaults, every sealed block in pinned
# host memory (admission "always"), the default selector (quantkey[bits=4,tail_bits=2,tail_near=3]), whole-layer
# CUDA graphs, the kernel transfer path: 8B shape, random bf16 weights, KV filled without a prefill, 64K tokens,
# batches 4, 8 and 12 (as far as host memory allows), with DynamicCache at batch 12 in the same run; then plain
# quantkey with every block in host memory at batches 8 and 12.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/default_config_h200/run1.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 200 python3 benchmarks/bench_decode.py --contexts 65536 --isolate --steps 32 --config-seconds 8 \
  --max-seconds 190 --quantkey-selector "quantkey[bits=4,tail_bits=2,tail_near=3]" --methods dynamic quantkey \
  --method-batches dynamic=12 quantkey=4,8,12 --out $OUT/bench_decode_64k_default.json 2>&1 \
  | grep -v "^ *$" | grep -v "^wrote /tmp" | cut -c1-200
timeout -s TERM 110 python3 benchmarks/bench_decode.py --contexts 65536 --steps 32 --config-seconds 8 \
  --max-seconds 100 --quantkey-selector quantkey --methods quantkey --batches 8 12 \
  --out $OUT/bench_decode_64k_plain_always.json 2>&1 | grep -v "^ *$" | cut -c1-200
echo "rc=$? $(date +%T)"
