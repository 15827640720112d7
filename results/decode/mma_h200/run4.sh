#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false
export HF_OFFLOAD_GIT_COMMIT=$(cat .gpu/COMMIT)
export PYTHONPATH=$PWD
nvidia-smi --query-compute-apps=pid,used_memory --format=csv; free -g | head -2; uptime
run() {  # name, context, batch, seconds, limit
  timeout -s TERM $5 python3 -c "
import faulthandler, signal, sys, runpy
faulthandler.register(signal.SIGTERM, all_threads=True, chain=False)
sys.argv = ['bench_decode.py', '--contexts', '$2', '--methods', 'quantkey-auto', '--batches', '$3', '--steps', '64', '--quantkey-selector', 'quantkey', '--config-seconds', '$4', '--max-seconds', '$(( $5 - 10 ))', '--out', '$OUT/bench_decode_$1.json']
runpy.run_path('benchmarks/bench_decode.py', run_name='__main__')
" > $OUT/l_$1.txt 2>&1; echo "$1 rc=$? $(date +%T)"; sleep 2; timeout -s KILL 5 sleep 10
}
date +%T
run 64k_b12_mma_a 65536 12 45 90
run 128k_b10_mma 131072 10 60 160
free -g | head -2; uptime; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
sleep 20
run 64k_b12_mma_b 65536 12 45 90
for f in $OUT/bench_decode_*.json; do python3 -c "
import json,statistics as st; r=json.load(open('$f'))['runs'][0]; e=r['step_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print('$f'.split('/')[-1], r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],2), 'median', round(r['step_ms_median'],2), 'steady', round(st.mean(s),2), 'hit', round(r['hit_rate'] or 0,3), 'rec MB/step', round(r['recalled_bytes_per_step']/1e6,1), 'fill_s', round(r['fill_s'],1))"; done
grep -B2 -A30 "Thread\|Current thread" $OUT/l_128k_b10_mma.txt | head -60
