"""Where the time of one offloaded layer's decode attention goes, piece by piece, with and without the estimate of
the unselected blocks (the default selector's ``tail_bits`` / ``tail_near``), at a real shape.

Each piece runs on random inputs of the shape of one layer of one decode step (default: Llama-3.1-8B, 32K tokens,
batch 8, budget 2048, 16-token blocks, a slot pool of 1.25 x the budget) and is timed on its own:

* ``select``: ``Selector.select`` (scoring every sealed block from the quantized keys, forced blocks, top-k);
* ``sdpa``: ``scaled_dot_product_attention`` over the slot pool under the selection's mask (the attention of a
  selector without an estimate);
* ``attention_lse``: the masked attention over the same pool that also returns its log-sum-exp (what the estimate
  needs to merge with; ``hf_offload.kernels.tail.attention_lse``, a fused kernel), and ``attention_lse_reference``,
  the same in float32 matrix products (what the decode step ran before);
* ``estimate``: ``Selector.tail_attention`` for the step's unselected blocks (with ``tail_near``: the top-k of the
  near blocks, the tail kernel reading them through their indices and the far blocks' log-sum-exp);
* ``estimate_kernel``: the tail kernel alone (``hf_offload.kernels.tail.tail_attention``) over the near blocks'
  codes, gathered beforehand, and (with ``tail_near``) ``estimate_kernel_index``, the same kernel reading the near
  blocks in place through their indices (what ``estimate`` runs);
* ``merge``: ``merge_attention`` of the selection's and the estimate's attention.

On CUDA each piece is captured ``--calls`` times in one CUDA graph and the replays are timed with CUDA events
(device time, no Python launch overhead; the decode step replays graphs too), median of ``--reps``. Elsewhere
(tests) wall time of eager calls, which means little. Prints microseconds per layer and milliseconds per decode step
(x ``--layers``), and the estimate's extra cost per step: ``attention_lse + estimate + merge - sdpa``; writes JSON
to ``--out``.

    python benchmarks/bench_estimate_path.py --out results/decode/bench_estimate_path_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import cuda_event_ms, run_metadata, write_results  # noqa: E402
from hf_offload.config import DEFAULT_SELECTOR  # noqa: E402
from hf_offload.kernels.tail import (  # noqa: E402
    attention_lse,
    attention_lse_reference,
    merge_attention,
    tail_attention,
)
from hf_offload.selectors import get_selector  # noqa: E402


def _time(fn, args, cuda: bool) -> float:
    """Median microseconds per call of ``fn()``: CUDA-graph replays of ``args.calls`` calls on CUDA, else wall time
    of eager calls."""
    fn()  # compiles kernels, allocates outside any capture
    if not cuda:
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e6 / args.calls)
        return statistics.median(times)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # a few eager calls on a side stream before capture, as torch recommends
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.calls):
            fn()
    times = cuda_event_ms(graph.replay, args.warmup, args.reps)
    del graph
    return statistics.median(times) * 1e3 / args.calls


def build(args, device: torch.device) -> dict:
    """Random inputs of one layer's decode step: the query, every sealed block's summaries (in buffers of a larger
    capacity, as the cache holds them), the selection, the slot pool and its mask, the unselected tokens."""
    g = torch.Generator(device=device).manual_seed(args.seed)
    B, H, G, T, D = args.batch, args.kv_heads, args.group, args.block_tokens, args.head_dim
    n = args.context // T
    k = args.budget // T
    slots = -(-int(args.budget * 1.25) // T)
    selector = get_selector(args.selector)
    capacity = -(-n // 256) * 256
    keys = torch.randn(B, capacity, H, T, D, device=device, generator=g, dtype=torch.bfloat16)
    summaries = selector.summarize(keys)
    if selector.estimates_tail:
        values = torch.randn(B, capacity, H, T, D, device=device, generator=g, dtype=torch.bfloat16)
        summaries.update(selector.summarize_values(values))
    summaries = {name: s[:, :n] for name, s in summaries.items()}
    query = torch.randn(B, H, G, D, device=device, generator=g, dtype=torch.bfloat16)
    scaling = D**-0.5
    forced = torch.zeros(B, n, dtype=torch.bool, device=device)
    forced[:, : max(1, 64 // T)] = True  # sink
    forced[:, -max(1, 256 // T):] = True  # window
    valid = torch.ones(B, n, dtype=torch.bool, device=device)
    selection = selector.select(query, summaries, scaling, k, forced, valid)
    pool_k = torch.randn(B, H, (slots + 1) * T, D, device=device, generator=g, dtype=torch.bfloat16)
    pool_v = torch.randn(B, H, (slots + 1) * T, D, device=device, generator=g, dtype=torch.bfloat16)
    ok = torch.zeros(B, 1, 1, (slots + 1) * T, dtype=torch.bool, device=device)
    ok[..., : (k + 1) * T] = True  # the selected blocks' slots and the open block
    tail_ok = torch.ones(B, n, T, dtype=torch.bool, device=device)
    tail_ok.scatter_(1, selection.blocks[:, 0, :, None].expand(B, k, T), False)
    return {"selector": selector, "summaries": summaries, "query": query, "scaling": scaling, "forced": forced,
            "valid": valid, "selection": selection, "k": k, "n": n, "slots": slots, "pool_k": pool_k,
            "pool_v": pool_v, "ok": ok, "tail_ok": tail_ok}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768, help="tokens per sequence (sealed blocks: context / block)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--budget", type=int, default=2048, help="budget_tokens")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=32, help="offloaded layers per decode step (the ms/step factor)")
    p.add_argument("--selector", default=DEFAULT_SELECTOR, help="a selector that estimates the unselected blocks")
    p.add_argument("--calls", type=int, default=10, help="calls per timed CUDA graph replay")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    x = build(args, device)
    selector = x["selector"]
    if not selector.estimates_tail:
        p.error(f"--selector {args.selector!r} does not estimate the unselected blocks (set tail_bits)")
    B, H, G, D = args.batch, args.kv_heads, args.group, args.head_dim
    grouped = x["query"].view(B, H, G, D)
    sel = x["selection"]

    s = x["summaries"]
    near_k = {"codes": s["codes"], "kmin": s["kmin"], "kstep": s["kstep"]}
    near_v = {"codes": s["vcodes"], "kmin": s["vmin"], "kstep": s["vstep"]}
    near_ok, near, index = x["tail_ok"], x["n"], None
    full_k, full_v = near_k, near_v
    if selector.tail_near:  # the near blocks' codes, copied (what the estimate did before its kernel took the index)
        near_k, near_v, near_ok, index = selector.near_blocks(near_k, near_v, near_ok, sel)
        near = near_ok.shape[1]
    q32 = x["query"].float() * x["scaling"]
    out_a, lse_a = attention_lse(grouped, x["pool_k"], x["pool_v"], x["ok"], x["scaling"])
    out_b, lse_b = selector.tail_attention(x["query"], x["summaries"], x["scaling"], x["tail_ok"], selection=sel)
    pieces = {
        "select": lambda: selector.select(x["query"], x["summaries"], x["scaling"], x["k"], x["forced"], x["valid"]),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(grouped, x["pool_k"], x["pool_v"],
                                                                         attn_mask=x["ok"], scale=x["scaling"]),
        "attention_lse": lambda: attention_lse(grouped, x["pool_k"], x["pool_v"], x["ok"], x["scaling"]),
        "attention_lse_reference": lambda: attention_lse_reference(grouped, x["pool_k"], x["pool_v"], x["ok"],
                                                                   x["scaling"]),
        "estimate": lambda: selector.tail_attention(x["query"], x["summaries"], x["scaling"], x["tail_ok"],
                                                    selection=sel),
        "estimate_kernel": lambda: tail_attention(q32, near_k, selector.bits, near_v, selector.tail_bits, near_ok),
        **({"estimate_kernel_index": lambda: tail_attention(q32, full_k, selector.bits, full_v, selector.tail_bits,
                                                            near_ok, index=index)} if index is not None else {}),
        "merge": lambda: merge_attention(out_a, lse_a, out_b, lse_b),
    }  # fmt: skip
    us = {name: _time(fn, args, cuda) for name, fn in pieces.items()}
    extra = us["attention_lse"] + us["estimate"] + us["merge"] - us["sdpa"]
    print(f"{args.selector}: batch {B}, {x['n']} blocks of {args.block_tokens} tokens, {H} KV heads x {G}, "
          f"head_dim {D}, k {x['k']} selected, {near} estimated token by token, pool {x['slots']} slots, "
          f"{device.type}{'' if cuda else ' (wall time, eager)'}")  # fmt: skip
    print(f"{'piece':>16s} {'us/layer':>10s} {'ms/step':>9s}")
    for name, v in us.items():
        print(f"{name:>16s} {v:10.1f} {v * args.layers / 1e3:9.2f}")
    print(f"{'estimate extra':>16s} {extra:10.1f} {extra * args.layers / 1e3:9.2f}   "
          f"(attention_lse + estimate + merge - sdpa)")  # fmt: skip
    if args.out:
        write_results(args.out, {**run_metadata(args), "near_blocks": near, "selected_blocks": x["k"],
                                 "sealed_blocks": x["n"], "us_per_layer": us, "estimate_extra_us_per_layer": extra,
                                 "estimate_extra_ms_per_step": extra * args.layers / 1e3})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
