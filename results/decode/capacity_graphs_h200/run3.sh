#!/bin/bash
# One GPU: every cuda test (capacity-keyed graphs), then 64K b12 plain quantkey and the default, capacity 64 (default) vs 1, alternating.
set -u
export TOKENIZERS_PARALLELISM=false
C=$(cat .gpu/COMMIT)
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 330 python3 -m pytest -m cuda -q -rfEs -p no:cacheprovider tests > /tmp/pyt.txt 2>&1
echo "pytest rc=$?"; grep -v "Warning\|warn\|^  \|^$" /tmp/pyt.txt | tail -25 | cut -c1-400
one() {  # tag selector capacity-args
  PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 110 python3 benchmarks/bench_decode.py \
    --contexts 65536 --methods quantkey-auto --batches 12 --steps 64 --quantkey-selector "$2" $3 --config-seconds 40 \
    --max-seconds 100 --out $OUT/bench_decode_64k_b12_$1.json > /tmp/log_$1.txt 2>&1; echo "$1 rc=$?"; tail -3 /tmp/log_$1.txt | cut -c1-300
}
D="quantkey[bits=4,tail_bits=2,tail_near=3]"
one quantkey_cap64_a quantkey ""
one quantkey_cap1_a quantkey "--decode-capacity 1"
one default_cap64_a "$D" ""
one default_cap1_a "$D" "--decode-capacity 1"
for f in $OUT/bench_decode_64k_b12_*.json; do python3 -c "
import json; r=json.load(open('$f'))['runs'][0]; s=r['stats']; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],1), 'median', round(r['step_ms_median'],1), 'capture ms', s.get('graph_capture_ms'), s.get('graph_captures')); print([round(x) for x in r['step_ms_each']])"; done
