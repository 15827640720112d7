"""Slot assignment of the device slot pool (``hf_offload/kernels/slots.py``): the Triton kernel against the CUDA
kernel, in one run.

For each (batch, KV heads, slots, wanted blocks) shape it checks both kernels against the torch code over a sequence of
random assignments (slots, misses and the pool's state, bit for bit), then times each inside a CUDA graph of
``--calls`` assignments (median of ``--reps`` replays, per call) of a selection shared by the heads, half of it
resident. Prints one line per kernel and writes JSON (machine, versions, git commit, every timing) to ``--out``.

    python benchmarks/bench_slots_kernel.py --out results/selection/slots_h100.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import cuda_graph_us, run_metadata, write_results  # noqa: E402
from hf_offload.kernels import slots as slots_module  # noqa: E402
from hf_offload.store import DeviceSlotPool  # noqa: E402

SHAPES = [(1, 8, 160, 120), (4, 8, 160, 120), (12, 8, 160, 120), (1, 8, 256, 128), (1, 8, 256, 256)]
"""(batch, KV heads, slots, wanted blocks): the 8B shape's 8 KV heads with the default pool of a 2,048-token budget
(160 slots of 16 tokens: 5/4 of the budget) and its 120 selected blocks past the sink and window, at batch 1, 4 and
12; a pool of 256 slots, and one as wide as its selection."""


def _same_as_reference(batch: int, heads: int, slots: int, n: int, steps: int = 8) -> bool:
    """Whether the current kernel gives the torch code's slots, misses and pool state over ``steps`` assignments."""
    g = torch.Generator().manual_seed(slots + n)
    kernel = DeviceSlotPool(batch, slots, heads, 2, 4, torch.float32, "cuda")
    reference = DeviceSlotPool(batch, slots, heads, 2, 4, torch.float32, "cuda")
    reference.use_kernel = False
    for step in range(steps):
        blocks = torch.rand(batch, 1, 3 * slots, generator=g).argsort(-1)[..., :n].cuda()
        keep = (torch.rand(batch, 1, n, generator=g) > 0.1).cuda()
        touch = step % 4 != 3
        got, want = kernel.assign(blocks, keep, touch), reference.assign(blocks, keep, touch)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            return False
        if not (torch.equal(kernel.block, reference.block) and torch.equal(kernel.last_used, reference.last_used)):
            return False
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default="results/selection/bench_slots_kernel.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_slots_kernel: no CUDA device; nothing was measured")
    rows = []
    try:
        for batch, heads, slots, n in SHAPES:
            g = torch.Generator(device="cuda").manual_seed(0)
            # Two selections that share half their blocks, alternated: each call hits half and misses half.
            base = torch.randperm(4 * slots, device="cuda", generator=g)
            sets = [base[:n], torch.cat([base[: n // 2], base[2 * slots : 2 * slots + n - n // 2]])]
            wanted = [s.view(1, 1, n).expand(batch, 1, n).contiguous() for s in sets]
            keep = torch.ones(batch, 1, n, dtype=torch.bool, device="cuda")
            for name in ("triton", "cuda"):
                slots_module.BACKEND = name
                if not slots_module.assign_supported(torch.device("cuda"), slots, n):
                    continue
                same = _same_as_reference(batch, heads, slots, n)
                pool = DeviceSlotPool(batch, slots, heads, 2, 4, torch.float32, "cuda")
                us = cuda_graph_us(lambda i: pool.assign(wanted[i % 2], keep), args.calls, args.reps)
                print(f"batch {batch} heads {heads} slots {slots} wanted {n} {name:7s}: {us:7.2f} us  same {same}",
                      flush=True)  # fmt: skip
                rows.append({"batch": batch, "kv_heads": heads, "slots": slots, "wanted": n, "kernel": name,
                             "us": us, "same_as_reference": same})  # fmt: skip
    finally:
        slots_module.BACKEND = None
    write_results(args.out, {"metadata": run_metadata(args), "rows": rows})


if __name__ == "__main__":
    main()
