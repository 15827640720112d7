#!/bin/bash
# One device call (after run4.sh stopped at its fourth benchmark, whose arguments were short by one): the defaults
# again at 64K, batch 12; the default selector at 64K, batch 10; a kernel trace of 3 graph-replayed decode steps at
# 64K, batch 12; then the CUDA tests of the whole-layer graphs with fused rotary and norms on by default.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/ring_h200/run5.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {  # name, batch, selector, limit
  timeout -s TERM $4 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches $2 \
    --steps 64 --quantkey-selector "$3" --config-seconds 30 --max-seconds $(( $4 - 10 )) \
    --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1
  rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 2
}
date +%T
bench 64k_b12_default2 12 quantkey 72
bench 64k_b10_default_sel 10 "quantkey[bits=4,tail_bits=2,tail_near=3]" 78
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'peak', round(r['peak_device_bytes']/2**30,1))"; done
timeout -s TERM 100 python3 benchmarks/bench_decode_step.py --context 65536 --batch 12 --transfers kernel --graphs on \
  --lookahead off --selector quantkey --admission auto --device-memory-gib 114 --steps 3 --warmup 2 --profile 3 \
  --profile-trace quantkey_mma --out $OUT/decode_step_64k_b12_graphs.json > /tmp/l_trace.txt 2>&1; echo "trace rc=$?"
tail -2 /tmp/l_trace.txt | cut -c1-300; grep -A60 "kernels per period" /tmp/l_trace.txt | cut -c1-150
timeout 200 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_layer_graphs.py tests/test_cuda_graphs.py \
  > $OUT/pytest_graphs.txt 2>&1; echo "pytest graphs rc=$?"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_graphs.txt | tail -8 | cut -c1-300
ls $OUT; date +%T
