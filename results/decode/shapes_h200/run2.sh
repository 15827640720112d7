#!/bin/bash
# On one H200: benchmarks/bench_decode.py on the Qwen2.5-7B shape, and the Llama-3.1-8B shape at 16K and 32K, (random bf16 weights, KV
# filled without a prefill) at 64K and 128K tokens: transformers' DynamicCache against OffloadCache (plain quantkey,
# admission auto), each at two batches per shape: about half and nearly all of what fits on the device with every
# block admitted (`hf-offload plan ... --admission auto`). One process per (context, method) (--isolate).
# (the contexts: $CONTEXTS, default 64K and 128K)
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/shapes_h200/run2.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
sweep() {  # shape, out name, --method-batches entries...
  local shape=$1 name=$2; shift 2
  timeout -s TERM 280 python3 benchmarks/bench_decode.py --shape $shape --contexts ${CONTEXTS:-65536 131072} --isolate --steps 48 \
    --config-seconds 6 --max-seconds 270 --quantkey-selector quantkey --methods dynamic quantkey-auto \
    --method-batches "$@" --out $OUT/$name.json > /tmp/$name.txt 2>&1
  echo "$name rc=$? $(date +%T)"; grep -E "^(dynamic|quantkey-auto) +[0-9]" /tmp/$name.txt | cut -c1-130
  grep -iE "error|skip" /tmp/$name.txt | head -5 | cut -c1-200
}
sweep qwen-7b bench_decode_qwen7b dynamic=16,32 quantkey-auto=15,30
CONTEXTS="16384 32768" sweep llama-8b bench_decode_llama8b_16k_32k dynamic=28,56 quantkey-auto=24,48
