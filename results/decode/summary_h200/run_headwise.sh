#!/bin/bash
# The headwise one-copy-per-block baseline again, after the benchmark's switch to the torch transfer path also
# switched off what the first update had derived from the kernel path (paged decode attention, CUDA graphs): 64K,
# batch 8 and 128K, batch 4, one process each.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/summary_h200/run_headwise.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for spec in "65536 8 64k" "131072 4 128k"; do
  set -- $spec
  timeout -s TERM 150 python3 benchmarks/bench_decode.py --contexts $1 --steps 64 \
    --config-seconds 12 --max-seconds 140 --methods headwise-copy --batches $2 \
    --out $OUT/headwise_$3.json > $OUT/headwise_$3.txt 2>&1; grep -c "op by op" $OUT/headwise_$3.txt; tail -2 $OUT/headwise_$3.txt | cut -c1-200
  echo "rc=$? $(date +%T)"
done
