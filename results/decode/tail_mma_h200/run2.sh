#!/bin/bash
# The default selector (tensor-core estimate) over batches at 64K and 128K, 8B shape, one process per context.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/tail_mma_h200/run2.sh
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
SEL='quantkey[bits=4,tail_bits=2,tail_near=3]'
for spec in "65536 8 10 12" "131072 4 5 6"; do
  set -- $spec; ctx=$1; shift
  timeout -s TERM 200 python3 benchmarks/bench_decode.py --contexts $ctx --steps 32 --config-seconds 10 --max-seconds 170 \
    --quantkey-selector "$SEL" --methods quantkey-auto --batches "$@" --out $OUT/bench_decode_${ctx}_default_batches.json \
    > /tmp/sweep_$ctx.txt 2>&1
  echo "$ctx rc=$? $(date +%T)"; grep -E "^quantkey-auto +[0-9]|skip|Error" /tmp/sweep_$ctx.txt | cut -c1-160
done
