#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD
timeout 260 python3 -m pytest -m cuda -rfEs -p no:cacheprovider tests > $OUT/pytest_cuda.txt 2>&1
echo "pytest cuda rc=$?"; grep -E "^E |Error|passed|failed" $OUT/pytest_cuda.txt | head -12 | cut -c1-300
timeout 60 python3 -m pytest -rfEs -p no:cacheprovider tests/test_kernel_quantkey_mma.py > $OUT/pytest_mma.txt 2>&1
echo "pytest mma rc=$?"; tail -1 $OUT/pytest_mma.txt
