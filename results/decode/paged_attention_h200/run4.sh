#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
C=$(cat .gpu/COMMIT)
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 60 python3 benchmarks/bench_paged_kernel.py --batch 12 --repeats 30 --configs 8/4/0 8/4/0 4/4/0 --out $OUT/bench_paged_kernel_defaults_b12.json 2>&1 | tail -7
one() {  # tag attention selector
  PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 100 python3 benchmarks/bench_decode.py \
    --contexts 65536 --methods quantkey-auto --batches 12 --steps 64 --quantkey-selector "$3" --decode-attention $2 \
    --config-seconds 45 --max-seconds 90 --out $OUT/bench_decode_64k_b12_$1.json > /tmp/log_$1.txt 2>&1; echo "$1 rc=$?"
}
one quantkey_paged_a paged quantkey
one quantkey_pool_a pool quantkey
one quantkey_paged_b paged quantkey
one quantkey_pool_b pool quantkey
one default_paged_a paged "quantkey[bits=4,tail_bits=2,tail_near=3]"
one default_pool_a pool "quantkey[bits=4,tail_bits=2,tail_near=3]"
for f in $OUT/bench_decode_64k_b12_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],2), 'median', round(r['step_ms_median'],2), 'steady', round(st.mean(s),2), 'hit', round(r['hit_rate'] or 0,3), 'rec MB/step', round(r['recalled_bytes_per_step']/1e6,1))"; done
