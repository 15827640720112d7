#!/bin/bash
# One device call: the block scores' chunk statistics at 1,024 blocks per program (the default now) against 128
# (kernels.mass.STATS_BLOCK_N set in-process), A/B/A at 64K tokens, batch 12 (plain quantkey, admission auto,
# whole-layer graphs, scoring ring and fused rotary on); 128K tokens, batch 6; then the other CUDA tests.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/ring_h200/run6.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench() {  # name, stats block, context, batch, limit
  timeout -s TERM $5 python3 -c "import sys, runpy; import hf_offload.kernels.mass as m; m.STATS_BLOCK_N = $2; \
m.MAX_STATS_CHUNKS = m.MAX_CHUNKS * m.BLOCK_N // $2; \
sys.argv = ['benchmarks/bench_decode.py'] + sys.argv[1:]; runpy.run_path('benchmarks/bench_decode.py', run_name='__main__')" \
    --contexts $3 --methods quantkey-auto --batches $4 --steps 64 --quantkey-selector quantkey \
    --config-seconds 30 --max-seconds $(( $5 - 10 )) --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1
  rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 2
}
date +%T
bench 64k_b12_stats1024 1024 65536 12 72
bench 64k_b12_stats128 128 65536 12 72
bench 64k_b12_stats1024b 1024 65536 12 72
bench 128k_b6 1024 131072 6 85
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'peak', round(r['peak_device_bytes']/2**30,1))"; done
timeout 230 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_cuda.py tests/test_cuda_lookahead.py \
  tests/test_tail.py tests/test_kernel_paged.py tests/test_kernel_quantkey_mma.py tests/test_bench_recall_batch.py \
  > $OUT/pytest_cuda_rest.txt 2>&1; echo "pytest rc=$?"
timeout 60 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernel_mass.py > $OUT/pytest_mass.txt 2>&1
echo "pytest mass (on CUDA) rc=$?"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_cuda_rest.txt | tail -8 | cut -c1-300
date +%T
