"""Scoring kernel with kmin/kstep shared by KG blocks: correctness against the emulation, and time per call."""
import json
import os
import sys
import importlib.util
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hf_offload.kernels import quantkey_mma as new  # noqa: E402
from hf_offload.selectors.quantkey import quantize_keys  # noqa: E402

spec = importlib.util.spec_from_file_location("hf_offload.kernels.quantkey_mma_head",
                                              str(Path(__file__).parent / "quantkey_mma_head.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)

dev = "cuda"
torch.manual_seed(0)


def inputs(batch, n, heads, group, d, bits, kg):
    keys = torch.randn(batch, n, heads, 16, d, device=dev, dtype=torch.bfloat16)
    keys[..., :8] += 4.0  # a few offset channels
    codes = []
    kmins, ksteps = [], []
    # quantize per group of kg blocks: the group's range per channel
    kk = keys.unflatten(1, (n // kg, kg)).transpose(2, 3).flatten(3, 4)  # [B, n/kg, H, kg*16, D]
    q = quantize_keys(kk, bits)
    codes = q["codes"].unflatten(3, (kg, 16)).transpose(2, 3).flatten(1, 2).contiguous()  # [B, n, H, 16, D*b/8]
    kmin, kstep = q["kmin"].contiguous(), q["kstep"].contiguous()  # [B, n/kg, H, D]
    query = torch.randn(batch, heads, group, d, device=dev, dtype=torch.bfloat16)
    return query, codes, kmin, kstep


def timed(fn, calls=10, reps=30):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i % 2)
    for _ in range(3):
        g.replay()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    ts.sort()
    return ts[len(ts) // 2]


rows = []
scale = 128 ** -0.5
B, N = 12, 4096
for bits in (2, 4):
    for hm in (False, True):
        new.HEAD_MAJOR = hm
        qy, c, kmn, kst = inputs(2, 256, 8, 4, 128, bits, 1)
        out = torch.empty(2, 8, 4, 256, device=dev)
        new.launch(qy, c, kmn, kst, out, 256, bits, scaling=scale)
        ref = new.block_lse_emulated(qy.float() * scale, c, kmn, kst, bits)
        print(f"bits {bits} head-major {hm}: max |kernel - emulated| {(out - ref).abs().max().item():.2e}", flush=True)
    sets = [inputs(B, N, 8, 4, 128, bits, 1) for _ in range(2)]
    outs = [torch.empty(B, 8, 4, N, device=dev) for _ in range(2)]
    nbytes = sets[0][1].numel() + 2 * sets[0][2].numel() * 2
    variants = [("head", None, None, None)]
    for hm in (False, True):
        for warps in (4, 8):
            for st in (3, 4, 6):
                variants.append(("new", hm, warps, st))
    for name, hm, warps, st in variants:
        if name == "new":
            new.HEAD_MAJOR, new.WARPS, new.STAGES = hm, warps, st

        def fn(i=0):
            qy, c, kmn, kst = sets[i]
            (old if name == "head" else new).launch(qy, c, kmn, kst, outs[i], N, bits, scaling=scale)
        try:
            us = timed(fn)
        except Exception as e:
            print(name, hm, warps, st, "failed", e)
            continue
        ref = outs[0].clone(); fn(0); ok = torch.equal(ref, outs[0])
        print(f"bits {bits} {name} head-major {hm} warps {warps} stages {st}: {us:.1f} us, "
              f"{nbytes / us / 1e6:.2f} TB/s", flush=True)
        rows.append({"bits": bits, "kernel": name, "head_major": hm, "warps": warps, "stages": st, "us": us,
                     "bytes": nbytes})
    del sets, outs
    torch.cuda.empty_cache()
out = os.environ.get("OUT", ".")
json.dump({"rows": rows, "torch": torch.__version__, "device": torch.cuda.get_device_name()},
          open(f"{out}/layout_probe.json", "w"), indent=1)
