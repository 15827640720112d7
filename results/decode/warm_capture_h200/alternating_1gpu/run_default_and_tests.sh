#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$(cat .gpu/COMMIT)
timeout 100 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 --steps 48 \
  --quantkey-selector "quantkey[bits=4,tail_bits=2,tail_near=3]" --config-seconds 30 --max-seconds 90 \
  --out $OUT/bench_decode_64k_b12_default_warm.json > $OUT/log_default.txt 2>&1; echo "default rc=$?"
python3 -c "
import json; r=json.load(open('$OUT/bench_decode_64k_b12_default_warm.json'))['runs'][0]; s=r['stats']; print(r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],1), 'median', round(r['step_ms_median'],1), 'capture ms', s['graph_capture_ms'], s['graph_captures']); print([round(x) for x in r['step_ms_each']])"
timeout 300 python3 -m pytest -m cuda -q -rfEs -p no:cacheprovider tests 2>&1 | grep -v "Warning\|warn\|^  \|^$" | tail -12
echo "pytest rc=${PIPESTATUS[0]}"
