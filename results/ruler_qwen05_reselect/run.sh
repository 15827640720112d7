#!/bin/bash
# RULER on Qwen2.5-Coder-0.5B-Instruct (11 tasks x 50 samples, 4K / 8K / 16K, budget 1/16) with plain quantkey at
# reselect_every 1, 2 and 3: three processes on one GPU, one study each.
# Inputs: the GGUF's eight pieces (split -b 61425008 -d: p00..p07) in $PIECES, the gguf wheel in $WHEELS.
# Usage: HF_OFFLOAD_GIT_COMMIT=<sha> PIECES=dir WHEELS=dir bash results/ruler_qwen05_reselect/run.sh
set -u
PIECES=${PIECES:-/tmp/q} WHEELS=${WHEELS:-.xfer/w}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
date +%T
mkdir -p /tmp/q && cat "$PIECES"/p0? > /tmp/q/qwen05.gguf && ls -l /tmp/q/qwen05.gguf
echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  /tmp/q/qwen05.gguf" | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
[ -f /tmp/qwen05-hf/config.json ] || python3 -c "from hf_offload.models import convert_gguf; convert_gguf('/tmp/q/qwen05.gguf', '/tmp/qwen05-hf')" || exit 1
date +%T
ev() {  # reselect_every
  timeout -s TERM ${LIMIT:-440} python3 -m hf_offload.cli eval recipes/ruler_qwen05_tail.yaml \
    --set model=/tmp/qwen05-hf --set study=ruler_qwen05_reselect$1 --set 'methods=["quantkey"]' \
    --set "lengths=[4096,8192,16384]" --set batch_size=50 --set prefill_chunk_size=null --set offload.reselect_every=$1 \
    --set results_dir=/tmp/res_$1 --set report_dir=/tmp/rep_$1 --set plots=false > "$OUT/log_reselect$1.txt" 2>&1
  echo "reselect_every=$1 rc=$? $(date +%T)"
}
ev 1 & sleep 15; ev 2 & sleep 15; ev 3 &
wait
date +%T
for r in 1 2 3; do cat /tmp/res_$r/ruler_qwen05_reselect$r/*.jsonl > $OUT/ruler_qwen05_reselect$r.jsonl; done  # committed in ../ruler_qwen05_reselect1..3/
tail -n 2 "$OUT"/log_*.txt; ls -l "$OUT"
