"""The recall launch of one decode step of one layer, where most selected blocks are already resident.

A decode step launches the copy kernel over every selected entry (``batch x k``), with host id ``-1`` for the hits,
so that the miss list never travels to the host. At 64K tokens, batch 12 (8B shape, budget 2048) that is 1524 entries
of 16 pieces (one head's K or V, 4 KiB each) with about 3% misses, and the launch took 159 us per layer where the
missed bytes alone need about 55 us at the PCIe limit (``results/decode/layer_graphs_h200/``). This benchmark times,
in one run, the launch settings of :func:`hf_offload.store.transfer.recall_blocks_kernel` (words per program, warps,
pieces per program) at several miss shares, and the same misses alone (a compacted list: the floor), through the
library's own recall call into a real slot pool from a pinned host pool, captured into a CUDA graph as a decode step
runs it (replays back to back, so only device time is timed). Every setting is checked bit-exact against the host
blocks once per miss share.

    python benchmarks/bench_recall_sparse.py --out results/recall/bench_recall_sparse.json
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
from hf_offload.store import transfer  # noqa: E402
from hf_offload.store import DeviceSlotPool, HostBlockPool, HostMemoryBudget  # noqa: E402

SETTINGS = {
    "w512_p1_2w": {"words_per_program": 512, "num_warps": 2},
    "w1024_p1_4w": {"words_per_program": 1024, "num_warps": 4},
    "w1024_p4_4w": {"words_per_program": 1024, "num_warps": 4, "pieces_per_program": 4},
    "w1024_p8_4w": {"words_per_program": 1024, "num_warps": 4, "pieces_per_program": 8},
    "w1024_p16_8w": {"words_per_program": 1024, "num_warps": 8, "pieces_per_program": 16},
    "w512_p4_2w": {"words_per_program": 512, "num_warps": 2, "pieces_per_program": 4},
    "w512_p16_4w": {"words_per_program": 512, "num_warps": 4, "pieces_per_program": 16},
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--k", type=int, default=127, help="selected blocks per sequence")
    parser.add_argument("--slots", type=int, default=160, help="slot pool blocks per sequence")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--host-blocks", type=int, default=8192)
    parser.add_argument("--miss", type=float, nargs="+", default=[0.0, 0.03, 0.1, 1.0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--replays", type=int, default=20, help="graph replays per timed repetition")
    parser.add_argument("--out", default="results/recall/bench_recall_sparse.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    dtype = torch.bfloat16
    B, K, H, T, D = args.batch, args.k, args.kv_heads, args.block_tokens, args.head_dim
    block_bytes = 2 * H * T * D * 2
    host = HostBlockPool((2, H, T, D), dtype, True, 64 << 20, HostMemoryBudget(None))
    host_ids = host.allocate(args.host_blocks)
    for chunk in host.chunks:
        chunk.view(torch.int16).random_()
    pool = DeviceSlotPool(B, args.slots, H, T, D, dtype, device, open_slot=True)
    g = torch.Generator().manual_seed(0)
    batch_idx = torch.arange(B).repeat_interleave(K)
    slot_idx = torch.cat([torch.randperm(args.slots, generator=g)[:K] for _ in range(B)])
    default = dict(transfer.RECALL_LAUNCH)
    rows = []
    try:
        for share in args.miss:
            n_miss = round(share * B * K)
            live = torch.randperm(B * K, generator=g)[:n_miss]
            ids = torch.full((B * K,), -1, dtype=torch.int64)
            ids[live] = host_ids[torch.randperm(len(host_ids), generator=g)[:n_miss]]
            cases = {"all": (ids, batch_idx, slot_idx), "misses_only": (ids[live], batch_idx[live], slot_idx[live])}
            for name in args.settings:
                transfer.RECALL_LAUNCH.clear()
                transfer.RECALL_LAUNCH.update(SETTINGS[name])
                for case, (i, b, s) in cases.items():
                    if case == "misses_only" and (n_miss == 0 or name not in ("w512_p1_2w", "w1024_p4_4w")):
                        continue
                    i, b, s = i.to(device), b.to(device), s.to(device)
                    offsets = transfer.block_piece_offsets(host, pool, b)
                    pool.data.zero_()
                    transfer.recall_blocks_kernel(host, pool, i, b, s, offsets=offsets)
                    torch.cuda.synchronize()
                    exact = _check(host, pool, i.cpu(), b.cpu(), s.cpu())
                    ms = _graph_ms(lambda: transfer.recall_blocks_kernel(host, pool, i, b, s, offsets=offsets),
                                   args.reps, args.replays)  # fmt: skip
                    us = statistics.median(ms) * 1000
                    gbps = n_miss * block_bytes / (us * 1e-6) / 1e9 if n_miss else None
                    rows.append({"miss_share": share, "misses": n_miss, "entries": len(i), "setting": name,
                                 "launch": SETTINGS[name], "case": case, "us_median": us, "us_each": [t * 1000 for t in ms],
                                 "miss_gbps": gbps, "bit_exact": exact})  # fmt: skip
                    print(f"miss {share:5.2f} ({n_miss:5d})  {name:14s} {case:12s} {us:8.1f} us  "
                          f"{'' if gbps is None else f'{gbps:6.1f} GB/s'}  exact={exact}", flush=True)
    finally:
        transfer.RECALL_LAUNCH.clear()
        transfer.RECALL_LAUNCH.update(default)
    result = {"metadata": run_metadata(args, block_bytes=block_bytes), "rows": rows}
    write_results(args.out, result)
    return result


def _graph_ms(fn, reps: int, replays: int) -> list[float]:
    """Device milliseconds per call of ``fn``: captured into a CUDA graph (as a decode step runs it) and replayed
    ``replays`` times back to back between two events, ``reps`` times (so the host's launch work is not timed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return [t / replays for t in cuda_event_ms(lambda: [graph.replay() for _ in range(replays)], 3, reps)]


def _check(host: HostBlockPool, pool: DeviceSlotPool, ids, batch_idx, slot_idx) -> bool:
    """Whether every copied entry's slot holds its host block (bit for bit)."""
    live = ids >= 0
    for i, b, s in zip(ids[live].tolist(), batch_idx[live].tolist(), slot_idx[live].tolist()):
        block = host.chunks[i // host.chunk_blocks][i % host.chunk_blocks]  # [2, H, T, D]
        got = pool.data[:, b, :, s].cpu()  # [2, H, T, D]
        if not torch.equal(got.view(torch.int16), block.view(torch.int16)):
            return False
    return True


if __name__ == "__main__":
    main()
