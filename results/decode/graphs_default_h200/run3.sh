#!/bin/bash
# On one H200, with CUDA graphs on by default: the CUDA-marked tests not run by run1.sh whose caches take the
# defaults (the estimate of the unselected blocks, the paged attention through the cache, the fused norms, rotary
# embedding and projections), and the rotary kernel's and the batched recall benchmark's.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/graphs_default_h200/run3.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 330 python3 -m pytest -rfEs -p no:cacheprovider --durations=5 -m cuda tests/test_tail.py \
  tests/test_kernel_paged.py tests/test_fused_norms.py tests/test_fused_rotary.py tests/test_fused_projections.py \
  tests/test_kernel_rotary.py tests/test_bench_recall_batch.py > $OUT/pytest_cuda_run3.txt 2>&1
echo "pytest rc=$? $(date +%T)"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_cuda_run3.txt | tail -12 | cut -c1-300
