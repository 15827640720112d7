#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
C=$(cat .gpu/COMMIT)
PYTHONPATH=$PWD timeout 120 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernel_slots.py tests/test_kernel_paged.py > /tmp/pyt1.txt 2>&1
echo "pytest rc=$?"; grep -E "^E |Error|passed|failed" /tmp/pyt1.txt | head -20 | cut -c1-300
one() {  # tag dir commit selector
  (cd $2 && PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$3 timeout 100 python3 benchmarks/bench_decode.py     --contexts 65536 --methods quantkey-auto --batches 12 --steps 64 --quantkey-selector "$4" --decode-attention paged     --config-seconds 45 --max-seconds 90 --out $OUT/bench_decode_64k_b12_$1.json > /tmp/log_$1.txt 2>&1; echo "$1 rc=$?")
}
one quantkey_new_a . $C quantkey
one quantkey_old_a .gpu/old 7967c4c quantkey
one default_new_a . $C "quantkey[bits=4,tail_bits=2,tail_near=3]"
one default_old_a .gpu/old 7967c4c "quantkey[bits=4,tail_bits=2,tail_near=3]"
for f in $OUT/bench_decode_64k_b12_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],2), 'median', round(r['step_ms_median'],2), 'steady', round(st.mean(s),2), 'hit', round(r['hit_rate'] or 0,3), 'rec MB/step', round(r['recalled_bytes_per_step']/1e6,1))"; done
