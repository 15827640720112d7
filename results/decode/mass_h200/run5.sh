#!/bin/bash
# The CUDA tests that run4.sh's time limit cut off: tests/test_layer_graphs.py and the cuda tests of tests/test_tail.py.
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 280 python3 -m pytest -m cuda -v -rfEs -p no:cacheprovider tests/test_layer_graphs.py tests/test_tail.py > $OUT/pytest_cuda_run5.txt 2>&1
echo "pytest rc=$?"; grep -cE "PASSED" $OUT/pytest_cuda_run5.txt; grep -E "FAILED|ERROR|passed|failed" $OUT/pytest_cuda_run5.txt | tail -8 | cut -c1-300
