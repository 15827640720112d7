"""Time the scoring kernel's PASSES / PAIR variants at 64K tokens, batch 12 (8B shape), 2 and 4 bits, in CUDA graphs
of 10 launches over two input sets (median of 30 replays); check each against the emulation first.

``VARIANTS_SET`` picks the list of one call (``variants_<set>.json`` in this folder; a variant is (passes, pair,
ring depth, warps, register cap, fast log)): ``23d1d8f``, ``73e751b`` or ``153c9ce`` (the default), or
``defaults`` for the library's defaults alone. Usage, from the repository root:
``VARIANTS_SET=153c9ce python3 results/selection/pair_h200/variants.py`` (writes ``$OUT/variants.json``)."""
import ctypes
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


def inputs(b, n, h, group, d, bits):
    codes = torch.randint(0, 256, (b, n, h, 16, d * bits // 8), dtype=torch.uint8, generator=g).to(dev)
    kmin = (torch.randn(b, n, h, d, generator=g) - 2).to(torch.bfloat16).to(dev)
    kstep = (torch.rand(b, n, h, d, generator=g) * 4 / ((1 << bits) - 1)).to(torch.bfloat16).to(dev)
    query = torch.randn(b, h, group, d, generator=g).to(torch.bfloat16).to(dev)
    return query, codes, kmin, kstep


def regs(head_dim, bits, group):
    try:
        fn = qm._kernel(head_dim, bits, "subnormal", group, True)
        func = getattr(fn, "func", None) or getattr(fn, "_func", None)
        cuda = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        handle = func.value if isinstance(func, ctypes.c_void_p) else int(func)
        cuda.cuFuncGetAttribute(ctypes.byref(v), 4, ctypes.c_void_p(handle))  # CU_FUNC_ATTRIBUTE_NUM_REGS
        return v.value
    except Exception as e:
        return f"? {type(e).__name__}"


scale = 128 ** -0.5
SETS = {
    # (the kernels of 23d1d8f and 73e751b had no FAST_LOG: logf, as False)
    "23d1d8f": [(p, pair, st, 4, 0, False) for p, pair, st in
                [(1, False, 3), (2, False, 3), (4, False, 3), (1, True, 3), (2, True, 3), (4, True, 3), (1, True, 2),
                 (2, True, 2), (8, False, 3), (8, True, 3)]],
    "73e751b": [(1, False, 3, 4, 0, False), (2, False, 3, 4, 0, False), (1, True, 2, 4, 0, False),
                (1, True, 3, 4, 0, False), (2, True, 2, 4, 0, False), (4, True, 2, 4, 0, False),
                (1, True, 2, 8, 0, False), (1, True, 2, 4, 7, False), (2, True, 2, 4, 7, False),
                (1, True, 4, 4, 0, False), (2, True, 2, 8, 0, False)],
    "153c9ce": [(1, False, 3, 4, 0, False), (1, True, 2, 4, 0, False), (1, True, 2, 4, 0, True),
                (2, True, 2, 4, 0, True), (1, False, 3, 4, 0, True)],
    "defaults": [(qm.PASSES, qm.PAIR, qm.PAIR_STAGES, qm.WARPS, qm.MIN_BLOCKS, qm.FAST_LOG)],
}
variants = SETS["defaults" if os.environ.get("VARIANTS_ONLY_DEFAULTS") else os.environ.get("VARIANTS_SET", "153c9ce")]
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
        us = cuda_graph_us(lambda i: fn(i % 2))
        r = regs(128, bits, 4)
        print(f"bits {bits} passes {passes} pair {pair} stages {st} warps {warps} minblocks {mb} fastlog {fl}: "
              f"{us:7.1f} us  {nbytes / us / 1e6:5.2f} TB/s  err {err:.2e}  regs {r}", flush=True)
        rows.append({"bits": bits, "passes": passes, "pair": pair, "stages": st, "warps": warps, "min_blocks": mb,
                     "fast_log": fl, "us": us, "bytes": nbytes, "max_err_vs_emulated": err, "regs": r})
    sets = outs = None  # (freed before the next bit width's inputs)
    torch.cuda.empty_cache()
meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(),
        "commit": os.environ.get("HF_OFFLOAD_GIT_COMMIT")}
json.dump({"meta": meta, "rows": rows}, open(f"{os.environ.get('OUT', '.')}/variants.json", "w"), indent=1)
