#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
export HF_OFFLOAD_GIT_COMMIT=$(cat .gpu/COMMIT)
export PYTHONPATH=$PWD
run() {  # name, selector, context, batch, seconds, limit
  timeout -s TERM $6 python3 -c "
import faulthandler, signal, sys, runpy
faulthandler.register(signal.SIGTERM, all_threads=True, chain=False)
sys.argv = ['bench_decode.py', '--contexts', '$3', '--methods', 'quantkey-auto', '--batches', '$4', '--steps', '96', '--quantkey-selector', '$2', '--config-seconds', '$5', '--max-seconds', '$(( $6 - 10 ))', '--out', '$OUT/bench_decode_$1.json']
runpy.run_path('benchmarks/bench_decode.py', run_name='__main__')
" > $OUT/l_$1.txt 2>&1; echo "$1 rc=$? $(date +%T)"; sleep 12
}
date +%T
run 64k_b12 quantkey 65536 12 40 90
run 64k_b16 quantkey 65536 16 40 100
run 64k_b12_default "quantkey[bits=4,tail_bits=2,tail_near=3]" 65536 12 40 100
run 128k_b6 quantkey 131072 6 40 120
run 128k_b8 quantkey 131072 8 40 130
run 128k_b10 quantkey 131072 10 40 140
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; h=r['host_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],2), 'median', round(r['step_ms_median'],2), 'steady', round(st.mean(s),2), 'host med', round(st.median(h),2), 'hit', round(r['hit_rate'] or 0,3), 'hostMB', round(r['host_recalled_bytes_per_step']/1e6,1), 'pk/pred', r['prediction'].get('peak_over_predicted') if isinstance(r.get('prediction'),dict) else '')" 2>&1 | tail -1; done
