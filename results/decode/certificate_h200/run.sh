#!/bin/bash
# The accuracy certificate's decode cost, one call on one H200: bench_decode at 2a3d075 (the commit before the
# certificate, run from a copy in .old/) and at the commit in after.json's metadata; 8B shape, random bf16 weights
# and random KV, 32K tokens, batch 1, the default selector, admission "auto" (hit rate 1.0), budget 2048.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
ab() {  # $1: tree, $2: tag
  (cd "$1" && PYTHONPATH=$PWD timeout 60 python3 benchmarks/bench_decode.py --shape llama-8b --contexts 32768 --batches 1 \
    --methods quantkey-auto --quantkey-selector "quantkey[bits=4,tail_bits=2,tail_near=3]" --steps 32 --config-seconds 6 \
    --max-seconds 50 --out "$OUT/$2.json")
}
ab .old before
ab . after
