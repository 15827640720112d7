#!/bin/bash
# The default selector at 64K, batch 10 with fused norms on (the default), then the CUDA tests not yet run with
# fused norms on by default: lookahead, the estimate, the paged attention, the tensor-core scoring, the recall batch.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash run4.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 80 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 10 \
  --steps 64 --quantkey-selector "quantkey[bits=4,tail_bits=2,tail_near=3]" --config-seconds 30 --max-seconds 70 \
  --out $OUT/bench_decode_64k_b10_default_fused.json > /tmp/l.txt 2>&1; echo "bench rc=$? $(date +%T)"
python3 -c "
import json,statistics as st; r=json.load(open('$OUT/bench_decode_64k_b10_default_fused.json'))['runs'][0]; e=r['step_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print(r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'hit', round(r['hit_rate'] or 0,3), 'peak', round(r['peak_device_bytes']/2**30,1))" || tail -5 /tmp/l.txt
timeout 330 python3 -m pytest -m cuda -rfEs -p no:cacheprovider tests/test_cuda_lookahead.py tests/test_tail.py \
  tests/test_kernel_paged.py tests/test_kernel_quantkey_mma.py tests/test_bench_recall_batch.py > $OUT/pytest_cuda_rest.txt 2>&1
echo "pytest rc=$?"; grep -E "^E |FAILED|ERROR|passed|failed" $OUT/pytest_cuda_rest.txt | tail -12 | cut -c1-300
date +%T
