#!/bin/bash
# One GPU, nothing else running: every cuda test, then 64K b12 quantkey-auto alternating warm captures / before (16137a6).
set -u
export TOKENIZERS_PARALLELISM=false
C=$(cat .gpu/COMMIT)
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 330 python3 -m pytest -m cuda -q -rfEs tests > $OUT/pytest_cuda_h200.txt 2>&1
echo "pytest rc=$?" | tee -a $OUT/pytest_cuda_h200.txt; tail -4 $OUT/pytest_cuda_h200.txt | cut -c1-200
one() {  # tag dir commit selector
  (cd $2 && PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$3 timeout 100 python3 benchmarks/bench_decode.py \
    --contexts 65536 --methods quantkey-auto --batches 12 --steps 48 --quantkey-selector "$4" --config-seconds 30 \
    --max-seconds 90 --out $OUT/bench_decode_64k_b12_$1.json > $OUT/log_$1.txt 2>&1; echo "$1 rc=$?")
}
one quantkey_warm_a . $C quantkey
one quantkey_before_a .gpu/old 16137a6+step-lists quantkey
one quantkey_warm_b . $C quantkey
one quantkey_before_b .gpu/old 16137a6+step-lists quantkey
for f in $OUT/bench_decode_64k_b12_*.json; do python3 -c "
import json; r=json.load(open('$f'))['runs'][0]; s=r['stats']; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],1), 'median', round(r['step_ms_median'],1), 'capture ms', s['graph_capture_ms'], s['graph_captures']); print([round(x) for x in r['step_ms_each']])"; done
