#!/bin/bash
PYTHONPATH=$PWD timeout 230 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_cuda_lookahead.py tests/test_kernel_paged.py tests/test_kernel_slots.py > /tmp/pyt.txt 2>&1
echo "pytest rc=$?"; grep -E "^E  .*(Error|assert)|passed|failed|FAILED" /tmp/pyt.txt | head -12 | cut -c1-300; tail -2 /tmp/pyt.txt | cut -c1-200
