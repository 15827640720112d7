#!/usr/bin/env bash
# Questions over one prefilled 32K prefix (Qwen2.5-Coder-1.5B shape, random bf16 weights), before (48ca749, unpacked
# with `git archive 48ca749 hf_offload benchmarks eval_harness | tar -x -C .devrun/base`) and after (7cc7303), two
# alternating rounds on one machine. Run from the repository root.
for round in 1 2; do
  for v in base new; do
    if [ $v = base ]; then dir=.devrun/base; else dir=.; fi
    PYTHONPATH=$PWD/$dir python $dir/benchmarks/bench_fork.py --shape qwen2.5-coder-1.5b --context 32768 \
      --questions 6 --new-tokens 16 --out results/prefix_sharing/fork_refill_h100/forks_${v}_$round.json
  done
done
