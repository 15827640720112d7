#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
C=$(cat .gpu/COMMIT)
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernel_slots.py tests/test_kernels.py tests/test_kernel_paged.py tests/test_kernel_quantkey.py tests/test_kernel_tail.py > /tmp/pyt0.txt 2>&1
echo "pytest kernels rc=$?"; grep -E "^E |Error|passed|failed" /tmp/pyt0.txt | head -12 | cut -c1-300; tail -2 /tmp/pyt0.txt | cut -c1-200
PYTHONPATH=$PWD timeout 240 python3 -m pytest -m cuda -q -rfEs -p no:cacheprovider tests > /tmp/pyt.txt 2>&1
echo "pytest cuda rc=$?"; grep -E "^E |Error|passed|failed" /tmp/pyt.txt | head -12 | cut -c1-300; tail -2 /tmp/pyt.txt | cut -c1-200
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 110 python3 benchmarks/bench_decode.py --contexts 131072 --methods quantkey-auto --batches 10 --steps 64 --quantkey-selector quantkey --config-seconds 60 --max-seconds 100 --out $OUT/bench_decode_128k_b10_quantkey.json > /tmp/l1.txt 2>&1; echo "128k rc=$?"
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 90 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 --steps 64 --quantkey-selector quantkey --config-seconds 45 --max-seconds 80 --out $OUT/bench_decode_64k_b12_quantkey_b.json > /tmp/l2.txt 2>&1; echo "64k rc=$?"
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],2), 'median', round(r['step_ms_median'],2), 'steady', round(st.mean(s),2), 'hit', round(r['hit_rate'] or 0,3), 'rec MB/step', round(r['recalled_bytes_per_step']/1e6,1), 'peak/pred', r.get('peak_over_predicted') or '')"; done
