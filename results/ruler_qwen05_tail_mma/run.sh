#!/bin/bash
# Assemble the Qwen2.5-Coder-0.5B GGUF from /tmp/q/p00..p07, convert once, then RULER with the default selector:
# tensor-core estimate (4K, 8K, 16K) and the Triton `dot` estimate (4K, 8K), three processes on one GPU.
# Inputs: the GGUF's eight pieces (split -b 61425008 -d: p00..p07) in $PIECES, the gguf wheel in $WHEELS. The `dot`
# estimate at 16K ran after this script, the same `ev` with HF_OFFLOAD_TAIL_KERNEL=dot and lengths [16384] alone
# (results in ../ruler_qwen05_tail_dot/). Usage: PIECES=dir WHEELS=dir bash results/ruler_qwen05_tail_mma/run.sh
set -u
PIECES=${PIECES:-/tmp/q} WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_OFFLOAD_GIT_COMMIT=3c38d7853355a6b3301cd93178a5bffb980e83c2
date +%T
mkdir -p /tmp/q && cat "$PIECES"/p0? > /tmp/q/qwen05.gguf && ls -l /tmp/q/qwen05.gguf
echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  /tmp/q/qwen05.gguf" | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
[ -f /tmp/qwen05-hf/config.json ] || python3 -c "from hf_offload.models import convert_gguf; convert_gguf('/tmp/q/qwen05.gguf', '/tmp/qwen05-hf')" || exit 1
date +%T; nvidia-smi --query-gpu=memory.used --format=csv
SEL='quantkey[bits=4,tail_bits=2,tail_near=3]'
ev() {  # study, kernel, lengths
  HF_OFFLOAD_TAIL_KERNEL=$2 timeout -s TERM ${LIMIT:-430} python3 -m hf_offload.cli eval recipes/ruler_qwen05_tail.yaml \
    --set model=/tmp/qwen05-hf --set study=$1 --set "methods=[\"$SEL\"]" --set "lengths=$3" --set batch_size=50 \
    --set prefill_chunk_size=null --set results_dir=/tmp/res_$2 --set report_dir=/tmp/rep_$2 --set plots=false \
    > "$OUT/log_$1_$2_${3//[^0-9]/_}.txt" 2>&1
  echo "$1 $2 $3 rc=$? $(date +%T)"
}
ev ruler_qwen05_tail_mma mma "[16384]" &
sleep 20; ev ruler_qwen05_tail_mma mma "[4096,8192]" &
sleep 20; ev ruler_qwen05_tail_dot dot "[4096,8192]" &
wait
date +%T
cat /tmp/res_mma/ruler_qwen05_tail_mma/*.jsonl > $OUT/ruler_qwen05_tail_mma.jsonl
cat /tmp/res_dot/ruler_qwen05_tail_dot/*.jsonl > $OUT/ruler_qwen05_tail_dot.jsonl
cp /tmp/rep_mma/*.md /tmp/rep_dot/*.md $OUT/ 2>/dev/null
tail -n 3 "$OUT"/log_*.txt; ls -l "$OUT"
