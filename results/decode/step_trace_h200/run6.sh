#!/bin/bash
# On one H200: the paged decode attention with every KV head of a tile in one program (paged.HEADS_INNER): its
# tests on CUDA, benchmarks/bench_paged_kernel.py at 64K, batch 12 (8B shape, budget 2048), and the decode step at
# 64K, batch 12 (plain quantkey, admission auto) without and with it, in one call.
# The variant is kept as heads_inner_trial.patch (taken out of the library untimed); the script applies it first.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/step_trace_h200/run6.sh
set -u
patch -p1 --forward < results/decode/step_trace_h200/heads_inner_trial.patch || exit 1
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 150 python3 -m pytest -p no:cacheprovider tests/test_kernel_paged.py > /tmp/pytest_paged.txt 2>&1
echo "pytest rc=$? $(date +%T)"; tail -1 /tmp/pytest_paged.txt; grep -E "FAILED" /tmp/pytest_paged.txt | head -5
cp /tmp/pytest_paged.txt $OUT/pytest_paged_run6.txt
timeout -s TERM 120 python3 benchmarks/bench_paged_kernel.py --configs 4/4/0/0/0 4/4/0/0/1 4/8/0/0/1 8/4/0/0/1 \
  8/8/0/0/1 4/4/0/2/1 4/4/0/3/1 2/4/0/0/1 8/8/0/3/1 4/4/0/0/0 --out $OUT/bench_paged_kernel_run6.json 2>&1 | \
  grep -E "paged|sdpa" | cut -c1-120
bench() {  # name, heads_inner
  timeout -s TERM 90 python3 -c "
import runpy, sys
import hf_offload.kernels.paged as paged
paged.HEADS_INNER = $2
sys.argv = ['bench_decode.py', '--contexts', '65536', '--methods', 'quantkey-auto', '--batches', '12', '--steps', '64',
            '--quantkey-selector', 'quantkey', '--config-seconds', '20', '--max-seconds', '80',
            '--out', '$OUT/bench_decode_64k_b12_$1.json']
runpy.run_path('benchmarks/bench_decode.py', run_name='__main__')" > /tmp/l_$1.txt 2>&1
  echo "$1 rc=$? $(date +%T)"; grep -E "quantkey-auto +65536" /tmp/l_$1.txt | cut -c1-150
}
bench inner_off False
bench inner_on True
bench inner_off2 False
