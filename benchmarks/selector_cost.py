"""Device cost of block selection per decode step: scoring plus top-k for every layer, and summary bytes per block.

Times ``Selector.select`` (score every sealed block with the decode query, force sink and window blocks, top-k
under the budget) once per layer, as one decode step of ``OffloadCache`` runs it, on random summaries of a
real-shaped model's blocks, and reports milliseconds per decode step (all layers), the device bytes of the block
summaries per block and in all. Random keys suffice: the cost depends on shapes only.

    python benchmarks/selector_cost.py --shape llama-3.1-8b --context 32768 --batch 8 --budget 2048 \\
        --selectors solohead meanbound meanvar headwise --out results/selection/selector_cost_h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload.tools.bench import SHAPES  # noqa: E402
from hf_offload.config import OffloadConfig  # noqa: E402
from hf_offload.selectors import get_selector  # noqa: E402


def step_ms(fn, layers: int, repeats: int, cuda: bool) -> float:
    """Median wall milliseconds of ``layers`` calls of ``fn`` (one decode step), synchronised before and after."""
    times = []
    for rep in range(repeats + 2):  # two warm-ups
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(layers):
            fn()
        if cuda:
            torch.cuda.synchronize()
        if rep >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--selectors", nargs="+", default=["solohead", "meanbound", "meanvar", "headwise"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    shape = SHAPES[args.shape]
    heads, q_heads, dim = shape["num_key_value_heads"], shape["num_attention_heads"], shape["head_dim"]
    layers = shape["num_hidden_layers"]
    config = OffloadConfig(budget_tokens=args.budget, block_tokens=args.block_tokens)
    T, n = config.block_tokens, args.context // config.block_tokens
    k = (args.budget - T) // T  # the open block is resident besides the selection
    g = torch.Generator(device=device).manual_seed(0)
    query = torch.randn(args.batch, heads, q_heads // heads, dim, generator=g, device=device, dtype=torch.bfloat16)
    idx = torch.arange(n, device=device)
    forced = ((idx < config.sink_blocks) | (idx >= n - config.window_blocks)).expand(args.batch, n)
    valid = torch.ones(args.batch, n, dtype=torch.bool, device=device)
    rows = []
    print(f"{args.shape}, context {args.context:,}, batch {args.batch}, budget {args.budget} ({k} of {n:,} blocks), "
          f"{layers} layers, {device}")  # fmt: skip
    print(f"{'selector':10s} {'ms/step':>8s} {'B/block':>8s} {'summary GiB':>12s}")
    for name in args.selectors:
        selector = get_selector(name)
        summaries: dict[str, list] = {}
        for start in range(0, n, 256):  # summarise in pieces: the keys of all blocks need not exist at once
            m = min(256, n - start)
            keys = torch.randn(args.batch, m, heads, T, dim, generator=g, device=device, dtype=torch.bfloat16)
            for key, value in selector.summarize(keys).items():
                summaries.setdefault(key, []).append(value)
            del keys
        summaries = {key: torch.cat(parts, dim=1) for key, parts in summaries.items()}
        per_block = sum(s[0, 0].numel() * s.element_size() for s in summaries.values())
        ms = step_ms(lambda: selector.select(query, summaries, dim**-0.5, k, forced, valid), layers, args.repeats,
                     cuda)  # fmt: skip
        row = {"selector": name, "ms_per_step": ms, "ms_per_layer": ms / layers, "summary_bytes_per_block": per_block,
               "summary_bytes_all_layers": per_block * n * args.batch * layers}  # fmt: skip
        rows.append(row)
        print(f"{name:10s} {ms:8.2f} {per_block:8d} {row['summary_bytes_all_layers'] / 2**30:12.2f}", flush=True)
        del summaries
    result = {"metadata": run_metadata(args, blocks=n, k=k, sink_blocks=config.sink_blocks,
                                       window_blocks=config.window_blocks), "runs": rows}  # fmt: skip
    if args.out:
        write_results(args.out, result)
    return result


if __name__ == "__main__":
    main()
