#!/bin/bash
# Plain quantkey (admission auto) over batches past the one whose KV all fits on the device: 64K at 12, 13, 14, 16
# and 128K at 6, 7, 8, 8B shape, random bf16 weights, KV filled without a prefill, one process per context.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/batch_sweep_h200/run1.sh
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
for spec in "65536 12 13 14 16" "131072 6 7 8"; do
  set -- $spec; ctx=$1; shift
  timeout -s TERM 270 python3 benchmarks/bench_decode.py --contexts $ctx --steps 48 --config-seconds 15 --max-seconds 250 \
    --quantkey-selector quantkey --methods quantkey-auto --batches "$@" --out $OUT/bench_decode_${ctx}_quantkey_batches.json \
    > $OUT/sweep_$ctx.txt 2>&1
  echo "$ctx rc=$? $(date +%T)"; grep -E "^quantkey-auto +[0-9]|skip|Error" $OUT/sweep_$ctx.txt | cut -c1-180
done
