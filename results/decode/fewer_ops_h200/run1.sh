#!/bin/bash
# One GPU: every cuda test at the current commit, then 64K b12 A/B (current vs 9bd25c9) for the default and plain quantkey.
set -u
export TOKENIZERS_PARALLELISM=false
C=$(cat .gpu/COMMIT)
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 300 python3 -m pytest -m cuda -q -rfEs -p no:cacheprovider tests > /tmp/pyt.txt 2>&1
echo "pytest rc=$?"; grep -v "Warning\|warn\|^  \|^$" /tmp/pyt.txt | tail -15 | cut -c1-300
one() {  # tag dir commit selector
  (cd $2 && PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$3 timeout 100 python3 benchmarks/bench_decode.py \
    --contexts 65536 --methods quantkey-auto --batches 12 --steps 48 --quantkey-selector "$4" --config-seconds 30 \
    --max-seconds 90 --out $OUT/bench_decode_64k_b12_$1.json > $OUT/log_$1.txt 2>&1; echo "$1 rc=$?")
}
D="quantkey[bits=4,tail_bits=2,tail_near=3]"
one default_new_a . $C "$D"
one default_old_a .gpu/old 9bd25c9 "$D"
for f in $OUT/bench_decode_64k_b12_*.json; do python3 -c "
import json; r=json.load(open('$f'))['runs'][0]; s=r['stats']; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],1), 'median', round(r['step_ms_median'],1), 'capture ms', s.get('graph_capture_ms'), s.get('graph_captures')); print([round(x) for x in r['step_ms_each']])"; done
