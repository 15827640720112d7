#!/bin/bash
set -u
export TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD HF_OFFLOAD_GIT_COMMIT=$(cat .gpu/COMMIT)
timeout 70 python3 benchmarks/bench_estimate_path.py --context 65536 --batch 12 --out $OUT/bench_estimate_path_64k_b12_index_h200.json 2>&1 | tail -14
timeout 75 python3 -m pytest -q -p no:cacheprovider tests/test_kernel_tail.py tests/test_tail_near.py -k "index or selector_estimate or default_kernel or near or bounded" 2>&1 | grep -v "Warn\|warn\|^  \|^$" | tail -4
echo "pytest rc=${PIPESTATUS[0]}"
timeout 80 python3 benchmarks/bench_decode.py --contexts 65536 --methods quantkey-auto --batches 12 --steps 32 \
  --quantkey-selector "quantkey[bits=4,tail_bits=2,tail_near=3]" --config-seconds 30 --max-seconds 70 \
  --out $OUT/bench_decode_64k_b12_default_index_h200.json > $OUT/log_default.txt 2>&1; echo "default rc=$?"
python3 -c "
import json; r=json.load(open('$OUT/bench_decode_64k_b12_default_index_h200.json'))['runs'][0]; s=r['stats']; print(r['steps'], round(r['tokens_per_s'],1), round(r['step_ms'],1), 'median', round(r['step_ms_median'],1), 'capture ms', s['graph_capture_ms'], s['graph_captures']); print([round(x) for x in r['step_ms_each']])"
