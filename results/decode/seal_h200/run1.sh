#!/bin/bash
# On one H200, in order: the CUDA tests of the kernels changed in 32293d7 and c18c89a (tested then on the CPU
# only: norm and MLP store helper, the gated MLP's Triton gate, the scoring kernel's compile key) and of the
# whole-layer graphs (seals from captured graphs now); then 64K tokens / batch 12 (plain quantkey, admission auto,
# whole-layer graphs) with the seals after replayed steps captured (on) and op by op (off), each 64 timed steps and
# 32 more under cProfile (two seals of every layer), and 128K / batch 6 with them on.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/seal_h200/run1.sh
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date +%T
bench() {  # name, seal graphs, context, batch, limit
  timeout -s TERM $5 python3 benchmarks/bench_decode.py --contexts $3 --methods quantkey-auto --batches $4 \
    --steps 64 --quantkey-selector quantkey --seal-graphs $2 --config-seconds 30 --max-seconds $(( $5 - 10 )) \
    --profile-seal 32 --out $OUT/bench_decode_$1.json > /tmp/l_$1.txt 2>&1
  rc=$?; echo "$1 rc=$rc $(date +%T)"; [ $rc = 0 ] || tail -5 /tmp/l_$1.txt | cut -c1-300; sleep 1
}
bench 64k_b12_on on 65536 12 80
bench 64k_b12_off off 65536 12 80
bench 128k_b6_on on 131072 6 90
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'seal steps', [round(e[i],2) for i in range(len(e)) if i%16==15], 'host', [round(h[i],1) for i in range(len(h)) if i%16==15], 'seal replays', r['stats'].get('seal_graph_replays'))"; done
for f in $OUT/*host_profile.txt; do echo "== $f"; head -1 $f; grep -E "\(_seal_replayed\)|\(_seal\)|\(_seal_from\)|\(_run_decoder_layer\)|\(replay_layer\)|\(finish_step\)" $f | head -8 | cut -c1-160; done
timeout 300 python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests/test_kernel_norm.py tests/test_fused_norms.py \
  tests/test_fused_projections.py tests/test_kernel_quantkey_mma.py tests/test_layer_graphs.py \
  > $OUT/pytest_cuda_run1.txt 2>&1; echo "pytest rc=$?"
grep -E "^E |FAILED|passed|failed" $OUT/pytest_cuda_run1.txt | tail -8 | cut -c1-300
date +%T
