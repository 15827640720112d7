#!/bin/bash
# One device call: GPU tests of the top-k kernel, a micro-benchmark of it against torch.topk, decode A/B/A of the
# kernel at 64K, batch 12 (new / quantkey.py before it, carried in .ab/ / new), then the default selector at 64K,
# batch 12 and plain quantkey at 128K, batch 8. Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash run3.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {  # name, context, batch, selector, limit
  timeout -s TERM $5 python3 benchmarks/bench_decode.py --contexts $2 --methods quantkey-auto --batches $3 \
    --steps 64 --quantkey-selector "$4" --config-seconds 35 --max-seconds $(( $5 - 10 )) \
    --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1; rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 3
}
date +%T
timeout 120 python3 -m pytest -rfEs -p no:cacheprovider tests/test_kernel_topk.py tests/test_kernel_mass.py \
  tests/test_selector_quantkey.py > $OUT/pytest_run3.txt 2>&1
echo "pytest rc=$?"; grep -E "passed|failed" $OUT/pytest_run3.txt | tail -3 | cut -c1-300
python3 - <<'PY' 2>&1 | tee $OUT/topk_micro.txt
import torch, statistics
from hf_offload.kernels.topk import ranked_topk
from benchmarks.common import cuda_event_ms
for b, n, k, r in [(12, 4096, 128, 128), (12, 4096, 128, 512), (6, 8192, 128, 128), (12, 8192, 128, 512)]:
    s = torch.randn(b, 1, n, device="cuda")
    s[:, :, :4] = float("inf")
    t_torch = statistics.median(cuda_event_ms(lambda: s.topk(r, dim=-1), warmup=5, reps=50)) * 1e3
    t_kern = statistics.median(cuda_event_ms(lambda: ranked_topk(s, k, r), warmup=5, reps=50)) * 1e3
    print(f"batch {b} n {n} k {k} ranked {r}: torch.topk {t_torch:.1f} us, ranked_topk {t_kern:.1f} us")
PY
bench topk 65536 12 quantkey 75
cp hf_offload/selectors/quantkey.py /tmp/q.py; cp .ab/quantkey.py hf_offload/selectors/quantkey.py
grep -c ranked_topk hf_offload/selectors/quantkey.py  # 0: the code before the kernel
bench torchtopk 65536 12 quantkey 75
cp /tmp/q.py hf_offload/selectors/quantkey.py
bench topk2 65536 12 quantkey 75
bench default_b12 65536 12 "quantkey[bits=4,tail_bits=2,tail_near=3]" 90
bench 128k_b8 131072 8 quantkey 100
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'hostMB', round(r['host_recalled_bytes_per_step']/1e6,1))"; done
