#!/bin/bash
# The decode step of tail_near=3 (the default before), 8 and 16 (the default since), one call on one H100:
# 8B shape, random bf16 weights and random KV, 64K tokens, batches 1 and 4, admission "auto" (every block on the
# device, hit rate 1.0), budget 2048; tail_near=3 first (near3_first.json: the call's first run)
# and again last (near3.json).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
OUT=${OUT:-results/decode/tail_near_h100}
run() {
  timeout 56 python3 benchmarks/bench_decode.py --shape llama-8b --contexts 65536 --batches 1 4 --methods quantkey-auto \
    --quantkey-selector "$1" --steps 32 --config-seconds 5 --max-seconds 38 --out "$OUT/$2.json"
}
run "quantkey[bits=4,tail_bits=2,tail_near=3]" near3_first
run "quantkey[bits=4,tail_bits=2,tail_near=8]" near8
run "quantkey[bits=4,tail_bits=2,tail_near=16]" near16
run "quantkey[bits=4,tail_bits=2,tail_near=3]" near3
