#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
export HF_OFFLOAD_GIT_COMMIT=$(cat .gpu/COMMIT)
export PYTHONPATH=$PWD
run() {  # name, scope, context, batch, seconds, limit
  timeout -s TERM $6 python3 -c "
import faulthandler, signal, sys, runpy
faulthandler.register(signal.SIGTERM, all_threads=True, chain=False)
sys.argv = ['bench_decode.py', '--contexts', '$3', '--methods', 'quantkey-auto', '--batches', '$4', '--steps', '64', '--quantkey-selector', 'quantkey', '--graph-scope', '$2', '--config-seconds', '$5', '--max-seconds', '$(( $6 - 10 ))', '--out', '$OUT/bench_decode_$1.json']
runpy.run_path('benchmarks/bench_decode.py', run_name='__main__')
" > $OUT/l_$1.txt 2>&1; echo "$1 rc=$? $(date +%T)"; sleep 2
}
date +%T
run 64k_b12_layer layer 65536 12 45 100
run 64k_b12_attention attention 65536 12 45 100
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],2), 'median', round(r['step_ms_median'],2), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3)); print([round(x,1) for x in e[:34]])"; done
tail -4 $OUT/l_64k_b12_layer.txt | cut -c1-400
timeout 230 python3 -m pytest -m cuda -x -q -rfEs -p no:cacheprovider tests/test_layer_graphs.py > $OUT/pytest_layer.txt 2>&1
echo "pytest rc=$?"; grep -E "^E |Error|passed|failed" $OUT/pytest_layer.txt | head -20 | cut -c1-300; tail -2 $OUT/pytest_layer.txt | cut -c1-300
