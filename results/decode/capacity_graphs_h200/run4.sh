#!/bin/bash
# One GPU: 64K b12 plain quantkey, capacity 1 vs 64 again (b, order swapped), then 128K b10 plain quantkey capacity 64.
set -u
export TOKENIZERS_PARALLELISM=false
C=$(cat .gpu/COMMIT)
one() {  # tag selector context batch extra-args
  PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 150 python3 benchmarks/bench_decode.py \
    --contexts $3 --methods quantkey-auto --batches $4 --steps 64 --quantkey-selector "$2" $5 --config-seconds 60 \
    --max-seconds 140 --out $OUT/bench_decode_$1.json > /tmp/log_$1.txt 2>&1; echo "$1 rc=$?"; tail -3 /tmp/log_$1.txt | cut -c1-300
}
one 64k_b12_quantkey_cap1_b quantkey 65536 12 "--decode-capacity 1"
one 64k_b12_quantkey_cap64_b quantkey 65536 12 ""
one 128k_b10_quantkey_cap64 quantkey 131072 10 ""
for f in $OUT/bench_decode_*.json; do python3 -c "
import json; r=json.load(open('$f'))['runs'][0]; s=r['stats']; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],1), 'median', round(r['step_ms_median'],1), 'capture ms', s.get('graph_capture_ms'), s.get('graph_captures')); print([round(x) for x in r['step_ms_each']])"; done
