#!/bin/bash
# One device call: GPU tests of the block-scores and paged kernels (with the all-admitted skip), then decode A/B/A
# of the skip at 64K, batch 12 (new / the code before, carried in .ab/ / new), and 128K, batch 6 (new).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash run2.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {  # name, context, batch, selector, limit
  timeout -s TERM $5 python3 benchmarks/bench_decode.py --contexts $2 --methods quantkey-auto --batches $3 \
    --steps 64 --quantkey-selector "$4" --config-seconds 35 --max-seconds $(( $5 - 10 )) \
    --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1; rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 3
}
date +%T
timeout 170 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernel_mass.py tests/test_kernel_paged.py \
  tests/test_layer_graphs.py > $OUT/pytest_run2.txt 2>&1
echo "pytest rc=$?"; grep -E "passed|failed" $OUT/pytest_run2.txt | tail -3 | cut -c1-300
bench skip 65536 12 quantkey 75
cp hf_offload/cache.py /tmp/c.py; cp hf_offload/store/host.py /tmp/h.py; cp .ab/cache.py hf_offload/cache.py; cp .ab/host.py hf_offload/store/host.py
grep -c all_admitted hf_offload/cache.py  # 0: the code before the skip
bench before 65536 12 quantkey 75
cp /tmp/c.py hf_offload/cache.py; cp /tmp/h.py hf_offload/store/host.py
bench skip2 65536 12 quantkey 75
bench 128k_b6 131072 6 quantkey 90
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'hostMB', round(r['host_recalled_bytes_per_step']/1e6,1))"; done
