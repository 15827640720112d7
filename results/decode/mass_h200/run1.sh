#!/bin/bash
# One device call: GPU tests of the block-scores kernel, decode A/B (kernel vs the torch code it replaces, same
# call), and an op-by-op kernel trace of one layer's decode step. Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash run1.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {  # name, limit
  timeout -s TERM $2 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 \
    --steps 64 --quantkey-selector quantkey --config-seconds 35 --max-seconds $(( $2 - 10 )) \
    --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1; rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 3
}
summary() {
  for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3))"; done
}
date +%T; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernel_mass.py tests/test_selector_quantkey.py > $OUT/pytest_mass.txt 2>&1
echo "pytest rc=$?"; tail -3 $OUT/pytest_mass.txt | cut -c1-300
bench mass 75
cp hf_offload/selectors/quantkey.py /tmp/qk_new.py; git show 83a78b9:hf_offload/selectors/quantkey.py > hf_offload/selectors/quantkey.py; grep -c block_scores hf_offload/selectors/quantkey.py  # 0: the code before the kernel
bench torch 75
cp /tmp/qk_new.py hf_offload/selectors/quantkey.py
bench mass2 75
summary
timeout -s TERM 150 python3 benchmarks/bench_decode_step.py --context 65536 --batch 12 --transfers kernel --graphs off \
  --lookahead off --selector quantkey --admission auto --device-memory-gib 88 --steps 3 --warmup 2 --profile 3 \
  --profile-trace quantkey_mma --out $OUT/decode_step_64k_b12_trace.json > /tmp/l_trace.txt 2>&1; echo "trace rc=$?"
tail -3 /tmp/l_trace.txt | cut -c1-300; grep -A90 "kernels per period" /tmp/l_trace.txt | cut -c1-200
