#!/bin/bash
# One device call: every CUDA test at this commit, then the admission margin (device memory left free beside the
# cache) at 64K and 128K: 16 GiB (the benchmark's default) against 8 GiB.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash run4.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {  # name, context, batch, margin, limit
  timeout -s TERM $5 python3 benchmarks/bench_decode.py --contexts $2 --methods quantkey-auto --batches $3 \
    --steps 64 --quantkey-selector quantkey --admission-margin-gib $4 --config-seconds 30 --max-seconds $(( $5 - 10 )) \
    --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1; rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 3
}
date +%T
timeout 250 python3 -m pytest -m cuda -rfEs -p no:cacheprovider tests > $OUT/pytest_cuda.txt 2>&1
echo "pytest cuda rc=$?"; grep -E "^E |passed|failed" $OUT/pytest_cuda.txt | head -12 | cut -c1-300
bench 64k_b12_m8 65536 12 8 70
bench 64k_b13_m8 65536 13 8 75
bench 128k_b6_m8 131072 6 8 80
bench 128k_b7_m8 131072 7 8 85
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'hostMB', round(r['host_recalled_bytes_per_step']/1e6,1), 'peak', round(r['peak_device_bytes']/2**30,1))"; done
