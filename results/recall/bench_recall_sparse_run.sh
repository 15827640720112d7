#!/bin/bash
set -u
export HF_OFFLOAD_GIT_COMMIT=$(cat .gpu/COMMIT)
export PYTHONPATH=$PWD
timeout 120 python3 benchmarks/bench_recall_sparse.py --miss 0 0.03 0.1 0.3 --out $OUT/bench_recall_sparse.json > $OUT/l_sparse.txt 2>&1; echo "sparse rc=$?"
cat $OUT/l_sparse.txt | tail -40 | cut -c1-200
