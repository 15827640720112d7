#!/bin/bash
# One device call: the scoring kernel with each block's log-sum-exp through a shared-memory tile (TRANSPOSE) against
# the warp shuffles: the CUDA tests of the kernel, its micro-benchmark at 64K tokens, batch 12 (2 and 4 bits), then
# decode steps at 64K / batch 12, A/B (quantkey_mma.TRANSPOSE set in the benchmark's process), and 128K / batch 6.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/selection/transpose_h200/run1.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 190 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_kernel_quantkey_mma.py > $OUT/pytest_mma.txt 2>&1
echo "pytest rc=$?"; grep -E "^E |FAILED|passed|failed" $OUT/pytest_mma.txt | tail -6 | cut -c1-300
timeout 120 python3 benchmarks/bench_quantkey_kernel.py --batch 12 --blocks 4096 --bits 2 4 --warps 4 \
  --rows-per-thread 16 --out $OUT/bench_quantkey_kernel_64k_b12.json 2>&1 | grep -v "^v[12]" | cut -c1-160
bench() {  # name, transpose, context, batch, limit
  timeout -s TERM $5 python3 -c "import sys, runpy; import hf_offload.kernels.quantkey_mma as m; m.TRANSPOSE = $2; \
sys.argv = ['benchmarks/bench_decode.py'] + sys.argv[1:]; runpy.run_path('benchmarks/bench_decode.py', run_name='__main__')" \
    --contexts $3 --methods quantkey-auto --batches $4 --steps 64 --quantkey-selector quantkey \
    --config-seconds 30 --max-seconds $(( $5 - 10 )) --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1
  rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 2
}
bench 64k_b12_transpose True 65536 12 72
bench 64k_b12_shuffle False 65536 12 72
bench 128k_b6_transpose True 131072 6 85
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'peak', round(r['peak_device_bytes']/2**30,1))"; done
date +%T
