#!/bin/bash
# On one H200: where a decode step's device time goes with the library's default selector
# (quantkey[bits=4,tail_bits=2,tail_near=3]: 4-bit keys, 2-bit values estimating the unselected blocks) at 64K
# tokens, batch 10 (8B shape, random bf16 weights, KV filled without a prefill, admission auto with every block on
# the device, whole-layer CUDA graphs): bench_decode_step.py's kernel trace (one layer's period between two scoring
# launches, by kernel), then bench_decode.py's throughput of the same configuration.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/default_trace_h200/run1.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
SEL='quantkey[bits=4,tail_bits=2,tail_near=3]'
date +%T
timeout -s TERM 200 python3 benchmarks/bench_decode_step.py --context 65536 --batch 10 --transfers kernel --graphs on \
  --lookahead off --selector "$SEL" --admission auto --device-memory-gib 87 --steps 3 --warmup 2 --profile 3 \
  --profile-trace quantkey_mma --out $OUT/decode_step_64k_b10_default.json > $OUT/trace_log.txt 2>&1; echo "trace rc=$?"
tail -2 $OUT/trace_log.txt | cut -c1-300; grep -A70 "kernels per period" $OUT/trace_log.txt | cut -c1-170
date +%T
timeout -s TERM 120 python3 benchmarks/bench_decode.py --contexts 65536 --steps 48 --config-seconds 15 --max-seconds 110 \
  --quantkey-selector "$SEL" --methods quantkey-auto --batches 10 --out $OUT/bench_decode_64k_b10_default.json 2>&1 | \
  grep -E "^quantkey-auto +[0-9]|rror" | cut -c1-200
echo "rc=$? $(date +%T)"
