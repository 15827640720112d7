#!/bin/bash
# On one H200, after run2.sh: OffloadCache (plain quantkey, admission auto) where run2 ran out of device memory or
# admitted only part of the blocks. Qwen2.5-7B shape at 128K, batch 15 with PyTorch's expandable segments
# (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; run2's batch 15 ran out of memory with 7.6 GiB reserved but
# unallocated) and batch 12 without; at 64K, batch 24 (every block admitted; run2's batch 30 kept 5.7 GiB on the
# host). Llama-3.1-8B shape at 16K, batch 40 (run2's 48 kept 7 GiB on the host).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/shapes_h200/run3.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
sweep() {  # shape, context, out name, --method-batches entries...
  local shape=$1 context=$2 name=$3; shift 3
  timeout -s TERM 150 python3 benchmarks/bench_decode.py --shape $shape --contexts $context --isolate --steps 48 \
    --config-seconds 6 --max-seconds 140 --quantkey-selector quantkey --methods quantkey-auto \
    --method-batches "$@" --out /tmp/r3_$name.json > /tmp/r3_$name.txt 2>&1
  echo "$name rc=$? $(date +%T)"; grep -E "^(dynamic|quantkey-auto) +[0-9]" /tmp/r3_$name.txt | cut -c1-130
  grep -iE "error|skip" /tmp/r3_$name.txt | head -3 | cut -c1-300
}
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True sweep qwen-7b 131072 qwen7b_128k_b15_expandable quantkey-auto=15
sweep qwen-7b 131072 qwen7b_128k_b12 quantkey-auto=12
sweep qwen-7b 65536 qwen7b_64k_b24 quantkey-auto=24
sweep llama-8b 16384 llama8b_16k_b40 quantkey-auto=40
python3 results/decode/shapes_h200/merge.py $OUT --suffix _run3 /tmp/r3_*.json
ls $OUT
