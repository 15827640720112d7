#!/bin/bash
# One device call: the fused RMS norm's CUDA tests, then an A/B/A of fused_norms (on, the default on CUDA, against
# off: transformers' norms) at 64K, batch 12 (plain quantkey, admission auto, whole-layer graphs), 128K, batch 6 with
# it on, then the CUDA tests of the graphs with it on by default.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash run2.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {  # name, context, batch, fused, limit
  timeout -s TERM $5 python3 benchmarks/bench_decode.py --contexts $2 --methods quantkey-auto --batches $3 \
    --steps 64 --quantkey-selector quantkey --fused-norms $4 --config-seconds 30 --max-seconds $(( $5 - 10 )) \
    --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1; rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 3
}
date +%T
timeout 100 python3 -m pytest -v -rfEs -p no:cacheprovider tests/test_kernel_norm.py tests/test_fused_norms.py > $OUT/pytest_norms.txt 2>&1
echo "pytest norms rc=$?"; grep -E "FAILED|ERROR|passed|failed" $OUT/pytest_norms.txt | tail -8 | cut -c1-300
bench 64k_b12_fused 65536 12 auto 75
bench 64k_b12_torchnorm 65536 12 off 75
bench 64k_b12_fused2 65536 12 auto 75
bench 128k_b6_fused 131072 6 auto 85
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'peak', round(r['peak_device_bytes']/2**30,1))"; done
timeout 150 python3 -m pytest -m cuda -rfEs -p no:cacheprovider tests/test_layer_graphs.py tests/test_cuda_graphs.py > $OUT/pytest_graphs.txt 2>&1
echo "pytest graphs rc=$?"; grep -E "^E |FAILED|ERROR|passed|failed" $OUT/pytest_graphs.txt | tail -12 | cut -c1-300
date +%T
