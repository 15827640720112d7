#!/bin/bash
# One device call: the CUDA tests of the kernels changed without a GPU at the end of the last stop (norm and MLP
# store helper, the gated MLP's Triton gate, the scoring kernel's compile key), then where the host time of a decode
# step goes at 64K tokens / batch 12 (plain quantkey, admission auto, whole-layer graphs): 64 timed steps, then 32
# more under cProfile (two seals of a full block in every layer).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/seal_h200/run1.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout 240 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_kernel_norm.py tests/test_fused_norms.py \
  tests/test_fused_projections.py tests/test_kernel_quantkey_mma.py > $OUT/pytest_cuda_run1.txt 2>&1; echo "pytest rc=$?"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_cuda_run1.txt | tail -8 | cut -c1-300
date +%T
timeout -s TERM 80 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 \
  --steps 64 --quantkey-selector quantkey --config-seconds 30 --max-seconds 70 --profile-seal 32 \
  --out $OUT/bench_decode_64k_b12_run1.json > /tmp/l_b.txt 2>&1; echo "bench rc=$?"; tail -4 /tmp/l_b.txt | cut -c1-200
python3 -c "
import json,statistics as st; r=json.load(open('$OUT/bench_decode_64k_b12_run1.json'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print(r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2)); print('seal steps', [e[i] for i in range(len(e)) if i%16==15], [h[i] for i in range(len(h)) if i%16==15])"
head -45 $OUT/*host_profile.txt | cut -c1-180
grep -A40 "_seal)" $OUT/*host_profile.txt | head -60 | cut -c1-180
date +%T
