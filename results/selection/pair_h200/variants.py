"""Time the scoring kernel's PASSES / PAIR variants at 64K tokens, batch 12 (8B shape), 2 and 4 bits, in CUDA graphs
of 10 launches over two input sets (median of 30 replays); check each against the emulation first."""
import ctypes
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from hf_offload.kernels import quantkey_mma as qm  # noqa: E402

dev = "cuda"
g = torch.Generator().manual_seed(0)


def inputs(b, n, h, group, d, bits):
    codes = torch.randint(0, 256, (b, n, h, 16, d * bits // 8), dtype=torch.uint8, generator=g).to(dev)
    kmin = (torch.randn(b, n, h, d, generator=g) - 2).to(torch.bfloat16).to(dev)
    kstep = (torch.rand(b, n, h, d, generator=g) * 4 / ((1 << bits) - 1)).to(torch.bfloat16).to(dev)
    query = torch.randn(b, h, group, d, generator=g).to(torch.bfloat16).to(dev)
    return query, codes, kmin, kstep


def timed(fn, calls=10, reps=30):
    fn(0); torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % 2)
    for _ in range(3):
        graph.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    ts.sort()
    return ts[len(ts) // 2]


def regs(head_dim, bits, group):
    try:
        fn = qm._kernel(head_dim, bits, "subnormal", group, True)
        func = getattr(fn, "func", None) or getattr(fn, "_func", None)
        cuda = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        cuda.cuFuncGetAttribute(ctypes.byref(v), 4, ctypes.c_void_p(int(func) if not isinstance(func, ctypes.c_void_p) else func.value))
        return v.value
    except Exception as e:
        return f"? {type(e).__name__}"


scale = 128 ** -0.5
variants = [(1, False, 3, 4, 0, False), (1, True, 2, 4, 0, False), (1, True, 2, 4, 0, True), (2, True, 2, 4, 0, True),
            (1, False, 3, 4, 0, True)]
if os.environ.get("VARIANTS_ONLY_DEFAULTS"):  # the library's defaults alone
    variants = [(qm.PASSES, qm.PAIR, qm.PAIR_STAGES, qm.WARPS, qm.MIN_BLOCKS, qm.FAST_LOG)]
rows = []
for bits in (2, 4):
    small = inputs(2, 157, 2, 4, 128, bits)
    sets = [inputs(12, 4096, 8, 4, 128, bits) for _ in range(2)]
    outs = [torch.empty(12, 8, 4, 4096, device=dev) for _ in range(2)]
    nbytes = sets[0][1].numel() + 2 * sets[0][2].numel() * 2
    for passes, pair, st, warps, mb, fl in variants:
        qm.PASSES, qm.PAIR, qm.STAGES, qm.WARPS, qm.MIN_BLOCKS, qm.FAST_LOG = passes, pair, st, warps, mb, fl
        qm.PAIR_STAGES = st
        q, c, kmn, kst = small
        o = torch.full((2, 2, 4, 157), float("nan"), device=dev)
        qm.launch(q, c, kmn, kst, o, 157, bits, scaling=scale)
        ref = qm.block_lse_emulated(q.float() * scale, c, kmn, kst, bits)
        err = (o - ref).abs().max().item()

        def fn(i):
            q, c, kmn, kst = sets[i]
            qm.launch(q, c, kmn, kst, outs[i], 4096, bits, scaling=scale)
        us = timed(fn)
        r = regs(128, bits, 4)
        print(f"bits {bits} passes {passes} pair {pair} stages {st} warps {warps} minblocks {mb} fastlog {fl}: {us:7.1f} us  {nbytes / us / 1e6:5.2f} TB/s  "
              f"err {err:.2e}  regs {r}", flush=True)
        rows.append({"bits": bits, "passes": passes, "pair": pair, "stages": st, "warps": warps, "min_blocks": mb, "fast_log": fl, "us": us, "bytes": nbytes,
                     "max_err_vs_emulated": err, "regs": r})
    del sets, outs
    torch.cuda.empty_cache()
meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "commit": os.environ.get("HF_OFFLOAD_GIT_COMMIT")}
json.dump({"meta": meta, "rows": rows}, open(f"{os.environ.get('OUT', '.')}/variants.json", "w"), indent=1)
