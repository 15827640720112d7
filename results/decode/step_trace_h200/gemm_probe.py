"""Skinny products of the 8B shape at batch 12: cuBLAS (F.linear) against a Triton split-K kernel; row stats variants."""
import json, os, sys, itertools
from pathlib import Path
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent.parent))
from benchmarks.common import cuda_graph_us  # noqa: E402

@triton.jit
def skinny(x_ptr, w_ptr, out_ptr, ws_ptr, M, N, K, K_PER, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
           SPLIT: tl.constexpr):
    pn = tl.program_id(0)
    pk = tl.program_id(1)
    n = pn * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), tl.float32)
    k0 = pk * K_PER
    for k in range(k0, k0 + K_PER, BK):
        kk = k + tl.arange(0, BK)
        x = tl.load(x_ptr + m[:, None] * K + kk[None, :], mask=m[:, None] < M, other=0.0)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * K + kk[None, :])
        acc += tl.dot(x, tl.trans(w))
    if SPLIT == 1:
        tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m[:, None] < M)
    else:
        tl.store(ws_ptr + (pk * BM + m[:, None]) * N + n[None, :], acc)

@triton.jit
def reduce_k(ws_ptr, out_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), tl.float32)
    for s in range(SPLIT):
        acc += tl.load(ws_ptr + (s * BM + m[:, None]) * N + n[None, :])
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(out_ptr.dtype.element_ty), mask=m[:, None] < M)

def make(x, w, out, ws, BN, BK, SPLIT, stages, warps):
    M, K = x.shape; N = w.shape[0]
    kper = K // SPLIT
    def run():
        skinny[(N // BN, SPLIT)](x, w, out, ws, M, N, K, kper, BM=16, BN=BN, BK=BK, SPLIT=SPLIT,
                                 num_stages=stages, num_warps=warps)
        if SPLIT > 1:
            reduce_k[(N // 128,)](ws, out, M, N, BM=16, BN=128, SPLIT=SPLIT, num_warps=4)
    return run

dev = "cuda"
torch.manual_seed(0)
B = 12
shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
configs = [(16, 256, 1, 4, 4), (16, 256, 2, 4, 4), (32, 128, 1, 4, 4), (32, 256, 1, 3, 4), (32, 256, 2, 4, 4),
           (32, 256, 4, 3, 4), (64, 128, 1, 4, 4), (64, 128, 2, 4, 4), (64, 256, 1, 3, 4), (16, 512, 1, 3, 4),
           (16, 256, 4, 4, 4), (32, 128, 2, 5, 4), (64, 64, 1, 6, 4), (128, 64, 1, 4, 4), (32, 512, 1, 2, 4)]
rows = []
for name, (N, K) in shapes.items():
    copies = max(2, -(-400_000_000 // (N * K * 2)))
    ws_ = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(B, K, device=dev, dtype=torch.bfloat16)
    ref = F.linear(x, ws_[0]).float()
    out = torch.empty(B, N, device=dev, dtype=torch.bfloat16)
    us = cuda_graph_us(lambda i: F.linear(x, ws_[i % copies]), calls=20, reps=30)
    gb = N * K * 2 / 1e9
    rows.append({"shape": name, "kernel": "cublas", "us": us, "TBps": gb / us * 1e6 / 1e3})
    print(f"{name:8s} cublas {us:7.2f} us {gb/us*1e3:5.2f} TB/s", flush=True)
    best = None
    for BN, BK, SPLIT, st, wp in configs:
        if N % BN or K % (SPLIT * BK):
            continue
        wsbuf = torch.empty(SPLIT * 16, N, device=dev, dtype=torch.float32)
        runs = [make(x, w, out, wsbuf, BN, BK, SPLIT, st, wp) for w in ws_]
        try:
            runs[0](); torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item()
            us = cuda_graph_us(lambda i: runs[i % copies](), calls=20, reps=30)
        except Exception as e:  # noqa: BLE001
            print(name, BN, BK, SPLIT, st, "failed", str(e)[:100]); continue
        rows.append({"shape": name, "kernel": "triton", "BN": BN, "BK": BK, "SPLIT": SPLIT, "stages": st,
                     "warps": wp, "us": us, "TBps": gb / us * 1e3, "err": err, "programs": N // BN * SPLIT})
        print(f"{name:8s} triton BN={BN:3d} BK={BK:3d} S={SPLIT} st={st} {us:7.2f} us {gb/us*1e3:5.2f} TB/s err {err:.3g}", flush=True)
    del ws_

# row stats variants (block scores' first launch) at 12 x 32 rows x 4096 blocks
from hf_offload.kernels import mass
lse = torch.randn(12, 8, 4, 4096, device=dev)
valid = torch.ones(12, 4096, dtype=torch.bool, device=dev)
forced = torch.zeros(12, 4096, dtype=torch.bool, device=dev)
stats = torch.empty(12, 32, 2, device=dev)
v8 = valid.view(torch.uint8)
for blk, wp in itertools.product((512, 1024, 2048, 4096), (2, 4, 8, 16)):
    steps = triton.next_power_of_2(triton.cdiv(4096, blk))
    f = lambda i: mass._row_stats_kernel[(384,)](lse, v8, stats, 32, 4096, BLOCK=blk, STEPS=steps, num_warps=wp)
    us = cuda_graph_us(f, calls=20, reps=30)
    rows.append({"kernel": "row_stats", "BLOCK": blk, "warps": wp, "us": us})
    print(f"row_stats BLOCK={blk} warps={wp} {us:6.2f} us", flush=True)
us = cuda_graph_us(lambda i: mass.block_scores(lse, valid, forced), calls=20, reps=30)
rows.append({"kernel": "block_scores", "us": us}); print(f"block_scores (both launches) {us:.2f} us")
out = os.environ.get("OUT", "/tmp")
json.dump({"rows": rows, "torch": torch.__version__, "triton": triton.__version__,
           "device": torch.cuda.get_device_name(), "commit": os.environ.get("HF_OFFLOAD_GIT_COMMIT")},
          open(f"{out}/gemm_probe.json", "w"), indent=1)
