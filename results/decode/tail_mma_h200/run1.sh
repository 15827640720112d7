#!/bin/bash
# On one H200: the tensor-core estimate of the unselected blocks (kernels/tail_mma.py). Its CUDA tests and the other
# estimate tests; the estimate kernels timed at the default selector's decode shape (8B shape, 64K tokens = 4,096
# blocks, batch 10, 381 near blocks through an index); then the default selector's decode throughput at 64K,
# batch 10: tensor-core kernel / the Triton `dot` kernel (HF_OFFLOAD_TAIL_KERNEL=dot) / tensor-core kernel again,
# and one profiled step with the tensor-core kernel.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/tail_mma_h200/run1.sh PART (1: tests and kernel timings;
# 2: decode throughput and the profiled step; one machine call each)
set -u
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
SEL='quantkey[bits=4,tail_bits=2,tail_near=3]'
PART=${1:-1}
date +%T
if [ "$PART" = 1 ]; then
timeout -s TERM 240 python3 -m pytest -v -p no:cacheprovider tests/test_kernel_tail_mma.py tests/test_kernel_tail.py \
  tests/test_kernel_tail_merge.py tests/test_tail_near.py tests/test_bench_tail_kernel.py > $OUT/pytest_tail_mma_run1.txt 2>&1
echo "pytest rc=$? $(date +%T)"; tail -1 $OUT/pytest_tail_mma_run1.txt; grep -E "FAILED|Error" $OUT/pytest_tail_mma_run1.txt | head -8
timeout -s TERM 120 python3 benchmarks/bench_tail_kernel.py --batch 10 --blocks 4096 --near 381 --bits 4,2 2,2 \
  --blocks-per-program 16 --num-warps --num-stages --out $OUT/bench_tail_kernel_near_64k_b10.json 2>&1 | tail -16
echo "bench_tail rc=$? $(date +%T)"
exit 0
fi
timeout -s TERM 100 python3 -m pytest -v -p no:cacheprovider tests/test_bench_tail_kernel.py > $OUT/pytest_bench_tail_run1.txt 2>&1
echo "pytest rc=$? $(date +%T)"; tail -1 $OUT/pytest_bench_tail_run1.txt
bench() {  # name, kernel
  HF_OFFLOAD_TAIL_KERNEL=$2 timeout -s TERM 100 python3 benchmarks/bench_decode.py \
    --contexts 65536 --steps 48 --config-seconds 12 --max-seconds 90 --quantkey-selector "$SEL" --methods quantkey-auto \
    --batches 10 --out /tmp/bench_$1.json > /tmp/bench_$1.txt 2>&1
  echo "$1 rc=$? $(date +%T)"; grep -E "^quantkey-auto +[0-9]" /tmp/bench_$1.txt | cut -c1-150
}
bench mma_a mma
bench dot_b dot
bench mma_c mma
python3 -c "
import json
runs = {n: json.load(open(f'/tmp/bench_{n}.json')) for n in ('mma_a', 'dot_b', 'mma_c')}
json.dump(runs, open('$OUT/bench_decode_64k_b10_tail_ab.json', 'w'), indent=1)"
timeout -s TERM 150 python3 benchmarks/bench_decode_step.py --context 65536 --batch 10 \
  --transfers kernel --graphs on --lookahead off --selector "$SEL" --admission auto --device-memory-gib 87 --steps 3 \
  --warmup 2 --profile 3 --profile-trace quantkey_mma --out /tmp/step_run1.json > /tmp/trace_run1.txt 2>&1
echo "trace rc=$?"; cp /tmp/step_run1.kernel.graphs-True.lookahead-False.prof.trace.json $OUT/decode_step_64k_b10_mma.trace.json
grep "kernels per" /tmp/trace_run1.txt | cut -c1-300
ls $OUT
