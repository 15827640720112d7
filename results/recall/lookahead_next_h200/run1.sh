#!/bin/bash
# Lookahead with the next layer's predicted query (lookahead_query="next", the default) on the GPU: its CUDA tests,
# then the decode step at 32K, batch 8, budget 2048, forced offloading, with and without lookahead, with the share of
# recall hidden behind compute (issue: recall engine, must-show 2), for the plain and the default selector.
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
date +%T
timeout 200 python3 -m pytest -m cuda -v -rfEs -p no:cacheprovider tests/test_cuda_lookahead.py tests/test_lookahead.py tests/test_lookahead_query.py > $OUT/pytest_lookahead.txt 2>&1
echo "pytest rc=$?"; grep -cE "PASSED" $OUT/pytest_lookahead.txt; grep -E "FAILED|ERROR|passed|failed" $OUT/pytest_lookahead.txt | tail -8 | cut -c1-300
date +%T
for sel in "quantkey" "quantkey[bits=4,tail_bits=2,tail_near=3]"; do
  tag=$( [ "$sel" = quantkey ] && echo quantkey || echo default )
  timeout 170 python3 benchmarks/bench_decode_step.py --context 32768 --batch 8 --budget 2048 --selector "$sel" \
    --admission always --lookahead both --graphs off --transfers kernel --hidden-share --steps 24 \
    --out $OUT/decode_step_32k_b8_${tag}.json 2>&1 | tail -14
  echo "bench rc=$?"; date +%T
done
