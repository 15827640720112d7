#!/bin/bash
# One call on one H200: DynamicCache at 64K, batch 12, then plain quantkey (admission auto, layer graphs) at
# reselect_every 1, 2, 3, 4, one process each, 8 warm-up steps (both graphs of the reusing runs captured before the
# timed steps), 8B shape, random bf16 weights, KV filled without a prefill. (Run as one command line at 41d2be9,
# whose bench_decode.py warmed up 3 steps unless told; later commits warm up 3 + reselect_every by default.)
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/reselect_h200/run2.sh
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
date +%T
timeout 140 python3 benchmarks/bench_decode.py --contexts 65536 --steps 48 --warmup 3 --config-seconds 25 \
  --max-seconds 130 --methods dynamic --batches 12 --out $OUT/bench_decode_64k_b12_dynamic.json > /tmp/ld.txt 2>&1
echo "dyn rc=$? $(date +%T)"; grep -E "^dynamic +[0-9]|skip|Error" /tmp/ld.txt | cut -c1-160
for every in 1 2 3 4; do
  timeout 90 python3 benchmarks/bench_decode.py --contexts 65536 --steps 64 --warmup 8 --config-seconds 12 \
    --max-seconds 80 --quantkey-selector quantkey --methods quantkey-auto --batches 12 --reselect-every $every \
    --out $OUT/bench_decode_64k_b12_w8_r$every.json > /tmp/l$every.txt 2>&1
  echo "r=$every rc=$? $(date +%T)"; grep -E "^quantkey-auto +[0-9]|Error" /tmp/l$every.txt | cut -c1-160
done
