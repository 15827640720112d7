#!/bin/bash
# On one H200, after run1.sh: the estimate's range merge, far-block mass and merge with the selection in one launch
# (kernels/tail.py tail_attention_merged). Its CUDA tests and the other estimate tests; the kernel trace of run1
# again; then the default selector's decode throughput at 64K, batch 10 (8B shape) without and with it, alternating
# (the tree without it: this tree with merged.patch reversed, in a copy).
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/default_trace_h200/run2.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
SEL='quantkey[bits=4,tail_bits=2,tail_near=3]'
HERE=$PWD
rm -rf /tmp/old && mkdir /tmp/old && cp -r hf_offload benchmarks /tmp/old/ && \
  (cd /tmp/old && patch -s -R -p1 < $HERE/results/decode/default_trace_h200/merged.patch) || exit 1
date +%T
PYTHONPATH=$HERE timeout -s TERM 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_tail_merge.py \
  tests/test_kernel_tail.py tests/test_tail.py tests/test_tail_near.py > $OUT/pytest_tail_run2.txt 2>&1
echo "pytest rc=$? $(date +%T)"; tail -1 $OUT/pytest_tail_run2.txt; grep FAILED $OUT/pytest_tail_run2.txt | head -5
PYTHONPATH=$HERE timeout -s TERM 150 python3 benchmarks/bench_decode_step.py --context 65536 --batch 10 \
  --transfers kernel --graphs on --lookahead off --selector "$SEL" --admission auto --device-memory-gib 87 --steps 3 \
  --warmup 2 --profile 3 --profile-trace quantkey_mma --out /tmp/step_run2.json > /tmp/trace_run2.txt 2>&1
echo "trace rc=$?"; cp /tmp/step_run2.kernel.graphs-True.lookahead-False.prof.trace.json $OUT/decode_step_64k_b10_merged.trace.json
grep "kernels per" /tmp/trace_run2.txt | cut -c1-200
bench() {  # name, tree, commit label
  (cd $2 && HF_OFFLOAD_GIT_COMMIT="$3" PYTHONPATH=$2 timeout -s TERM 100 python3 benchmarks/bench_decode.py --contexts 65536 --steps 48 \
    --config-seconds 15 --max-seconds 90 --quantkey-selector "$SEL" --methods quantkey-auto --batches 10 \
    --out /tmp/bench_$1.json > /tmp/bench_$1.txt 2>&1)
  echo "$1 rc=$? $(date +%T)"; grep -E "^quantkey-auto +[0-9]" /tmp/bench_$1.txt | cut -c1-150
}
C=$HF_OFFLOAD_GIT_COMMIT
bench merged_a $HERE $C
bench before_b /tmp/old "$C with merged.patch reversed"
bench merged_c $HERE $C
python3 -c "
import json, sys
runs = {n: json.load(open(f'/tmp/bench_{n}.json')) for n in ('merged_a', 'before_b', 'merged_c')}
json.dump(runs, open('$OUT/bench_decode_64k_b10_merged_ab.json', 'w'), indent=1)"
ls $OUT
