#!/bin/bash
C=$(cat .gpu/COMMIT)
for a in paged pool; do
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 140 python3 benchmarks/bench_decode_step.py --context 65536 --batch 12 --selector quantkey --transfers kernel --admission auto --decode-attention $a --steps 6 --warmup 3 --profile 3 --out $OUT/decode_step_64k_b12_quantkey_$a.json > /tmp/s_$a.txt 2>&1; echo "$a rc=$?"; tail -4 /tmp/s_$a.txt | cut -c1-250
head -28 $OUT/decode_step_64k_b12_quantkey_$a.kernel.graphs-False.lookahead-False.prof.txt | cut -c1-57,100-175
done
