#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
C=$(cat .gpu/COMMIT)
PYTHONPATH=$PWD timeout 230 python3 -m pytest -m cuda -q -rfEs -p no:cacheprovider tests > $OUT/pytest_cuda.txt 2>&1
echo "pytest cuda rc=$?"; grep -E "^E |Error|passed|failed" $OUT/pytest_cuda.txt | head -20 | cut -c1-300; tail -2 $OUT/pytest_cuda.txt | cut -c1-300
for k in v2 mma; do
HF_OFFLOAD_QUANTKEY_KERNEL=$k PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 90 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 --steps 64 --quantkey-selector quantkey --config-seconds 45 --max-seconds 80 --out $OUT/bench_decode_64k_b12_quantkey_$k.json > $OUT/l_$k.txt 2>&1; echo "64k $k rc=$?"
done
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],2), 'median', round(r['step_ms_median'],2), 'steady', round(st.mean(s),2), 'hit', round(r['hit_rate'] or 0,3), 'rec MB/step', round(r['recalled_bytes_per_step']/1e6,1), 'peak/pred', r.get('peak_over_predicted') or '')"; done
tail -3 $OUT/l_mma.txt
