#!/bin/bash
# One device call: the defaults at 64K tokens / batch 12 three times (the spread between processes) and 128K /
# batch 6 once more, same commit as run3.sh's code.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/projections_h200/run4.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {  # name, context, batch, limit
  timeout -s TERM $4 python3 benchmarks/bench_decode.py --contexts $2 --methods quantkey-auto --batches $3 \
    --steps 64 --quantkey-selector quantkey --config-seconds 30 --max-seconds $(( $4 - 10 )) \
    --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1
  rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 1
}
date +%T
bench 64k_b12_r1 65536 12 45
bench 64k_b12_r2 65536 12 45
bench 64k_b12_r3 65536 12 45
bench 128k_b6_r1 131072 6 50
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'peak', round(r['peak_device_bytes']/2**30,1))"; done
date +%T
