#!/bin/bash
# The H200 runs of this folder (579e5ee), each in its own call: the soak (started in the background, collected by a
# later call), then the 8B shape at 128K under 40 and 24 GiB, then the 0.5B shape at 32K under 16 GiB.
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
OUT=${OUT:-results/memory_cap}
python3 benchmarks/bench_memory_cap.py --batches --soak 2000 --soak-shapes qwen2.5-coder-0.5b llama-3.2-1b \
  --soak-layers 2 --soak-lengths 3000 2000 --soak-seconds 1400 --out "$OUT/soak_2000_h200.json" && gzip -9 -n "$OUT/soak_2000_h200.json"
python3 benchmarks/bench_memory_cap.py --shape llama-3.1-8b --context 131072 --batches 4 8 --cap-gib 40 \
  --caches defaults --new-tokens 32 --prefill-chunk 8192 --max-seconds 150 --out "$OUT/smallgpu_8b_128k_cap40_h200.json"
python3 benchmarks/bench_memory_cap.py --shape llama-3.1-8b --context 131072 --batches 1 --cap-gib 24 \
  --caches defaults offloaded --new-tokens 32 --prefill-chunk 8192 --max-seconds 200 --out "$OUT/smallgpu_8b_128k_cap24_h200.json"
python3 benchmarks/bench_memory_cap.py --shape qwen2.5-coder-0.5b --context 32768 --batches 16 48 96 --cap-gib 16 \
  --caches defaults --new-tokens 16 --prefill-chunk 4096 --prefill-batch-tokens 65536 --max-seconds 130 \
  --out "$OUT/smallgpu_05b_32k_cap16_h200.json"

# The H100 runs (code of 0b178e9; the files' metadata names commit b189d64, and --out names ending in
# _h200, the name the calls were planned under: the GPU field says H100). One call each group.
python3 benchmarks/bench_memory_cap.py --shape llama-3.1-8b --context 32768 --batches 1 --cap-gib 139 \
  --caches defaults --calls 3 --new-tokens 32 --prefill-chunk 8192 --max-seconds 130 --out "$OUT/first_step_8b_32k_h100.json"
python3 benchmarks/bench_memory_cap.py --shape qwen2.5-coder-0.5b --context 32768 --batches 16 48 96 --cap-gib 16 \
  --caches defaults --new-tokens 48 --prefill-chunk 4096 --prefill-batch-tokens 65536 --max-seconds 180 \
  --out "$OUT/smallgpu_05b_32k_cap16_h100.json"
python3 benchmarks/bench_memory_cap.py --shape llama-3.1-8b --context 131072 --batches 1 --cap-gib 24 \
  --caches defaults offloaded --new-tokens 64 --prefill-chunk 8192 --max-seconds 180 --out "$OUT/smallgpu_8b_128k_cap24_h100.json"
# (batch 8 was still in prefill when the call's 250 s limit ended it: the file holds batch 4)
python3 benchmarks/bench_memory_cap.py --shape llama-3.1-8b --context 131072 --batches 4 8 --cap-gib 40 \
  --caches defaults --new-tokens 64 --prefill-chunk 8192 --prefill-batch-tokens 32768 --max-seconds 230 \
  --out "$OUT/smallgpu_8b_128k_cap40_h100.json"
python3 benchmarks/bench_memory_cap.py --shape llama-3.1-8b --context 131072 --batches 1 --cap-gib 139 \
  --caches defaults --new-tokens 64 --prefill-chunk 8192 --max-seconds 100 --out "$OUT/smallgpu_8b_128k_cap139_h100.json"

# Parking: three generate() calls per configuration, each with a fresh cache, one process. 32,768 tokens (512 blocks:
# the summaries grow before the first capture), one H100, code of 2c7f4ec, a fresh machine (nothing compiled):
python3 benchmarks/bench_memory_cap.py --shape llama-3.1-8b --context 32768 --batches 1 --cap-gib 70 \
  --caches defaults --calls 3 --new-tokens 32 --prefill-chunk 8192 --max-seconds 120 --out "$OUT/first_step_8b_32768_parked_h100.json"
# 32,000 tokens with the defaults and with admission "always" (every block on the host), one H100, code of 42e95fd
# (its metadata names commit 18890f4):
python3 benchmarks/bench_memory_cap.py --shape llama-3.1-8b --context 32000 --batches 1 --cap-gib 139 \
  --caches defaults always --calls 3 --new-tokens 32 --prefill-chunk 8192 --max-seconds 120 \
  --out "$OUT/first_step_8b_32000_parked_h100.json"
# After hf_offload.warm_up, the first process on a fresh machine (one H100, 163d8a7):
python3 benchmarks/bench_memory_cap.py --shape llama-3.1-8b --context 32768 --batches 1 --cap-gib 70 \
  --caches defaults --calls 2 --new-tokens 32 --prefill-chunk 8192 --max-seconds 150 --warmup-context 4096 \
  --out "$OUT/first_step_8b_32768_warmup_h100.json"
# A real model end to end, DynamicCache against the defaults (one H100, 163d8a7; the model converted beforehand):
HF_HUB_OFFLINE=1 python3 benchmarks/bench_memory_cap.py --model qwen15 --context 32768 --batches 1 8 32 --cap-gib 70 \
  --caches dynamic defaults --new-tokens 48 --warmup-context 4096 --max-seconds 300 --out "$OUT/e2e_qwen15_32k_h100.json"
