#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
export HF_OFFLOAD_GIT_COMMIT=$(cat .gpu/COMMIT)
export PYTHONPATH=$PWD
python3 benchmarks/bench_quantkey_kernel.py --batch 12 --blocks 4096 --bits 2 --warps 4 --rows-per-thread 16 --out $OUT/bench_quantkey_kernel_settings_64k_b12_h200.json 2>&1 | tail -13
timeout 250 python3 -m pytest -m cuda -rfEs -p no:cacheprovider tests > $OUT/pytest_cuda.txt 2>&1
echo "pytest cuda rc=$?"; grep -E "^E |Error|passed|failed" $OUT/pytest_cuda.txt | head -12 | cut -c1-300; tail -1 $OUT/pytest_cuda.txt
