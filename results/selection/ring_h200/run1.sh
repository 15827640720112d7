#!/bin/bash
# One device call: the tensor-core scoring kernel's CUDA tests (every compile-time setting, the ring of asynchronous
# copies included), then its micro-benchmark at 64K tokens, batch 12 (2 and 4 bits) and 32K, batch 8 (2 bits).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/selection/ring_h200/run1.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_kernel_quantkey_mma.py > $OUT/pytest_mma.txt 2>&1
echo "pytest rc=$?"; grep -E "^E |FAILED|passed|failed" $OUT/pytest_mma.txt | tail -8 | cut -c1-300
timeout 200 python3 benchmarks/bench_quantkey_kernel.py --batch 12 --blocks 4096 --bits 2 4 --warps 4 \
  --rows-per-thread 16 --out $OUT/bench_quantkey_kernel_64k_b12.json 2>&1 | grep -v "^v[12]" | cut -c1-160
echo "bench rc=${PIPESTATUS[0]}"
timeout 90 python3 benchmarks/bench_quantkey_kernel.py --batch 8 --blocks 2048 --bits 2 --warps 4 \
  --rows-per-thread 16 --out $OUT/bench_quantkey_kernel_32k_b8.json 2>&1 | grep -v "^v[12]" | cut -c1-160
date +%T
