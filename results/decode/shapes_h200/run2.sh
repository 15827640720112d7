#!/bin/bash
# On one H200: benchmarks/bench_decode.py on the Qwen2.5-7B shape (and the Llama-3.1-8B shape at 16K and 32K) (random bf16 weights, KV
# filled without a prefill) at 64K and 128K tokens: transformers' DynamicCache against OffloadCache (plain quantkey,
# admission auto), each at two batches per shape: about half and nearly all of what fits on the device with every
# block admitted (`hf-offload plan ... --admission auto`). One process per (context, method) (--isolate).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/shapes_h200/run2.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
sweep() {  # shape, context, out name, --method-batches entries...
  local shape=$1 context=$2 name=$3; shift 3
  timeout -s TERM 150 python3 benchmarks/bench_decode.py --shape $shape --contexts $context --isolate --steps 48 \
    --config-seconds 6 --max-seconds 140 --quantkey-selector quantkey --methods dynamic quantkey-auto \
    --method-batches "$@" --out /tmp/$name.json > /tmp/$name.txt 2>&1
  echo "$name rc=$? $(date +%T)"; grep -E "^(dynamic|quantkey-auto) +[0-9]" /tmp/$name.txt | cut -c1-130
  grep -iE "error|skip" /tmp/$name.txt | head -3 | cut -c1-200
}
sweep qwen-7b 65536 bench_decode_qwen7b_64k dynamic=16,32 quantkey-auto=15,30
sweep qwen-7b 131072 bench_decode_qwen7b_128k dynamic=16 quantkey-auto=15
sweep llama-8b 32768 bench_decode_llama8b_32k dynamic=28 quantkey-auto=24
sweep llama-8b 16384 bench_decode_llama8b_16k dynamic=56 quantkey-auto=48
# One file per shape back (a call returns a handful of files): the sweeps' runs merged.
python3 results/decode/shapes_h200/merge.py $OUT /tmp/bench_decode_*.json
ls $OUT
