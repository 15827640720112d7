#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
export HF_OFFLOAD_GIT_COMMIT=$(cat .gpu/COMMIT)
export PYTHONPATH=$PWD
timeout 60 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernel_quantkey_mma.py > $OUT/pytest_mma.txt 2>&1
echo "pytest mma rc=$?"; grep -E "^E |passed|failed" $OUT/pytest_mma.txt | head -8 | cut -c1-250
python3 benchmarks/bench_quantkey_kernel.py --batch 12 --blocks 4096 --bits 4 --warps 4 --rows-per-thread 16 --out $OUT/bench_quantkey_kernel_4bit_64k_b12_h200.json 2>&1 | tail -11
for k in mma v2; do
HF_OFFLOAD_QUANTKEY_KERNEL=$k timeout 100 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 --steps 64 --quantkey-selector "quantkey[bits=4,tail_bits=2,tail_near=3]" --config-seconds 45 --max-seconds 90 --out $OUT/bench_decode_64k_b12_default_$k.json > $OUT/l_default_$k.txt 2>&1; echo "default $k rc=$?"
done
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],2), 'median', round(r['step_ms_median'],2), 'steady', round(st.mean(s),2), 'hit', round(r['hit_rate'] or 0,3))"; done
