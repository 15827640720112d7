#!/bin/bash
# On one H200: the CUDA tests of the code this study changed (scoring kernel with paired blocks, CUDA top-k, block
# scores in two launches) and what runs them in decode steps (graphs, lookahead's 500-step async-against-sync check);
# the top-k kernels timed alone; then one run of benchmarks/bench_decode.py at 64K tokens on the 8B shape (random
# bf16 weights, KV filled without a prefill), one process per method: transformers' DynamicCache at its two best
# batches of the earlier runs (10, 12), StaticCache (8) and DynamicCache(offloading=True) (1), OffloadCache (plain
# quantkey, admission auto) at 12; then OffloadCache alone at 128K, batch 6.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/pair_topk_h200/run1.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 230 python3 -m pytest -m cuda -p no:cacheprovider tests/test_kernel_mass.py tests/test_kernel_topk.py \
  tests/test_cuda_lookahead.py tests/test_cuda.py tests/test_decode_capacity.py tests/test_layer_graphs.py \
  tests/test_cuda_graphs.py tests/test_selector_quantkey.py > $OUT/pytest_cuda_run1.txt 2>&1
echo "pytest rc=$? $(date +%T)"; grep -E "passed|failed|error" $OUT/pytest_cuda_run1.txt | tail -3
python3 benchmarks/bench_topk_kernel.py --out $OUT/bench_topk_kernel.json 2>&1 | grep -E "4096|wrote" | head -12
timeout -s TERM 300 python3 benchmarks/bench_decode.py --contexts 65536 --isolate --steps 64 --config-seconds 20 \
  --max-seconds 280 --quantkey-selector quantkey --methods dynamic static quantkey-auto hf-offloaded \
  --method-batches dynamic=10,12 static=8 quantkey-auto=12 hf-offloaded=1 \
  --out $OUT/bench_decode_64k_same_run.json 2>&1 | grep -v "^ *$" | cut -c1-200 | tail -12
echo "rc=$? $(date +%T)"
timeout -s TERM 70 python3 benchmarks/bench_decode.py --contexts 131072 --steps 64 --config-seconds 20 \
  --max-seconds 60 --quantkey-selector quantkey --methods quantkey-auto --batches 6 \
  --out $OUT/bench_decode_128k_b6.json 2>&1 | grep -v "^ *$" | cut -c1-200 | tail -3
echo "rc=$? $(date +%T)"
