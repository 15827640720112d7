#!/bin/bash
# On one H200, with cuda_graphs=None as the default and decode_capacity_blocks=None meaning 64 blocks with graphs or
# without (every built-in selector): the CUDA tests of the default configuration (tests/test_cuda.py, the recall
# engine's tests with the 500 decode steps of a Llama-3.2-1B shape through the default asynchronous path, now replayed
# from graphs, against the synchronous one), the graphs' and the seal kernel's tests, and the capacity tests.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/graphs_default_h200/run1.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 480 python3 -m pytest -rfEs -p no:cacheprovider --durations=8 tests/test_cuda.py tests/test_cuda_lookahead.py \
  tests/test_decode_capacity.py tests/test_layer_graphs.py tests/test_cuda_graphs.py tests/test_kernel_seal.py tests/test_kernel_topk.py \
  > $OUT/pytest_cuda_run1.txt 2>&1; echo "pytest rc=$? $(date +%T)"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_cuda_run1.txt | tail -12 | cut -c1-300
# The top-k kernel's two threshold searches (radix select, bisection) and torch.topk at the decode step's shapes.
timeout 60 python3 benchmarks/bench_topk_kernel.py --out $OUT/bench_topk_kernel_h200.json 2>&1 | tail -6
