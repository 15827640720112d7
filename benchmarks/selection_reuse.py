"""Cost in selection recall of reusing one decode step's block selection for the next few steps.

Re-selecting at every step is what makes a decode step pay for scoring, slot assignment and recall in every layer;
reusing a selection for ``r`` steps would skip that work on ``r - 1`` of every ``r`` steps (TokenSelect's selection
cache reuses a selection while consecutive queries stay similar; this measures the plain fixed-interval version).
Scores captured decode queries (``benchmarks/selection_recall.py`` captures them) of every layer: at step ``j`` the
selection made at step ``r * (j // r)`` is scored against step ``j``'s true attention (``selection_recall``); a step
after which a block was sealed re-selects (the cache's block count changed). Reports the mean recall per interval.

    python benchmarks/selection_reuse.py --pattern 'qwen05-*-4096-s1-*.pt' --selectors meanbound solohead \\
        --intervals 1 2 4 8 --out results/selection/qwen05_4k_reuse_A.json
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload.config import OffloadConfig  # noqa: E402
from hf_offload.selectors import get_selector  # noqa: E402
from benchmarks.selection_quality import block_keys, block_mass, plan_blocks, selection_recall  # noqa: E402


def reuse_recall(cap: dict, selector, config: OffloadConfig, intervals: list[int]) -> dict[int, list[float]]:
    """Recall per interval, one value per (layer, decode step) of one capture.

    Args:
        cap: a capture: ``queries`` ``[steps, layers, kv_heads, group, head_dim]``, ``keys`` ``[layers, kv_heads,
            n_tokens, head_dim]``, ``positions`` ``[steps]``, ``scaling``; step 0 is the last prompt token and is
            skipped (decode queries only).
        selector: the selector to score.
        config: budget, block, sink and window settings.
        intervals: reuse intervals in decode steps (1: re-select every step).
    """
    queries, keys, positions = cap["queries"], cap["keys"], cap["positions"]
    steps, layers = queries.shape[:2]
    T = config.block_tokens
    out = {r: [] for r in intervals}
    for layer in range(layers):
        layer_keys = keys[layer][None]
        summaries = selector.summarize(block_keys(layer_keys, int(positions[-1]) // T, T))
        made = []
        for s in range(1, steps):
            n_tokens = int(positions[s]) + 1
            plan = plan_blocks(n_tokens, batch=1, budget_tokens=config.budget_tokens, block_tokens=T,
                               sink_blocks=config.sink_blocks, window_blocks=config.window_blocks)  # fmt: skip
            sm = {k: v[:, : plan.n_blocks] for k, v in summaries.items()}
            sel = selector.select(queries[s, layer][None], sm, cap["scaling"], plan.k, plan.forced, plan.valid)
            mass, recent = block_mass(queries[s, layer][None], layer_keys[:, :, :n_tokens], cap["scaling"],
                                      plan.n_blocks, T)  # fmt: skip
            made.append((sel, plan, mass, recent))
        for r in intervals:
            for j, (sel, plan, mass, recent) in enumerate(made):
                src, src_plan = made[(j // r) * r][:2]
                if src_plan.n_blocks != plan.n_blocks:
                    src = sel
                out[r].append(float(selection_recall(src, mass, recent, plan)["recall"][0]))
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capture-dir", default="/tmp/hfo_selection_captures")
    parser.add_argument("--pattern", default="qwen05-*-4096-s1-*.pt", help="capture file names (glob)")
    parser.add_argument("--budget", type=int, default=512, help="budget_tokens")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--selectors", nargs="+", default=["meanbound", "solohead"])
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    files = sorted(glob.glob(str(Path(args.capture_dir) / args.pattern)))
    if not files:
        parser.error(f"no capture matches {args.pattern!r} in {args.capture_dir}; run benchmarks/selection_recall.py")
    config = OffloadConfig(budget_tokens=args.budget, block_tokens=args.block_tokens)
    caps = [torch.load(f) for f in files]
    result = {"metadata": run_metadata(args, captures=[Path(f).name for f in files], sink_blocks=config.sink_blocks,
                                       window_blocks=config.window_blocks), "recall": {}}  # fmt: skip
    for name in args.selectors:
        selector = get_selector(name)
        values = {r: [] for r in args.intervals}
        for cap in caps:
            for r, v in reuse_recall(cap, selector, config, args.intervals).items():
                values[r] += v
        result["recall"][name] = {str(r): sum(v) / len(v) for r, v in values.items()}
        print(name, "mean recall by reuse interval:",
              ", ".join(f"{r}: {m:.4f}" for r, m in result["recall"][name].items()), flush=True)  # fmt: skip
    if args.out:
        write_results(args.out, result)
    return result


if __name__ == "__main__":
    main()
