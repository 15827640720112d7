#!/bin/bash
# Final checks: every cuda test and the kernel tests at this commit, then 64K b12 plain quantkey.
set -u
export TOKENIZERS_PARALLELISM=false
C=$(cat .gpu/COMMIT)
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 100 python3 -m pytest -q -rfEs -p no:cacheprovider tests/test_kernel_slots.py tests/test_kernels.py > /tmp/pyt0.txt 2>&1
echo "pytest kernels rc=$?"; grep -v "Warning\|warn\|^  \|^$" /tmp/pyt0.txt | tail -4 | cut -c1-300
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 200 python3 -m pytest -m cuda -q -rfEs -p no:cacheprovider tests > /tmp/pyt.txt 2>&1
echo "pytest rc=$?"; grep -v "Warning\|warn\|^  \|^$" /tmp/pyt.txt | tail -10 | cut -c1-300
PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$C timeout 100 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 --steps 64 --quantkey-selector quantkey --config-seconds 50 --max-seconds 90 --out $OUT/bench_decode_64k_b12_quantkey_stats.json > /tmp/l.txt 2>&1; echo "bench rc=$?"
python3 -c "
import json,statistics as st; r=json.load(open('$OUT/bench_decode_64k_b12_quantkey_stats.json'))['runs'][0]; e=r['step_ms_each']; s=[x for i,x in enumerate(e) if i%16 not in (0,15)]; print(r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],2), 'median', round(r['step_ms_median'],2), 'steady', round(st.mean(s),2)); print([round(x) for x in e])"
