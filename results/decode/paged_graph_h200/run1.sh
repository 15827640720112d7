#!/bin/bash
# One device call: the paged decode attention kernel's launch settings timed inside CUDA graphs of 10 calls (8B
# shape, 64K tokens, batch 12, budget 2048, every block admitted, as at admission "auto" there).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/paged_graph_h200/run1.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 280 python3 benchmarks/bench_paged_kernel.py --batch 12 --admitted 1.0 --graph-calls 10 --repeats 30 \
  --configs 8/4/0 8/4/0/1 8/4/0/2 8/4/0/3 8/4/0/4 8/8/0 8/2/0 8/4/5 8/4/17 4/4/0 4/4/0/1 4/4/0/3 4/2/0 4/2/0/3 \
  4/4/9 4/4/33 2/2/0 2/4/0 2/1/0 16/4/0 16/8/0 16/8/0/3 8/4/0 \
  --out $OUT/bench_paged_kernel_graphs_b12.json 2>&1 | cut -c1-160
date +%T
