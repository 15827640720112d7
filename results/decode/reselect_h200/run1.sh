#!/bin/bash
# reselect_every on one H200: the CUDA tests of the reuse path, then plain quantkey (admission auto, layer graphs) at
# 64K tokens, batch 12, 8B shape (random bf16 weights, KV filled without a prefill), one process per setting, in the
# order reselect_every 1, 2, 3, 1.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> bash results/decode/reselect_h200/run1.sh
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
date +%T
timeout -s TERM 150 python3 -m pytest -q -p no:cacheprovider tests/test_reselect.py tests/test_layer_graphs.py -k "reuse or reselect or steps_between or query_independent or set_options or positive" \
  > $OUT/pytest_reselect.txt 2>&1
echo "pytest rc=$? $(date +%T)"; tail -3 $OUT/pytest_reselect.txt
for every in 1 2 3 1; do
  tag=r${every}_$(date +%H%M%S)
  timeout -s TERM 100 python3 benchmarks/bench_decode.py --contexts 65536 --steps 48 --config-seconds 12 --max-seconds 90 \
    --quantkey-selector quantkey --methods quantkey-auto --batches 12 --reselect-every $every \
    --out $OUT/bench_decode_64k_b12_$tag.json > /tmp/log_$tag.txt 2>&1
  echo "reselect_every=$every rc=$? $(date +%T)"; grep -E "^quantkey-auto +[0-9]|skip|Error" /tmp/log_$tag.txt | cut -c1-180
done
