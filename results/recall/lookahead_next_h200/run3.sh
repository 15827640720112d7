#!/bin/bash
# The decode step at 32K, batch 8, budget 2048, every block offloaded, with and without lookahead (op by op) and with
# whole-layer CUDA graphs (no lookahead), each setting's moved / resident runs alternating over 3 rounds; then the CUDA
# tests of the fused norms and of full-budget exactness against DynamicCache (fused norms on by default).
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
for sel in "quantkey" "quantkey[bits=4,tail_bits=2,tail_near=3]"; do
  tag=$( [ "$sel" = quantkey ] && echo quantkey || echo default )
  timeout 150 python3 benchmarks/bench_decode_step.py --context 32768 --batch 8 --budget 2048 --selector "$sel" \
    --admission always --lookahead both --graphs both --transfers kernel --hidden-share --steps 16 --rounds 3 \
    --out $OUT/decode_step_32k_b8_${tag}_rounds.json 2>&1 | tail -12 | cut -c1-400
  echo "bench rc=$?"; date +%T
done
timeout 150 python3 -m pytest -m cuda -rfEs -p no:cacheprovider tests/test_fused_norms.py tests/test_cuda.py > $OUT/pytest_cuda_norms.txt 2>&1
echo "pytest rc=$?"; grep -E "^E |FAILED|ERROR|passed|failed" $OUT/pytest_cuda_norms.txt | tail -12 | cut -c1-300
date +%T
