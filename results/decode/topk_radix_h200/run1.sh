#!/bin/bash
# On one H200, with the top-k kernel's radix select as its default threshold search: the two searches and torch.topk
# at the decode step's shapes, then 64K tokens at batch 12 (8B shape, random bf16 weights, KV filled without a
# prefill): DynamicCache and OffloadCache (plain quantkey, admission auto, graphs), one process each.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/topk_radix_h200/run1.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 90 python3 benchmarks/bench_topk_kernel.py --out $OUT/bench_topk_kernel_h200.json 2>&1 | tail -7
timeout -s TERM 420 python3 benchmarks/bench_decode.py --contexts 65536 --isolate --steps 64 --config-seconds 20 \
  --max-seconds 400 --quantkey-selector quantkey --methods dynamic quantkey-auto \
  --method-batches dynamic=12 quantkey-auto=12 \
  --out $OUT/bench_decode_64k_b12_radix.json 2>&1 | grep -v "^ *$" | cut -c1-200
echo "rc=$? $(date +%T)"
