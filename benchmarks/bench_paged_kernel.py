"""Time the paged decode attention kernel against attention over the slot pool, at a real decode shape.

One decode step's attention of one layer: ``--batch`` sequences, the 8B shape's 8 KV heads of 4 query heads each,
``head_dim`` 128, 16-token blocks, ``--budget`` tokens selected. The blocks live in admitted device chunks (the
``--admitted`` share of them) and in the slot pool. Timed in one run (CUDA events, median of ``--repeats`` after
warm-up):

* ``paged``: :func:`~hf_offload.kernels.paged.paged_decode` at each ``--configs`` setting (``block_e/num_warps/splits``,
  splits 0: the default), reading admitted blocks in place;
* ``sdpa_pool``: ``scaled_dot_product_attention`` over the whole slot pool with a prebuilt mask (the slot-pool path's
  attention, without building the mask and without copying the admitted blocks into slots first);
* ``copy_admitted``: the copy kernel moving the selected admitted blocks into slots (what the slot-pool path adds).

Each is timed inside a CUDA graph of ``--graph-calls`` calls (as a decode step's whole-layer graph runs it; 0: one
call at a time, the host's launch included, which made earlier sweeps spread by 60%).

Outputs are checked against :func:`~hf_offload.kernels.paged.paged_decode_reference` first. Raw JSON to ``--out``.

    python benchmarks/bench_paged_kernel.py --batch 12 --out results/decode/bench_paged_kernel_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import cuda_event_ms, run_metadata, write_results  # noqa: E402
from hf_offload.kernels.gather import copy_pieces  # noqa: E402
from hf_offload.kernels.paged import paged_decode, paged_decode_reference  # noqa: E402


def _time(fn, repeats: int, graph_calls: int = 0) -> float:
    """Median microseconds of ``fn`` over ``repeats`` timings (CUDA events), after three warm-up calls: of one call
    each, or with ``graph_calls`` > 0 of one replay of a CUDA graph of that many calls, divided by it (the host's
    launch time left out, as in a decode step's graph)."""
    if graph_calls <= 0:
        return statistics.median(cuda_event_ms(fn, warmup=3, reps=repeats)) * 1e3
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_calls):
            fn()
    ms = statistics.median(cuda_event_ms(graph.replay, warmup=3, reps=repeats))
    del graph
    return ms * 1e3 / graph_calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--admitted", type=float, default=0.9, help="share of blocks in admitted device chunks")
    parser.add_argument("--configs", nargs="+", default=["4/4/0", "2/4/0", "8/4/0", "4/8/0", "8/8/0", "4/4/1"],
                        help="block_e/num_warps/splits[/num_stages] (splits 0: the default)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--graph-calls", type=int, default=10,
                        help="calls per timed CUDA graph replay (0: time single calls, host launch included)")
    parser.add_argument("--out", default="results/decode/bench_paged_kernel.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    dtype = torch.bfloat16
    batch, heads, group, head_dim, tokens = args.batch, 8, 4, 128, 16
    k = args.budget // tokens - 1  # selected blocks besides the open one
    slots = -(-k * 5 // 4)
    n_blocks = args.context // tokens
    chunk_blocks = 16 * 2**20 // (2 * heads * tokens * head_dim * 2)
    n_chunks = -(-batch * n_blocks // chunk_blocks)
    admitted = [i < round(args.admitted * n_chunks) for i in range(n_chunks)]
    g = torch.Generator(device=device).manual_seed(0)
    chunks = [torch.randn((chunk_blocks, 2, heads, tokens, head_dim), generator=g, device=device, dtype=dtype)
              if a else torch.randn((chunk_blocks, 2, heads, tokens, head_dim), dtype=dtype).pin_memory()
              for a in admitted]  # fmt: skip
    table = torch.randperm(n_chunks * chunk_blocks, device=device)[: batch * n_blocks].view(batch, n_blocks)
    blocks = torch.stack([torch.randperm(n_blocks, device=device)[:k] for _ in range(batch)])[:, None]
    keep = torch.ones_like(blocks, dtype=torch.bool)
    slot_of = torch.stack([torch.randperm(slots, device=device)[:k] for _ in range(batch)])
    slot_of = slot_of[:, None].expand(batch, heads, k).contiguous()
    pool = torch.randn((2, batch, heads, slots + 1, tokens, head_dim), generator=g, device=device, dtype=dtype)
    rows = torch.ones((batch, n_blocks + 2, tokens), dtype=torch.bool, device=device)
    rows[:, n_blocks + 1] = False
    rows[:, n_blocks, 9:] = False  # the open block: 9 tokens
    query = torch.randn((batch, heads, group, head_dim), generator=g, device=device, dtype=dtype)
    addrs = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64, device=device)
    on_host = torch.tensor([not a for a in admitted] + [False], device=device)
    scaling = head_dim**-0.5
    call = (query, scaling, blocks, keep, slot_of, rows, n_blocks, table, addrs, on_host, chunk_blocks, pool)

    ref_out, ref_lse = paged_decode_reference(query, scaling, blocks, keep, slot_of, rows, n_blocks, table, chunks,
                                              admitted, pool)  # fmt: skip
    results = {"shape": dict(batch=batch, kv_heads=heads, group=group, head_dim=head_dim, block_tokens=tokens,
                             selected_blocks=k, slots=slots, context=args.context, admitted_share=args.admitted),
               "paged": []}  # fmt: skip
    print(f"{'variant':24s} {'us':>8s} {'max |err|':>10s}")
    for spec in args.configs:
        block_e, warps, splits, stages = ([int(x) for x in spec.split("/")] + [0])[:4]
        fn = lambda: paged_decode(*call, out_dtype=torch.float32, block_e=block_e, num_warps=warps,  # noqa: E731
                                  splits=splits or None, num_stages=stages or None)  # fmt: skip
        out, lse = fn()
        err = max((out - ref_out).abs().max().item(), (lse - ref_lse).abs().max().item())
        us = _time(fn, args.repeats, args.graph_calls)
        results["paged"].append({"block_e": block_e, "num_warps": warps, "splits": splits or None,
                                 "num_stages": stages or None, "us": us, "max_abs_error": err})  # fmt: skip
        print(f"paged {spec:18s} {us:8.1f} {err:10.2e}")

    # The slot-pool path: every selected block in a slot; one SDPA over the pool with a mask.
    total = slots + 1
    ok = torch.zeros((batch, 1, total, tokens), dtype=torch.bool, device=device)
    ok.scatter_(2, slot_of[:, :1, :, None].expand(batch, 1, k, tokens), True)
    ok[:, :, slots] = rows[:, None, n_blocks]
    ok = ok.flatten(-2)[:, :, None]
    k_all = pool[0].view(batch, heads, total * tokens, head_dim)
    v_all = pool[1].view(batch, heads, total * tokens, head_dim)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(query, k_all, v_all, attn_mask=ok,  # noqa: E731
                                                                    scale=scaling)  # fmt: skip
    results["sdpa_pool_us"] = _time(sdpa, args.repeats, args.graph_calls)
    print(f"{'sdpa_pool':24s} {results['sdpa_pool_us']:8.1f}")

    # What the slot-pool path copies first: the selected admitted blocks, whole, into their slots.
    ids = table.gather(1, blocks[:, 0])
    sel_admitted = ~on_host[ids // chunk_blocks]
    ids = torch.where(sel_admitted, ids, -1).view(-1)
    block_words = 2 * heads * tokens * head_dim // 2
    piece_words = tokens * head_dim // 2
    # One piece per (entry, K or V, head): host offset (kv * heads + h) * piece; device offset in the pool.
    e = torch.arange(batch * k, device=device)
    b_idx, s_idx = e // k, slot_of[:, 0].reshape(-1)
    kv_h = torch.arange(2 * heads, device=device)
    piece_ids = ids[:, None].expand(-1, 2 * heads).reshape(-1)
    host_off = (kv_h[None, :] * piece_words).expand(batch * k, -1).reshape(-1)
    kv, h = kv_h // heads, kv_h % heads
    dev_off = ((((kv[None, :] * batch + b_idx[:, None]) * heads + h[None, :]) * total + s_idx[:, None]) * piece_words)
    copy = lambda: copy_pieces(addrs, chunk_blocks, block_words, piece_ids, host_off, pool,  # noqa: E731
                               dev_off.reshape(-1), piece_words, to_host=False)  # fmt: skip
    results["copy_admitted_us"] = _time(copy, args.repeats, args.graph_calls)
    results["copy_admitted_bytes"] = int(sel_admitted.sum()) * block_words * 4
    mib = results["copy_admitted_bytes"] / 2**20
    print(f"{'copy_admitted':24s} {results['copy_admitted_us']:8.1f}  ({mib:.1f} MiB)")
    write_results(args.out, {"metadata": run_metadata(args), **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
