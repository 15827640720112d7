#!/bin/bash
# The decode step of the default selector (tail_near=3) against tail_near=8, one call on one H100 (80 GB): 8B shape,
# random bf16 weights and random KV, 64K tokens, admission "auto" (every block on the device, hit rate 1.0), budget
# 2048. Batch 8 was skipped (predicted 63.9 GiB against 63.4 free) and the default's row has 7 steps (its time budget
# ran out): one run each, no repeat of the default. Both files record git_commit 79be8c8 (the device copy's); the code
# was that of e35353c.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
i=0
for sel in "quantkey[bits=4,tail_bits=2,tail_near=3]" "quantkey[bits=4,tail_bits=2,tail_near=8]"; do
  i=$((i+1)); tag=near3; [ $i = 2 ] && tag=near8
  timeout 50 python3 benchmarks/bench_decode.py --shape llama-8b --contexts 65536 --batches 1 8 --methods quantkey-auto \
    --quantkey-selector "$sel" --steps 32 --config-seconds 5 --max-seconds 38 --out "$OUT/$tag.json"
done
