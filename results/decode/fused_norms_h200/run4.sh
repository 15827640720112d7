#!/bin/bash
# The CUDA tests not yet run with fused norms on by default: lookahead, the estimate, the paged attention, the
# tensor-core scoring, the recall batch.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash run4.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 270 python3 -m pytest -m cuda -rfEs -p no:cacheprovider tests/test_cuda_lookahead.py tests/test_tail.py \
  tests/test_kernel_paged.py tests/test_kernel_quantkey_mma.py tests/test_bench_recall_batch.py > $OUT/pytest_cuda_rest.txt 2>&1
echo "pytest rc=$?"; grep -E "^E |FAILED|ERROR|passed|failed" $OUT/pytest_cuda_rest.txt | tail -12 | cut -c1-300
date +%T
