#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
C=$(cat .gpu/COMMIT)
export HF_OFFLOAD_GIT_COMMIT=$C
PYTHONPATH=$PWD timeout 60 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernel_quantkey_mma.py > $OUT/pytest_mma.txt 2>&1
echo "pytest mma rc=$?"; tail -3 $OUT/pytest_mma.txt | cut -c1-300
python3 benchmarks/bench_quantkey_kernel.py --batch 12 --blocks 4096 --bits 2 --warps 4 --rows-per-thread 16 --out $OUT/bench_quantkey_kernel_64k_b12_h200.json 2>&1 | tail -10
for k in mma v2; do
HF_OFFLOAD_QUANTKEY_KERNEL=$k PYTHONPATH=$PWD timeout 110 python3 benchmarks/bench_decode.py --contexts 131072 --methods quantkey-auto --batches 10 --steps 64 --quantkey-selector quantkey --config-seconds 60 --max-seconds 100 --out $OUT/bench_decode_128k_b10_quantkey_$k.json > $OUT/l128_$k.txt 2>&1; echo "128k $k rc=$?"
done
HF_OFFLOAD_QUANTKEY_KERNEL=mma PYTHONPATH=$PWD timeout 90 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 --steps 64 --quantkey-selector quantkey --config-seconds 45 --max-seconds 80 --out $OUT/bench_decode_64k_b12_quantkey_mma_prefetch.json > $OUT/l64.txt 2>&1; echo "64k rc=$?"
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],2), 'median', round(r['step_ms_median'],2), 'steady', round(st.mean(s),2), 'hit', round(r['hit_rate'] or 0,3), 'rec MB/step', round(r['recalled_bytes_per_step']/1e6,1))"; done
