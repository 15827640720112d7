"""Adaptive against fixed budget: the budget decode steps use, the attention they are estimated to leave out, speed.

Two subcommands, each writing raw JSON (machine, versions, git commit) under ``results/adaptive_budget/``:

* ``cpu``: the recorded workload (``benchmarks/workload.py``: keys and queries of a real model's decode) replayed on
  the CPU at the 8B attention geometry on a few thin layers, once per budget setting: the base budget alone, the
  adaptive budget at each ``--targets`` value (``missed_mass_target``, up to ``--max-budget``), and the cap alone.
  Per setting: sealed tokens attended per step (mean), the estimated share of attention left out
  (``stats()["missed_mass"]``: mean and max over steps and layers) and the hit rate.
* ``decode``: ``benchmarks/bench_decode.py`` twice with the same arguments, with a fixed budget and then with the
  adaptive one (``--max-budget``, ``--missed-mass-target``); per method, context and batch: tokens per second,
  sealed tokens attended per step and the estimated share left out of each. On the GPU::

    python benchmarks/adaptive_budget.py decode --shape llama-8b --contexts 65536 --batches 8 \\
        --methods quantkey-auto --quantkey-selector 'quantkey[bits=4,tail_bits=2,tail_near=3]' --budget 2048 \\
        --max-budget 4096 --missed-mass-target 0.05 --workload recorded:.workloads/qwen05_needle_16k.safetensors

The estimate is the selector's (docs/tuning.md, "Adaptive budget"), not a bound.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import run_metadata, write_results  # noqa: E402
from hf_offload.config import DEFAULT_SELECTOR  # noqa: E402


def cpu_main(args) -> int:
    """``cpu`` subcommand."""
    from benchmarks.workload import GEOMETRIES, Recording, measure_hit_rate

    recording = Recording.load(args.workload)
    settings = [("fixed", args.budget, {})]
    for target in args.targets:
        settings.append((f"adaptive {target:g}", args.budget,
                         {"max_budget_tokens": args.max_budget, "missed_mass_target": target}))  # fmt: skip
    settings += [("fixed cap", args.max_budget, {})]
    rows = []
    print(f"{'setting':16s} {'budget':>6s} {'cap':>6s} {'attended':>8s} {'missed':>7s} {'max':>6s} {'hit':>6s}")
    for name, budget, extra in settings:
        r = measure_hit_rate(recording, args.geometry, args.layers, args.context, args.batch, budget, args.steps,
                             args.selector, **extra)  # fmt: skip
        missed = r["missed_mass"] or {}
        rows.append({"setting": name, "budget_tokens": budget, **extra, "context": args.context, "batch": args.batch,
                     "steps": args.steps, **r})  # fmt: skip
        print(f"{name:16s} {budget:6d} {extra.get('max_budget_tokens', budget):6d} {r['attended_tokens']:8.1f} "
              f"{missed.get('mean', float('nan')):7.4f} {missed.get('max', float('nan')):6.3f} "
              f"{r['hit_rate']:6.3f}", flush=True)  # fmt: skip
    meta = run_metadata(args, workload=recording.describe(), geometry=GEOMETRIES[args.geometry],
                        note="CPU, float32, random-weight Llama model of the geometry replaying the recorded decode; "
                        "attended_tokens: sealed tokens a decode step attended per sequence (the open block aside), "
                        "mean over steps and layers; missed_mass: the selector's estimate")  # fmt: skip
    write_results(args.out, {"metadata": meta, "runs": rows})
    return 0


def decode_main(args, rest: list[str]) -> int:
    """``decode`` subcommand: ``rest`` goes to both ``bench_decode.py`` runs."""
    from benchmarks import bench_decode

    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        adaptive_argv = ["--max-budget", str(args.max_budget), "--missed-mass-target", str(args.missed_mass_target)]
        for name, extra in (("fixed", []), ("adaptive", adaptive_argv)):
            out = Path(tmp) / f"{name}.json"
            if bench_decode.main([*rest, *extra, "--out", str(out)]) != 0:
                return 1
            runs[name] = json.loads(out.read_text())
    key = ("method", "context", "batch")
    adaptive = {tuple(r[k] for k in key): r for r in runs["adaptive"]["runs"]}
    rows = []
    print(f"{'method':14s} {'context':>8s} {'batch':>5s} {'tok/s fixed':>11s} {'adaptive':>9s} {'tokens fixed':>12s} "
          f"{'adaptive':>9s} {'missed fixed':>12s} {'adaptive':>9s}")  # fmt: skip
    for fixed in runs["fixed"]["runs"]:
        other = adaptive.get(tuple(fixed[k] for k in key))
        if other is None or fixed.get("attended_tokens") is None:
            continue
        row = {**{k: fixed[k] for k in key}}
        for name, r in (("fixed", fixed), ("adaptive", other)):
            row[name] = {"tokens_per_s": r["tokens_per_s"], "attended_tokens": r["attended_tokens"],
                         "missed_mass": r["missed_mass"]}  # fmt: skip
        rows.append(row)

        def missed(r):
            return "-" if r["missed_mass"] is None else f"{r['missed_mass']['mean']:.4f}"

        f, a = row["fixed"], row["adaptive"]
        print(f"{row['method']:14s} {row['context']:8d} {row['batch']:5d} {f['tokens_per_s']:11.1f} "
              f"{a['tokens_per_s']:9.1f} {f['attended_tokens']:12.1f} {a['attended_tokens']:9.1f} {missed(f):>12s} "
              f"{missed(a):>9s}")  # fmt: skip
    meta = run_metadata(args, bench_decode_args=rest)
    write_results(args.out, {"metadata": meta, "comparison": rows, "fixed": runs["fixed"],
                             "adaptive": runs["adaptive"]})  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line: ``cpu`` and ``decode``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cpu = sub.add_parser("cpu", help="CPU: budget used and attention left out on the recorded workload")
    cpu.add_argument("--workload", default=".workloads/qwen05_needle_16k.safetensors", help="a recorded decode")
    cpu.add_argument("--geometry", default="llama-8b-attention", help="a key of benchmarks.workload.GEOMETRIES")
    cpu.add_argument("--layers", type=int, default=2)
    cpu.add_argument("--context", type=int, default=16384)
    cpu.add_argument("--batch", type=int, default=1)
    cpu.add_argument("--steps", type=int, default=16, help="decode steps counted (after one uncounted)")
    cpu.add_argument("--selector", default=DEFAULT_SELECTOR)
    cpu.add_argument("--budget", type=int, default=2048, help="budget_tokens (the base)")
    cpu.add_argument("--max-budget", type=int, default=4096, help="max_budget_tokens (the cap)")
    cpu.add_argument("--targets", type=float, nargs="+", default=[0.05, 0.1], help="missed_mass_target values")
    cpu.add_argument("--out", default="results/adaptive_budget/cpu_recorded.json")
    dec = sub.add_parser("decode", help="bench_decode.py with a fixed and with the adaptive budget (other options "
                         "go to bench_decode.py)")  # fmt: skip
    dec.add_argument("--max-budget", type=int, required=True, help="max_budget_tokens of the adaptive run")
    dec.add_argument("--missed-mass-target", type=float, required=True, help="missed_mass_target of the adaptive run")
    dec.add_argument("--out", default="results/adaptive_budget/decode.json")
    args, rest = parser.parse_known_args(argv)
    if args.command == "cpu":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return cpu_main(args)
    return decode_main(args, rest)


if __name__ == "__main__":
    raise SystemExit(main())
