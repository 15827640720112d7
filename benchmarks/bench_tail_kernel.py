"""The tail-estimate kernel (attention over quantized keys and values of the unselected blocks), timed on CUDA.

For one decode shape (default: Llama-3.1-8B, batch 8, 8 KV heads of 4 query heads each, 2048 blocks of 16 tokens,
head_dim 128, all but 127 blocks in the tail) it times, in one run:

* ``kernel``: ``hf_offload.kernels.tail.tail_attention`` for each ``--bits`` pair (keys, values): where it runs,
  the tensor-core kernel (``mma``, ``hf_offload.kernels.tail_mma``) at its defaults, at each ``--mma-warps``,
  ``--mma-blocks-per-warp`` and ``--mma-stages`` (``/s`` in its name), and at its defaults again after everything
  else; the ``dot``
  kernel (TF32 products) at each ``--blocks-per-program`` (the split of a sequence's blocks over programs; ``*``
  marks the default), again at each ``--num-warps`` and ``--num-stages``, then at the default split the ``dot``
  kernel with exact float32 products (``dot-ieee``) and the first kernel (``loop``; the only one where the ``dot``
  kernel's tiles do not fit). ``us``: the whole call, the merge of the kernel's ranges (torch operations) included;
  ``kernel us`` (``partials_us``): ``tail_partials``, the kernel without that merge (a decode step merges the ranges
  in one launch of its own, ``tail_attention_merged``);
* ``reference``: the pure-torch ``tail_attention_reference`` (what runs without Triton);
* ``scoring``: the ``quantkey`` scoring kernel over the same key codes (``block_lse``), which every step runs anyway;
* ``dense``: ``scaled_dot_product_attention`` over the same tokens in bf16 (what attending to them exactly on the
  device would cost, were they resident).

Kernels and scoring: ``--calls`` calls captured into one CUDA graph, CUDA events around each of ``--reps`` replays
(the device's time alone, as in a decode step), median, after ``--warmup``; the reference and dense attention: CUDA
events around the calls themselves; each kernel result is checked
against the reference (largest absolute difference of output and log-sum-exp). Prints a table (microseconds per
call; GB/s of the summary bytes read) and writes JSON (machine, versions, git commit, settings, timings) to ``--out``.

    python benchmarks/bench_tail_kernel.py --out results/selection/bench_tail_kernel_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import run_metadata, write_results  # noqa: E402

NO_CUDA = ("bench_tail_kernel: no CUDA device with Triton (and not under TRITON_INTERPRET=1); nothing was "
           "measured")


def _time(fn, calls: int, reps: int, warmup: int, graph: bool = False) -> float:
    """Median microseconds per call of ``fn()`` over ``reps`` timings of ``calls`` calls (CUDA events; wall
    time off CUDA). With ``graph`` (CUDA only) the ``calls`` calls are captured into one CUDA graph and each timing
    is one replay: the device's time alone, as a decode step's graphs run it, without the host's launch cost."""
    for _ in range(warmup):
        fn()
    if graph and torch.cuda.is_available():
        fn()  # (compiles and allocates before the capture)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        g.replay()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000 / calls)
        return statistics.median(times)
    times = []
    for _ in range(reps):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / calls)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--blocks", type=int, default=2048, help="blocks per sequence")
    p.add_argument("--selected", type=int, default=127, help="blocks left out of the tail (the selection)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bits", nargs="+", default=["2,2", "4,2", "4,4"], help="key bits,value bits pairs")
    p.add_argument("--blocks-per-program", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--num-warps", type=int, nargs="*", default=[2, 8],
                   help="warps per program to try (dot kernel, default split) besides Triton's default")
    p.add_argument("--num-stages", type=int, nargs="*", default=[1, 3],
                   help="software-pipelining stages to try (dot kernel, default split)")
    p.add_argument("--near", type=int, default=0,
                   help="estimate only this many blocks per sequence, read through an index (the default selector's "
                        "bounded estimate: 3 x the selected blocks); 0: every block but the selected ones")
    p.add_argument("--mma-warps", type=int, nargs="*", default=[2, 4, 8],
                   help="warps per program of the tensor-core kernel to time besides its default")
    p.add_argument("--mma-blocks-per-warp", type=int, nargs="*", default=[8, 16, 32],
                   help="blocks per warp of the tensor-core kernel to time besides its default")
    p.add_argument("--mma-stages", type=int, nargs="*", default=[0],
                   help="ring depths of the tensor-core kernel to time besides its default (0: no ring)")
    p.add_argument("--mma-configs", nargs="*", default=[], metavar="WARPS,BLOCKS,STAGES",
                   help="further settings of the tensor-core kernel to time, each warps per program, blocks per "
                        "warp and ring depth")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from hf_offload.kernels.gather import kernels_available

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not kernels_available(dev):  # the CPU only under Triton's interpreter (tests; its timings mean nothing)
        print(NO_CUDA, file=sys.stderr)
        return 2
    from hf_offload.kernels import tail, tail_mma
    from hf_offload.kernels.quantkey import block_lse
    from hf_offload.kernels.quant import quantize_keys

    B, n, H, G, T, D = args.batch, args.blocks, args.kv_heads, args.group, args.tokens, args.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    keys = torch.randn(B, n, H, T, D, device=dev, generator=g, dtype=torch.bfloat16)
    values = torch.randn(B, n, H, T, D, device=dev, generator=g, dtype=torch.bfloat16)
    query = torch.randn(B, H, G, D, device=dev, generator=g) * D**-0.5
    ok = torch.ones(B, n, T, dtype=torch.bool, device=dev)
    picked = torch.randperm(n, device=dev, generator=g)[: args.selected]
    ok[:, picked] = False
    index = None
    if args.near:  # random distinct blocks per sequence, every token attended
        index = torch.stack([torch.randperm(n, device=dev, generator=g)[: args.near] for _ in range(B)])
        ok = torch.ones(B, args.near, T, dtype=torch.bool, device=dev)
    rows = []
    for pair in args.bits:
        kb, vb = (int(x) for x in pair.split(","))
        kq, vq = quantize_keys(keys, kb), quantize_keys(values, vb)
        nbytes = sum(t.numel() * t.element_size() for t in (*kq.values(), *vq.values()))
        if index is not None:
            rows_ = torch.arange(B, device=dev)[:, None]
            near_k, near_v = ({k: v[rows_, index] for k, v in part.items()} for part in (kq, vq))
        else:
            near_k, near_v = kq, vq
        ref_out, ref_lse = tail.tail_attention_reference(query, near_k, kb, near_v, vb, ok)
        entry = {"key_bits": kb, "value_bits": vb, "summary_bytes": nbytes, "kernel": {}}
        default = tail.BLOCKS_PER_PROGRAM
        runs = [("loop", "ieee", default, None, None)]
        if tail.dot_kernel_fits(T, D, kb, vb):  # else only the first kernel runs at this shape
            runs = [("dot", "tf32", per, None, None) for per in args.blocks_per_program]
            runs += [("dot", "tf32", default, w, None) for w in args.num_warps]
            runs += [("dot", "tf32", default, None, st) for st in args.num_stages]
            runs += [("dot", "ieee", default, None, None), ("loop", "ieee", default, None, None)]
        if tail_mma.mma_supported(query, kq, kb, vq, vb, index is not None):  # the tensor-core kernel's settings
            base = (tail_mma.WARPS, tail_mma.BLOCKS_PER_WARP, tail_mma.STAGES)
            first = [("mma", "bf16", base[1], base[0], None)]
            first += [("mma", "bf16", base[1], w, None) for w in args.mma_warps if w != base[0]]
            first += [("mma", "bf16", per, base[0], None) for per in args.mma_blocks_per_warp if per != base[1]]
            first += [("mma", "bf16", base[1], base[0], st) for st in args.mma_stages if st != base[2]]
            for config in args.mma_configs:
                w, per, st = (int(x) for x in config.split(","))
                first.append(("mma", "bf16", per, w, st))
            runs = first + runs + first[:1]  # its default first and last (the drift within the run)
        for variant, precision, per, warps, stages in runs:
            if variant == "mma":
                tail_mma.WARPS, tail_mma.BLOCKS_PER_WARP = warps, per
                tail_mma.STAGES = base[2] if stages is None else stages
            settings = dict(blocks_per_program=per, variant=variant,
                            precision="tf32" if variant == "mma" else precision,
                            num_warps=None if variant == "mma" else warps,
                            num_stages=None if variant == "mma" else stages, index=index)  # fmt: skip
            fn = lambda: tail.tail_attention(query, kq, kb, vq, vb, ok, **settings)  # noqa: E731
            out, lse = fn()
            err = max(float((out - ref_out).abs().max()), float((lse - ref_lse).abs().max()))
            us = _time(fn, args.calls, args.reps, args.warmup, graph=True)
            # The kernel alone: its ranges' partial softmaxes, unmerged (the decode step merges them in one launch of
            # its own, tail_attention_merged; tail_attention merges them with torch operations, counted in `us`).
            partials_us = _time(lambda: tail.tail_partials(query, kq, kb, vq, vb, ok, **settings), args.calls,
                                args.reps, args.warmup, graph=True)  # fmt: skip
            name = variant if precision in ("tf32", "bf16") or variant == "loop" else f"{variant}-{precision}"
            key = f"{name}/{per}" + (f"/w{warps}" if warps else "") + (f"/s{stages}" if stages is not None else "")
            key += "/again" if key in entry["kernel"] else ""
            entry["kernel"][key] = {"variant": variant, "precision": precision, "blocks_per_program": per,
                                    "num_warps": warps, "num_stages": stages, "us": us, "partials_us": partials_us,
                                    "gb_per_s": nbytes / us / 1e3,
                                    "max_error": err}  # fmt: skip
        if tail_mma.mma_supported(query, kq, kb, vq, vb, index is not None):
            tail_mma.WARPS, tail_mma.BLOCKS_PER_WARP, tail_mma.STAGES = base
        entry["reference_us"] = _time(lambda: tail.tail_attention_reference(query, kq, kb, vq, vb, ok), 1, 3, 1)
        entry["scoring_us"] = _time(lambda: block_lse(query, kq["codes"], kq["kmin"], kq["kstep"], kb),
                                    args.calls, args.reps, args.warmup, graph=True)  # fmt: skip
        rows.append(entry)
    k = keys.permute(0, 2, 1, 3, 4).reshape(B, H, n * T, D)
    v = values.permute(0, 2, 1, 3, 4).reshape(B, H, n * T, D)
    q = query.to(torch.bfloat16)
    dense_us = _time(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), args.calls, args.reps,
                     args.warmup)  # fmt: skip
    print(f"shape: batch {B}, {n} blocks x {T} tokens, {H} KV heads x {G} query heads, head_dim {D}; "
          f"dense bf16 attention over all tokens {dense_us:.1f} us")  # fmt: skip
    print(f"{'bits k,v':>9s} {'kernel':>9s} {'per prog':>8s} {'warps':>5s} {'stages':>6s} {'us':>9s} "
          f"{'kernel us':>9s} {'GB/s':>7s} {'max err':>9s} {'ref us':>9s} {'scoring us':>10s}")  # fmt: skip
    for e in rows:
        for name, r in e["kernel"].items():
            per, warps, stages = r["blocks_per_program"], r["num_warps"], r["num_stages"]
            default = f"mma/{tail_mma.BLOCKS_PER_WARP}/w{tail_mma.WARPS}" if name.startswith("mma") else (
                f"dot/{tail.BLOCKS_PER_PROGRAM}")
            mark = "*" if name == default else " "
            print(f"{e['key_bits']:>5d},{e['value_bits']:<3d} {name.split('/')[0]:>9s} {per:>7d}{mark} "
                  f"{warps or '-':>5} {stages or '-':>6} {r['us']:9.1f} {r['partials_us']:9.1f} "
                  f"{r['gb_per_s']:7.0f} {r['max_error']:9.2e} {e['reference_us']:9.0f} "
                  f"{e['scoring_us']:10.1f}")  # fmt: skip
    if args.out:
        write_results(args.out, {**run_metadata(args), "dense_sdpa_us": dense_us, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
