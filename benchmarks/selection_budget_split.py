"""How much attention a per-layer split of the selection budget could recover, from captured decode queries.

With one shared selection per layer, quantkey already captures about 0.98 of the oracle's mass in every layer
(``docs/results/selection.md``), and the oracle itself falls short of dense attention on RULER at 8K and 16K: the
missing attention is the mass outside the budget, not a ranking error. This script asks whether the same total
budget, split unevenly over the layers, attends to more of it. It reads the captures of
``benchmarks/selection_recall.py`` (``--capture-dir``: per sample, each layer's decode queries and all keys) and, for
every layer and query, plans the decode step as the cache does (``benchmarks.selection_quality.plan_blocks``: sink
and window blocks forced, ``k_free`` more blocks selected), computes the true attention mass per block
(``block_mass``) and the attended share after choosing the ``j`` heaviest free blocks (the oracle's ranking, the
ceiling of any selector) for every ``j``.

Splits of the same total of free blocks (``layers x k_free``), each evaluated on seed set B:

* ``uniform``: ``k_free`` in every layer (what the cache does);
* ``static``: one per-layer split learned on seed set A (greedy: each next block goes to the layer whose mean
  attended share on set A gains most), then applied unchanged to set B;
* ``per-query``: the same greedy split recomputed for every decode query from its own true masses (a ceiling: a
  cache would have to estimate the masses, e.g. from quantkey's block scores, before choosing).

Reported per split: mean attended share (over samples, queries and layers), mean missing share (1 - attended), the
worst layer's mean attended share, and the split itself. Writes JSON (``benchmarks.common.write_results``).

    python benchmarks/selection_budget_split.py --capture-dir /tmp/hfo_selection_captures --length 4096 \\
        --out results/selection/budget_split_qwen05_4k.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload.config import OffloadConfig  # noqa: E402
from benchmarks.selection_quality import block_mass, plan_blocks  # noqa: E402


def attended_curves(capture: dict, config: OffloadConfig, max_extra: int) -> tuple[torch.Tensor, int]:
    """Attended share of every layer and query as a function of the free blocks chosen (oracle ranking).

    Args:
        capture: one sample of ``selection_recall.py`` (``queries`` ``[steps, layers, kv_heads, group, head_dim]``,
            ``positions`` ``[steps]``, ``keys`` ``[layers, kv_heads, n_tokens, head_dim]``, ``scaling``).
        config: budget, block, sink and window sizes.
        max_extra: free blocks beyond the uniform ``k_free`` to tabulate.

    Returns:
        ``(curves, k_free)``: ``curves[step, layer, j]`` (float64, CPU) is the attended share with ``j`` free
        blocks, ``j = 0 .. k_free + max_extra`` (capped at the free blocks there are); ``k_free``: the free blocks the
        cache selects (the same for every query of a sample, up to one block of rounding: the smallest).
    """
    queries, keys, positions = capture["queries"], capture["keys"], capture["positions"]
    steps, layers = queries.shape[:2]
    T = config.block_tokens
    rows, k_frees = [], []
    for s in range(steps):
        n_tokens = int(positions[s]) + 1
        plan = plan_blocks(n_tokens, batch=1, budget_tokens=config.budget_tokens, block_tokens=T,
                           sink_blocks=config.sink_blocks, window_blocks=config.window_blocks)  # fmt: skip
        forced = plan.forced[0]
        k_free = plan.k - int(forced.sum())
        k_frees.append(k_free)
        per_layer = []
        for layer in range(layers):
            q = queries[s, layer][None]  # [1, H, G, D]
            kk = keys[layer][None, :, :n_tokens]
            mass, recent = block_mass(q, kk, capture["scaling"], plan.n_blocks, T)
            shared = mass[0].sum(0).double()  # [n_blocks]
            base = float(recent[0].sum()) + float(shared[forced].sum())
            free = torch.sort(shared[~forced], descending=True).values
            per_layer.append(base + torch.cat([torch.zeros(1, dtype=torch.float64), free.cumsum(0)]))
        rows.append(per_layer)
    k_free = min(k_frees)
    width = k_free + max_extra + 1
    curves = torch.stack([torch.stack([_pad(c, width) for c in per_layer]) for per_layer in rows])
    return curves, k_free


def _pad(curve: torch.Tensor, width: int) -> torch.Tensor:
    """The first ``width`` points of a cumulative curve, its last value repeated past its end."""
    if len(curve) >= width:
        return curve[:width]
    return torch.cat([curve, curve[-1:].expand(width - len(curve))])


def greedy_split(mean_curves: torch.Tensor, total: int, floor: int) -> list[int]:
    """Free blocks per layer: each of ``total`` blocks goes to the layer whose curve gains most from one more.

    Args:
        mean_curves: ``[layers, width]``, attended share with ``j`` free blocks (non-decreasing in ``j``).
        total: free blocks to split (``layers * k_free`` for the same budget as the uniform split).
        floor: fewest blocks per layer.
    """
    layers, width = mean_curves.shape
    split = [min(floor, width - 1)] * layers
    for _ in range(total - sum(split)):
        gains = [float(mean_curves[i, split[i] + 1] - mean_curves[i, split[i]]) if split[i] + 1 < width else -1.0
                 for i in range(layers)]  # fmt: skip
        best = max(range(layers), key=lambda i: gains[i])
        if gains[best] < 0:
            break
        split[best] += 1
    return split


def evaluate(curves: list[torch.Tensor], split_of) -> dict:
    """Attended share of a split over samples (``curves``: ``[steps, layers, width]`` each); ``split_of(step
    curves [layers, width]) -> per-layer blocks``."""
    attended = []
    for c in curves:
        for s in range(c.shape[0]):
            split = split_of(c[s])
            attended.append(torch.stack([c[s, i, j] for i, j in enumerate(split)]))
    a = torch.stack(attended)  # [queries, layers]
    return {"attended": float(a.mean()), "missing": float(1 - a.mean()), "worst_layer": float(a.mean(0).min()),
            "per_layer": [round(float(x), 5) for x in a.mean(0)]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--capture-dir", default="/tmp/hfo_selection_captures")
    p.add_argument("--length", type=int, default=4096, help="captures of this RULER length")
    p.add_argument("--model-prefix", default="qwen05", help="capture file names start with it")
    p.add_argument("--seeds-a", type=int, nargs="+", default=[1], help="seeds the static split is learned on")
    p.add_argument("--seeds-b", type=int, nargs="+", default=[2], help="seeds it is evaluated on")
    p.add_argument("--budget", default="1/16", help="a share of --length (at least --budget-min) or tokens")
    p.add_argument("--budget-min", type=int, default=512)
    p.add_argument("--max-extra", type=int, default=24, help="free blocks beyond k_free a layer may get")
    p.add_argument("--floor", type=int, default=0, help="fewest free blocks per layer")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from eval_harness.runner import parse_budget

    budget = parse_budget(args.budget, args.budget_min).resolve(args.length)
    config = OffloadConfig(budget_tokens=budget)
    sets = {}
    for name, seeds in (("A", args.seeds_a), ("B", args.seeds_b)):
        files = sorted(f for s in seeds for f in Path(args.capture_dir).glob(f"{args.model_prefix}-*-{args.length}-s{s}-*.pt"))
        if not files:
            p.error(f"no captures {args.model_prefix}-*-{args.length}-s<seed>-*.pt for seeds {seeds} in {args.capture_dir}")
        sets[name] = [(f.name, *attended_curves(torch.load(f, weights_only=False), config, args.max_extra)) for f in files]
    k_free = min(k for _, _, k in sets["A"] + sets["B"])
    curves_a = [c for _, c, _ in sets["A"]]
    curves_b = [c for _, c, _ in sets["B"]]
    layers = curves_a[0].shape[1]
    total = layers * k_free
    mean_a = torch.cat([c.reshape(-1, *c.shape[1:]) for c in curves_a]).mean(0)  # [layers, width]
    static = greedy_split(mean_a, total, args.floor)
    results = {
        "uniform": {**evaluate(curves_b, lambda c: [k_free] * layers), "split": [k_free] * layers},
        "static": {**evaluate(curves_b, lambda c: static), "split": static},
        "per-query": evaluate(curves_b, lambda c: greedy_split(c, total, args.floor)),
    }
    print(f"{args.length} tokens, budget {budget} ({k_free} free blocks per layer after sink and window; "
          f"{len(curves_a)} samples in set A, {len(curves_b)} in set B)")
    print(f"{'split':10s} {'attended':>9s} {'missing':>8s} {'worst layer':>11s}")
    for name, r in results.items():
        print(f"{name:10s} {r['attended']:9.4f} {r['missing']:8.4f} {r['worst_layer']:11.4f}")
    print("static split (free blocks per layer):", static)
    if args.out:
        meta = run_metadata(args, note="oracle ranking: the ceiling of any selector; attended = recent + forced + "
                                       "chosen free blocks' true attention mass")  # fmt: skip
        write_results(args.out, {"metadata": meta, "budget_tokens": budget, "k_free": k_free, "layers": layers,
                                 "files_a": [n for n, _, _ in sets["A"]], "files_b": [n for n, _, _ in sets["B"]],
                                 "results": results})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
