#!/bin/bash
# On one H200: the CUDA tests of the seal kernel, the whole-layer graphs and the attention graphs (no -m: the
# unmarked kernel tests run on CUDA too) at the review commit that followed run3.sh (one helper for the offload-stream
# write, one for a seal's summaries, the seal buffer made in one place, the captures through one pool helper), then
# 64K tokens / batch 13 (plain quantkey, admission auto, whole-layer graphs, captured seals) once.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/seal_h200/run4.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 360 python3 -m pytest -q -rfEs -p no:cacheprovider --durations=5 tests/test_kernel_seal.py \
  tests/test_layer_graphs.py tests/test_cuda_graphs.py > $OUT/pytest_cuda_run5.txt 2>&1; echo "pytest rc=$? $(date +%T)"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_cuda_run5.txt | tail -8 | cut -c1-300
timeout -s TERM 100 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 13 \
  --steps 64 --quantkey-selector quantkey --config-seconds 30 --max-seconds 90 \
  --out $OUT/bench_decode_64k_b13_on_run4.json > /tmp/l_b13.txt 2>&1; echo "b13 rc=$? $(date +%T)"; tail -4 /tmp/l_b13.txt | cut -c1-300
date +%T
