set -x
export HF_OFFLOAD_GIT_COMMIT=$(cat .gpu/COMMIT)
nvidia-smi --query-gpu=name,clocks.sm --format=csv
python -c "import torch; print(torch.__version__, hasattr(torch.cuda, '_compile_kernel'))"
timeout 200 python -m pytest -x -q tests/test_kernel_quantkey_mma.py 2>&1 | tail -25
python benchmarks/bench_quantkey_kernel.py --batch 12 --blocks 4096 --bits 2 --warps 4 --rows-per-thread 16 --out $OUT/bench_quantkey_kernel_mma_64k_b12_h200.json 2>&1 | tail -12
python benchmarks/bench_quantkey_kernel.py --bits 2 --warps 4 --rows-per-thread 16 --out $OUT/bench_quantkey_kernel_mma_32k_b8_h200.json 2>&1 | tail -8
