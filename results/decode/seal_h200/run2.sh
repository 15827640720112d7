#!/bin/bash
# On one H200, in order: the seal kernel (one launch per layer's seal with plain quantkey: hf_offload/kernels/seal.py)
# inside the captured seal. 64K tokens / batch 12 (plain quantkey, admission auto, whole-layer graphs): twice with
# captured seals, once op by op; 128K / batch 6 twice with captured seals; then the CUDA tests of the seal kernel,
# the whole-layer graphs and the attention graphs.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/seal_h200/run2.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
bench() {  # name, seal graphs, context, batch, limit
  timeout -s TERM $5 python3 benchmarks/bench_decode.py --contexts $3 --methods quantkey-auto --batches $4 \
    --steps 64 --quantkey-selector quantkey --seal-graphs $2 --config-seconds 30 --max-seconds $(( $5 - 10 )) \
    --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1
  rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 1
}
bench 64k_b12_on_r1 on 65536 12 80
bench 64k_b12_off off 65536 12 80
bench 64k_b12_on_r2 on 65536 12 80
bench 128k_b6_on_r1 on 131072 6 90
bench 128k_b6_on_r2 on 131072 6 90
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'seal steps', [round(e[i],2) for i in range(len(e)) if i%16==15], 'host', [round(h[i],1) for i in range(len(h)) if i%16==15], 'seals', r['stats'].get('seal_graph_captures'), r['stats'].get('seal_graph_replays'))"; done
timeout 330 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_kernel_seal.py tests/test_layer_graphs.py \
  tests/test_cuda_graphs.py > $OUT/pytest_cuda_run2.txt 2>&1; echo "pytest rc=$?"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_cuda_run2.txt | tail -8 | cut -c1-300
date +%T
