#!/bin/bash
# One device call: the rotary kernel's CUDA tests; then decode at 64K tokens, batch 12 (8B shape, plain quantkey,
# admission auto, whole-layer graphs): defaults (scoring ring of 2, fused rotary) against no ring
# (quantkey_mma.STAGES = 0, set in-process) and against transformers' rotary (--fused-rotary off); the default
# selector (4-bit keys) at 64K, batch 10; then a kernel trace of 3 graph-replayed decode steps at 64K, batch 12.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/ring_h200/run4.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {  # name, stages, batch, selector, rotary, limit
  timeout -s TERM $6 python3 -c "import sys, runpy; import hf_offload.kernels.quantkey_mma as m; m.STAGES = $2; \
sys.argv = ['benchmarks/bench_decode.py'] + sys.argv[1:]; runpy.run_path('benchmarks/bench_decode.py', run_name='__main__')" \
    --contexts 65536 --methods quantkey-auto --batches $3 --steps 64 --quantkey-selector "$4" --fused-rotary $5 \
    --config-seconds 30 --max-seconds $(( $6 - 10 )) --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1
  rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 2
}
date +%T
timeout 120 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_kernel_rotary.py tests/test_fused_rotary.py \
  tests/test_fused_norms.py > $OUT/pytest_rotary.txt 2>&1; echo "pytest rc=$?"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_rotary.txt | tail -6 | cut -c1-300
bench 64k_b12_default 2 12 quantkey auto 72
bench 64k_b12_noring 0 12 quantkey auto 72
bench 64k_b12_torchrotary 2 12 quantkey off 72
bench 64k_b10_default_sel 2 10 "quantkey[bits=4,tail_bits=2,tail_near=3]" auto 78
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'peak', round(r['peak_device_bytes']/2**30,1))"; done
timeout -s TERM 100 python3 benchmarks/bench_decode_step.py --context 65536 --batch 12 --transfers kernel --graphs on \
  --lookahead off --selector quantkey --admission auto --device-memory-gib 114 --steps 3 --warmup 2 --profile 3 \
  --profile-trace quantkey_mma --out $OUT/decode_step_64k_b12_graphs.json > /tmp/l_trace.txt 2>&1; echo "trace rc=$?"
tail -2 /tmp/l_trace.txt | cut -c1-300; grep -A60 "kernels per period" /tmp/l_trace.txt | cut -c1-150
ls $OUT; date +%T
