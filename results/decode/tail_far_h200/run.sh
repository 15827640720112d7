#!/bin/bash
# The decode step of tail_far="mid" against the default tail_far="near", one call on one H200: 8B shape, random bf16
# weights and random KV, 64K tokens, batch 1 and 8, admission "auto" (every block on the device, hit rate 1.0),
# budget 2048; near, mid, near again.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
for tag in near mid near2; do
  far=${tag%2}
  sel="quantkey[bits=4,tail_bits=2,tail_near=3]"; [ $far = mid ] && sel="quantkey[bits=4,tail_bits=2,tail_near=3,tail_far=mid]"
  timeout 100 python3 benchmarks/bench_decode.py --shape llama-8b --contexts 65536 --batches 1 8 --methods quantkey-auto \
    --quantkey-selector "$sel" --steps 32 --config-seconds 8 --max-seconds 85 --out "$OUT/$tag.json"
done
# split_mid.json, split_near.json: the same once the far blocks were split over programs (36e0667), mid then near,
# --config-seconds 5 --max-seconds 38. Every H200 file of that session records git_commit 9be6a76 (the commit checked
# out, not the code that ran): near/mid/near2 ran the code of 42c4888, split_* that of 36e0667.
