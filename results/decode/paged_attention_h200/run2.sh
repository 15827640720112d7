#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
C=$(cat .gpu/COMMIT)
PYTHONPATH=$PWD timeout 150 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernel_paged.py tests/test_cuda_graphs.py -k "paged or admission" > /tmp/pyt1.txt 2>&1
echo "pytest rc=$?"; grep -E "^E |Error|passed|failed" /tmp/pyt1.txt | head -40 | cut -c1-300
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 120 python3 benchmarks/bench_paged_kernel.py --batch 12 --configs 4/4/0 4/4/8 4/4/16 8/4/8 8/8/16 2/4/16 4/8/32 4/4/32 --out $OUT/bench_paged_kernel_b12.json 2>&1 | tail -12
one() {  # tag attention selector
  PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 110 python3 benchmarks/bench_decode.py \
    --contexts 65536 --methods quantkey-auto --batches 12 --steps 64 --quantkey-selector "$3" --decode-attention $2 \
    --config-seconds 45 --max-seconds 100 --out $OUT/bench_decode_64k_b12_$1.json > /tmp/log_$1.txt 2>&1; echo "$1 rc=$?"; tail -3 /tmp/log_$1.txt | cut -c1-300
}
one quantkey_paged_c paged quantkey
one quantkey_pool_c pool quantkey
for f in $OUT/bench_decode_64k_b12_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],2), 'median', round(r['step_ms_median'],2), 'steady', round(st.mean(s),2), 'hit', round(r['hit_rate'] or 0,3), 'rec MB/step', round(r['recalled_bytes_per_step']/1e6,1))"; done
