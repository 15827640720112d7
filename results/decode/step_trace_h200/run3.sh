#!/bin/bash
# On one H200: the CUDA tests of the block scores and the append kernel and of what runs them in decode steps, the
# decode step at 64K tokens, batch 12 (8B shape, plain quantkey, admission auto) with the row statistics in one step
# and the token appended in one launch, its kernel trace, and Nsight Compute's memory and warp-state sections of the
# scoring kernel (results/selection/pair_h200/ncu_probe.py).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/step_trace_h200/run3.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 150 python3 -m pytest -m cuda -p no:cacheprovider tests/test_kernel_mass.py tests/test_kernel_append.py \
  tests/test_layer_graphs.py tests/test_cuda_graphs.py > $OUT/pytest_cuda_run3.txt 2>&1
echo "pytest rc=$? $(date +%T)"; grep -E "passed|failed|error" $OUT/pytest_cuda_run3.txt | tail -3
timeout -s TERM 90 python3 -m pytest -p no:cacheprovider tests/test_kernel_mass.py tests/test_kernel_append.py \
  > $OUT/pytest_kernels_run3.txt 2>&1; echo "pytest kernels rc=$?"; tail -1 $OUT/pytest_kernels_run3.txt
timeout -s TERM 100 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 \
  --steps 64 --quantkey-selector quantkey --config-seconds 30 --max-seconds 90 \
  --out $OUT/bench_decode_64k_b12.json > $OUT/bench_log.txt 2>&1; echo "bench rc=$? $(date +%T)"
tail -3 $OUT/bench_log.txt | cut -c1-250
timeout -s TERM 100 python3 benchmarks/bench_decode_step.py --context 65536 --batch 12 --transfers kernel --graphs on \
  --lookahead off --selector quantkey --admission auto --device-memory-gib 114 --steps 3 --warmup 2 --profile 3 \
  --profile-trace quantkey_mma --out $OUT/decode_step_64k_b12_graphs.json > $OUT/trace_log.txt 2>&1; echo "trace rc=$?"
grep -A30 "kernels per period" $OUT/trace_log.txt | cut -c1-100
timeout 150 ncu --clock-control none --kernel-name quantkey_mma --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis_Tables \
  --section MemoryWorkloadAnalysis -o $OUT/qk python3 results/selection/pair_h200/ncu_probe.py > $OUT/ncu_log.txt 2>&1
echo "ncu rc=$?"; ncu --import $OUT/qk.ncu-rep --page details > $OUT/ncu_details.txt 2>&1
ncu --import $OUT/qk.ncu-rep --page raw --csv > $OUT/ncu_raw.csv 2>&1
grep -iE "Duration|Throughput|Shared|Bank|Stall|L1|wavefront" $OUT/ncu_details.txt | cut -c1-150 | head -50
date +%T
