#!/bin/bash
# The decode step of the default selector (tail_near=3) against tail_near=8 and the full estimate, one call on one
# H200: 8B shape, random bf16 weights and random KV, 64K tokens, batches 1 and 8, admission "auto" (every block on the
# device, hit rate 1.0), budget 2048; the default first (near3_first.json: its batch-1 row has 6 steps, compilation
# took its time budget) and again last (near3.json). Every file records git_commit 579e5ee.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
OUT=${OUT:-results/decode/tail_near_h200}
run() {
  timeout 60 python3 benchmarks/bench_decode.py --shape llama-8b --contexts 65536 --batches 1 8 --methods quantkey-auto \
    --quantkey-selector "$1" --steps 32 --config-seconds 5 --max-seconds 38 --out "$OUT/$2.json"
}
run "quantkey[bits=4,tail_bits=2,tail_near=3]" near3_first
run "quantkey[bits=4,tail_bits=2,tail_near=8]" near8
run "quantkey[bits=4,tail_bits=2]" full
run "quantkey[bits=4,tail_bits=2,tail_near=3]" near3
