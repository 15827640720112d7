#!/bin/bash
# One device call: the CUDA tests of the graphs' counters (lookups counted per element in captured graphs, buffers
# made outside the capture), the projections, the scoring and paged kernels; then the defaults (scoring registers
# uncapped again) at 64K tokens / batch 12 twice, 128K / batch 6, and the default selector at 64K / batch 10.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/projections_h200/run3.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 260 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_cuda_graphs.py tests/test_layer_graphs.py \
  tests/test_fused_projections.py tests/test_kernel_quantkey_mma.py tests/test_kernel_paged.py \
  > $OUT/pytest_cuda3.txt 2>&1; echo "pytest rc=$? $(date +%T)"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_cuda3.txt | tail -8 | cut -c1-300
bench() {  # name, context, batch, selector, limit
  timeout -s TERM $5 python3 benchmarks/bench_decode.py --contexts $2 --methods quantkey-auto --batches $3 \
    --steps 64 --quantkey-selector "$4" --config-seconds 30 --max-seconds $(( $5 - 10 )) \
    --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1
  rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 2
}
bench 64k_b12_final 65536 12 quantkey 72
bench 64k_b12_final2 65536 12 quantkey 72
bench 128k_b6_final 131072 6 quantkey 85
bench 64k_b10_default_sel 65536 10 "quantkey[bits=4,tail_bits=2,tail_near=3]" 78
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'peak', round(r['peak_device_bytes']/2**30,1))"; done
date +%T
