#!/bin/bash
# One device call: the defaults now (fused projections with the gated MLP's SiLU product in one launch, paged
# attention at one tile of 4 entries per program, the lookup counts of captured graphs as one add, the query scaled
# inside the scoring kernel, its registers capped for 7 programs per multiprocessor) at 64K tokens / batch 12, A/B
# against uncapped registers (quantkey_mma.MIN_BLOCKS = 0) and against fused projections off; 128K / batch 6; a
# kernel trace of 3 graph-replayed decode steps at 64K / batch 12; then the CUDA tests touched.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/projections_h200/run2.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {  # name, quantkey_mma.MIN_BLOCKS, fused projections, context, batch, limit
  timeout -s TERM $6 python3 -c "import sys, runpy; import hf_offload.kernels.quantkey_mma as m; m.MIN_BLOCKS = $2; \
sys.argv = ['benchmarks/bench_decode.py'] + sys.argv[1:]; runpy.run_path('benchmarks/bench_decode.py', run_name='__main__')" \
    --contexts $4 --methods quantkey-auto --batches $5 --steps 64 --quantkey-selector quantkey \
    --fused-projections $3 --config-seconds 30 --max-seconds $(( $6 - 10 )) --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1
  rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 2
}
date +%T
bench 64k_b12_default None auto 65536 12 72
bench 64k_b12_uncapped 0 auto 65536 12 72
bench 64k_b12_separate None off 65536 12 72
bench 128k_b6_default None auto 131072 6 85
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'peak', round(r['peak_device_bytes']/2**30,1))"; done
timeout -s TERM 100 python3 benchmarks/bench_decode_step.py --context 65536 --batch 12 --transfers kernel --graphs on \
  --lookahead off --selector quantkey --admission auto --device-memory-gib 114 --steps 3 --warmup 2 --profile 3 \
  --profile-trace quantkey_mma --out $OUT/decode_step_64k_b12_graphs.json > /tmp/l_trace.txt 2>&1; echo "trace rc=$?"
grep -A40 "kernels per period" /tmp/l_trace.txt | cut -c1-110
timeout 230 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_fused_projections.py \
  tests/test_kernel_quantkey_mma.py tests/test_kernel_paged.py tests/test_layer_graphs.py tests/test_cuda_graphs.py \
  > $OUT/pytest_cuda.txt 2>&1; echo "pytest rc=$?"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_cuda.txt | tail -8 | cut -c1-300
date +%T
