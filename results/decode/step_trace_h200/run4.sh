#!/bin/bash
# On one H200: the scoring kernel's CUDA tests with the kstep swizzle, the kernel with and without it
# (swizzle_probe.py), Nsight Compute's memory sections of the swizzled kernel, and the decode step at 64K, batch 12.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/step_trace_h200/run4.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
timeout -s TERM 200 python3 -m pytest -p no:cacheprovider tests/test_kernel_quantkey_mma.py tests/test_selector_quantkey.py \
  > /tmp/pytest_mma.txt 2>&1; echo "pytest rc=$? $(date +%T)"; tail -1 /tmp/pytest_mma.txt
grep -E "FAILED|Error" /tmp/pytest_mma.txt | head -5; cp /tmp/pytest_mma.txt $OUT/pytest_mma_run4.txt
timeout -s TERM 150 python3 results/decode/step_trace_h200/swizzle_probe.py 2>&1 | grep -v "^ *$" | cut -c1-160
timeout 150 ncu --clock-control none --kernel-name quantkey_mma --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
  -o /tmp/qk python3 results/selection/pair_h200/ncu_probe.py > /tmp/ncu_log.txt 2>&1
echo "ncu rc=$?"; ncu --import /tmp/qk.ncu-rep --page details > $OUT/ncu_details_run4.txt 2>&1
grep -iE "Duration|Throughput|bank|wavefront" $OUT/ncu_details_run4.txt | cut -c1-150 | head -20
timeout -s TERM 100 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 \
  --steps 64 --quantkey-selector quantkey --config-seconds 30 --max-seconds 90 \
  --out $OUT/bench_decode_64k_b12_run4.json > /tmp/bench_log.txt 2>&1; echo "bench rc=$? $(date +%T)"
tail -3 /tmp/bench_log.txt | cut -c1-250
