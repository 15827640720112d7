"""The scoring kernel with and without the ring's kstep swizzle (quantkey_mma.SWIZZLE) at 64K tokens, batch 12
(8B shape), 2 and 4 bits, alternating in one process: CUDA graphs of 10 launches over two input sets, median of 30
replays, three rounds; each kernel checked against the emulation first. Writes ``$OUT/swizzle_probe.json``.
Usage, from the repository root: ``python3 results/decode/step_trace_h200/swizzle_probe.py``."""
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.common import cuda_graph_us  # noqa: E402
from hf_offload.kernels import quantkey_mma as qm  # noqa: E402

dev = "cuda"
g = torch.Generator().manual_seed(0)
scale = 128 ** -0.5


def inputs(b, n, h, group, d, bits):
    codes = torch.randint(0, 256, (b, n, h, 16, d * bits // 8), dtype=torch.uint8, generator=g).to(dev)
    kmin = (torch.randn(b, n, h, d, generator=g) - 2).to(torch.bfloat16).to(dev)
    kstep = (torch.rand(b, n, h, d, generator=g) * 4 / ((1 << bits) - 1)).to(torch.bfloat16).to(dev)
    query = torch.randn(b, h, group, d, generator=g).to(torch.bfloat16).to(dev)
    return query, codes, kmin, kstep


rows = []
for bits in (2, 4):
    small = [inputs(2, 157, 2, gr, 128, bits) for gr in (4, 7)]
    sets = [inputs(12, 4096, 8, 4, 128, bits) for _ in range(2)]
    outs = [torch.empty(12, 8, 4, 4096, device=dev) for _ in range(2)]
    nbytes = sets[0][1].numel() + 2 * sets[0][2].numel() * 2
    for rnd in range(3):
        for swizzle in (True, False):
            qm.SWIZZLE = swizzle
            err = 0.0
            for q, c, kmn, kst in small:  # paired (4 heads) and unpaired (7) kernels
                o = torch.full((2, 2, q.shape[2], 157), float("nan"), device=dev)
                qm.launch(q, c, kmn, kst, o, 157, bits, scaling=scale)
                ref = qm.block_lse_emulated(q.float() * scale, c, kmn, kst, bits)
                err = max(err, (o - ref).abs().max().item())

            def fn(i):
                q, c, kmn, kst = sets[i]
                qm.launch(q, c, kmn, kst, outs[i], 4096, bits, scaling=scale)
            us = cuda_graph_us(lambda i: fn(i % 2))
            print(f"bits {bits} round {rnd} swizzle {swizzle}: {us:7.1f} us  {nbytes / us / 1e6:5.2f} TB/s  "
                  f"err {err:.2e}", flush=True)
            rows.append({"bits": bits, "round": rnd, "swizzle": swizzle, "us": us, "bytes": nbytes,
                         "max_err_vs_emulated": err})
    sets = outs = None
    torch.cuda.empty_cache()
meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
        "commit": os.environ.get("HF_OFFLOAD_GIT_COMMIT")}
json.dump({"meta": meta, "rows": rows}, open(f"{os.environ.get('OUT', '.')}/swizzle_probe.json", "w"), indent=1)
