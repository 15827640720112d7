#!/bin/bash
C=$(cat .gpu/COMMIT)
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 200 python3 benchmarks/bench_paged_kernel.py --batch 12 --repeats 30 --configs 8/8/16 4/8/32 8/4/17 8/8/17 4/4/33 4/8/33 16/8/9 16/4/9 8/8/17/1 8/8/17/2 8/8/17/3 4/4/33/1 4/4/33/2 16/8/9/2 8/4/9 8/4/9/2 --out $OUT/bench_paged_kernel_sweep_b12.json 2>&1 | tail -22
