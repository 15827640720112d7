#!/bin/bash
# On one H200, after cuda_graphs became None by default: the CUDA tests of the default configuration
# (tests/test_cuda.py, and the 500 decode steps of a Llama-3.2-1B shape through the default asynchronous path against
# the synchronous one), then what OffloadCache(model, budget_tokens=2048) gives with its defaults: every sealed block
# in pinned host memory (admission "always"), the default selector, whole-layer CUDA graphs, the kernel transfer path
# (8B shape, random bf16 weights, KV filled without a prefill, 64K tokens, batches 8 and 12 as far as host memory
# allows).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/default_config_h200/run1.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 170 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_cuda.py \
  "tests/test_cuda_lookahead.py::test_async_default_path_matches_synchronous_over_500_steps_of_a_real_shape" \
  > $OUT/pytest_cuda_default.txt 2>&1; echo "pytest rc=$? $(date +%T)"; tail -4 $OUT/pytest_cuda_default.txt | cut -c1-300
timeout -s TERM 150 python3 benchmarks/bench_decode.py --contexts 65536 --steps 32 --config-seconds 8 \
  --max-seconds 140 --methods quantkey --quantkey-selector "quantkey[bits=4,tail_bits=2,tail_near=3]" --batches 8 12 --out $OUT/bench_decode_64k_default.json 2>&1 \
  | grep -v "^ *$" | cut -c1-200
echo "rc=$? $(date +%T)"
