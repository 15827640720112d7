#!/bin/bash
# On one H200, after run2.sh: the bounded estimate's near tokens and far blocks in one launch as well
# (kernels/tail.py tail_plan) and the merge kernel with one program per query head. CUDA tests of the estimate;
# the kernel trace again; then the default selector's decode throughput at 64K, batch 10 (8B shape): this tree,
# the tree before both kernels (plan.patch and merged.patch reversed), the tree with the merge kernel alone
# (plan.patch reversed), this tree again.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/default_trace_h200/run3.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
SEL='quantkey[bits=4,tail_bits=2,tail_near=3]'
HERE=$PWD D=$PWD/results/decode/default_trace_h200
for t in merge before; do rm -rf /tmp/$t && mkdir /tmp/$t && cp -r hf_offload benchmarks /tmp/$t/; done
(cd /tmp/merge && patch -s -R -p1 < $D/plan.patch) || exit 1
(cd /tmp/before && patch -s -R -p1 < $D/plan.patch && patch -s -R -p1 < $D/merged.patch) || exit 1
date +%T
PYTHONPATH=$HERE timeout -s TERM 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_tail_merge.py \
  tests/test_tail.py tests/test_tail_near.py tests/test_kernel_tail.py > $OUT/pytest_tail_run3.txt 2>&1
echo "pytest rc=$? $(date +%T)"; tail -1 $OUT/pytest_tail_run3.txt; grep FAILED $OUT/pytest_tail_run3.txt | head -5
PYTHONPATH=$HERE timeout -s TERM 150 python3 benchmarks/bench_decode_step.py --context 65536 --batch 10 \
  --transfers kernel --graphs on --lookahead off --selector "$SEL" --admission auto --device-memory-gib 87 --steps 3 \
  --warmup 2 --profile 3 --profile-trace quantkey_mma --out /tmp/step_run3.json > /tmp/trace_run3.txt 2>&1
echo "trace rc=$?"; cp /tmp/step_run3.kernel.graphs-True.lookahead-False.prof.trace.json $OUT/decode_step_64k_b10_plan.trace.json
grep "kernels per" /tmp/trace_run3.txt | cut -c1-200
bench() {  # name, tree, commit label
  (cd $2 && HF_OFFLOAD_GIT_COMMIT="$3" PYTHONPATH=$2 timeout -s TERM 100 python3 benchmarks/bench_decode.py \
    --contexts 65536 --steps 48 --config-seconds 12 --max-seconds 90 --quantkey-selector "$SEL" --methods quantkey-auto \
    --batches 10 --out /tmp/bench_$1.json > /tmp/bench_$1.txt 2>&1)
  echo "$1 rc=$? $(date +%T)"; grep -E "^quantkey-auto +[0-9]" /tmp/bench_$1.txt | cut -c1-150
}
C=$HF_OFFLOAD_GIT_COMMIT
bench plan_a $HERE $C
bench before_b /tmp/before "$C with plan.patch and merged.patch reversed"
bench merge_c /tmp/merge "$C with plan.patch reversed"
bench plan_d $HERE $C
python3 -c "
import json
runs = {n: json.load(open(f'/tmp/bench_{n}.json')) for n in ('plan_a', 'before_b', 'merge_c', 'plan_d')}
json.dump(runs, open('$OUT/bench_decode_64k_b10_plan_ab.json', 'w'), indent=1)"
ls $OUT
