#!/bin/bash
# On one H200, with CUDA graphs on by default: every test of the kernel files that run on CUDA where it is present
# (not only the CUDA-marked ones): paged attention through the cache, block scores, slots, norms, the estimate's
# kernel, the copy kernels.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/graphs_default_h200/run4.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 240 python3 -m pytest -rfEs -p no:cacheprovider --durations=5 tests/test_kernel_paged.py \
  tests/test_kernel_mass.py tests/test_kernel_slots.py tests/test_kernel_norm.py tests/test_kernel_tail.py \
  tests/test_kernels.py > $OUT/pytest_cuda_run4.txt 2>&1
echo "pytest rc=$? $(date +%T)"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_cuda_run4.txt | tail -12 | cut -c1-300
