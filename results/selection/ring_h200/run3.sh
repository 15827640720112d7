#!/bin/bash
# One device call: the scoring kernel's compile-time settings (ring, two accumulators, capped registers) against
# the emulated scheme, then the micro-benchmark at 64K tokens, batch 12 (2 and 4 bits).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/selection/ring_h200/run3.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_kernel_quantkey_mma.py > $OUT/pytest_mma3.txt 2>&1
echo "pytest rc=$?"; grep -E "^E |FAILED|passed|failed" $OUT/pytest_mma3.txt | tail -8 | cut -c1-300
timeout 200 python3 benchmarks/bench_quantkey_kernel.py --batch 12 --blocks 4096 --bits 2 4 --warps 4 \
  --rows-per-thread 16 --out $OUT/bench_quantkey_kernel_64k_b12_run3.json 2>&1 | grep -v "^v[12]" | cut -c1-160
