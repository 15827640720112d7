"""Generate ``docs/results/{study}.md`` (and a plot, with matplotlib) from the raw results in ``results/{study}/``.

Usage::

    python -m eval_harness.report STUDY [--results results] [--out docs/results] [--no-plot] [--check]

Tables: the mean score (0-100, the suites' published scores) per method and budget, averaged over tasks, per
context length (LongBench-E: per length bucket); the same per task; the mean time per sample; the tasks left out;
and the items whose last attempt failed. Nothing in the markdown is typed by hand.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

from .runner import DENSE, item_key, read_lines

_METRIC_NOTE = {
    "ruler": "RULER's string_match_all",
    "longbench": "the LongBench release's metric per dataset",
    "longbench_e": "the LongBench release's metric per dataset; buckets by the records' length in words",
}


def _label(method: str, budget) -> str:
    return method if budget is None else f"{method} {budget}"


def _fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _point(p) -> str:
    return f"{p:,}" if isinstance(p, int) else str(p)


def _mean(xs) -> float | None:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else None


def _bucket(record: dict) -> str:
    from .longbench import length_bucket

    return length_bucket(int(record["extra"]["source_length"]))


def _bucket_rank(name: str) -> int:
    from .longbench import BUCKETS

    return [b for b, _ in BUCKETS].index(name)


class _Study:
    """The latest result per item of a study, its latest header, and the items whose last attempt failed."""

    def __init__(self, results_dir, study: str):
        lines = read_lines(results_dir, study)
        self.headers = [x for x in lines if x.get("type") == "header"]
        latest: dict[tuple, dict] = {}
        for x in lines:  # files in time order: a later line of the same item wins
            if x.get("type") in ("result", "error"):
                latest[item_key(x)] = x
        self.results = [x for x in latest.values() if x["type"] == "result"]
        self.failed = [x for x in latest.values() if x["type"] == "error"]
        if not self.results:
            raise FileNotFoundError(f"no results for study {study!r} under {Path(results_dir) / study}; run it first")
        self.header = self.headers[-1] if self.headers else {}
        self.suite = self.results[0]["suite"]
        self.by_bucket = self.suite == "longbench_e"
        self.points = sorted({self.axis(r) for r in self.results}, key=_bucket_rank if self.by_bucket else int)
        order: list[str] = []  # the suite's task order; headers of partial runs (a task subset) count last
        for h in sorted(self.headers, key=lambda h: -len((h.get("suite_info") or {}).get("tasks", {}))):
            order += [t for t in (h.get("suite_info") or {}).get("tasks", {}) if t not in order]
        found = sorted({r["task"] for r in self.results})
        self.tasks = [t for t in order if t in found] + [t for t in found if t not in order]
        self.columns = self._columns()
        scores: dict[tuple, list[float]] = defaultdict(list)
        for r in self.results:
            scores[(r["task"], self.axis(r), r["method"], r["budget"])].append(float(r["score"]))
        self.task_mean = {k: _mean(v) for k, v in scores.items()}
        self.counts = sorted({len(v) for v in scores.values()})

    def axis(self, record: dict):
        """The record's column: its length bucket (LongBench-E) or its context length."""
        return _bucket(record) if self.by_bucket else record["length"]

    def _columns(self) -> list[tuple[str, object]]:
        order: list[str] = [DENSE]  # the baseline first, then the methods in the order the runs named them
        for h in self.headers:
            order += [m for m in (h.get("budgets") or {}).get("methods", []) if m not in order]
        combos = {(r["method"], r["budget"]) for r in self.results}
        order += sorted({m for m, _ in combos} - set(order))
        return sorted(combos, key=lambda c: (order.index(c[0]), str(c[1])))

    def average(self, point, method: str, budget) -> tuple[float | None, int]:
        """Mean over tasks of the task means at one point, and how many tasks have one."""
        means = [self.task_mean[k] for t in self.tasks if (k := (t, point, method, budget)) in self.task_mean]
        return _mean(means), len(means)


def study_averages(study: str, results_dir="results") -> dict[str, dict]:
    """The task-averaged score of every method and point of a study, as its report's first table shows it.

    Returns:
        ``{label: {point: (average, tasks)}}``: ``label`` as in the report (``"dense"``, ``"meanbound 1/16"``),
        ``point`` a context length (or LongBench-E bucket), ``tasks`` how many tasks the average covers.
    """
    data = _Study(results_dir, study)
    return {
        _label(method, budget): {p: data.average(p, method, budget) for p in data.points}
        for method, budget in data._columns()
    }


def render(study: str, results_dir="results", plot_file: str | None = None) -> str:
    """The markdown report of a study (``plot_file``: name of a plot image beside it to link, if any)."""
    s = _Study(results_dir, study)
    h = s.header
    model, versions, machine = h.get("model", {}), h.get("versions", {}), h.get("machine", {})
    name = (h.get("settings") or {}).get("model") or model.get("name_or_path") or "-"
    commits = sorted({x.get("git_commit") or "unknown" for x in s.headers}) or ["unknown"]
    files = sorted({r["_file"] for r in s.results})
    axis_name = "length bucket (words)" if s.by_bucket else "context length (tokens)"
    min_tokens = (h.get("budgets") or {}).get("budget_min_tokens", "?")
    lines = [
        f"# {study}: {s.suite} (generated)",
        "",
        f"Generated by `python -m eval_harness.report {study}` from {len(files)} file(s) in "
        f"`{(Path(results_dir) / study).as_posix()}/` ({len(s.results)} results). Do not edit by hand.",
        "",
        f"Model: `{name}` ({model.get('type')}, {model.get('layers')} layers, {model.get('kv_heads')} KV heads), "
        f"{model.get('dtype')} on {machine.get('gpu') or model.get('device')}; torch {versions.get('torch')}, "
        f"transformers {versions.get('transformers')}; git commit(s) {', '.join(c[:12] for c in commits)}.",
        "",
        f"Scores: mean per-sample score, 0-100 ({_METRIC_NOTE.get(s.suite, s.suite)}), greedy decoding. Samples per "
        f"cell: {', '.join(map(str, s.counts))}. Budgets are per sequence and layer: a share of prompt + answer (at "
        f"least {min_tokens} tokens), or a number of tokens.",
        "",
        f"## Average over tasks, by {axis_name}",
        "",
        "| method | " + " | ".join(_point(p) for p in s.points) + " |",
        "|---|" + "---:|" * len(s.points),
    ]
    for method, budget in s.columns:
        cells = []
        for p in s.points:
            mean, n = s.average(p, method, budget)
            cells.append(_fmt(mean) + ("" if n == len(s.tasks) else f" ({n}/{len(s.tasks)} tasks)"))
        lines.append(f"| {_label(method, budget)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## Per task, by {axis_name}",
        "",
        f"| task | {axis_name.split(' (')[0]} | " + " | ".join(_label(m, b) for m, b in s.columns) + " |",
        "|---|---:|" + "---:|" * len(s.columns),
    ]
    for t in s.tasks:
        for p in s.points:
            cells = [_fmt(s.task_mean.get((t, p, m, b))) for m, b in s.columns]
            if any(c != "-" for c in cells):
                lines.append(f"| {t} | {_point(p)} | " + " | ".join(cells) + " |")
    times: dict[tuple, list[float]] = defaultdict(list)
    for r in s.results:
        times[(r["length"], r["method"], r["budget"])].append(float(r["time_s"]))
    lengths = sorted({r["length"] for r in s.results})
    lines += [
        "",
        "## Mean time per sample (s)",
        "",
        "| method | " + " | ".join(_point(x) for x in lengths) + " |",
        "|---|" + "---:|" * len(lengths),
    ]
    for method, budget in s.columns:
        cells = [_fmt(_mean(times.get((x, method, budget), [])), 3) for x in lengths]
        lines.append(f"| {_label(method, budget)} | " + " | ".join(cells) + " |")
    hits: dict[tuple, list[float]] = defaultdict(list)  # each result carries its batch's cache stats
    for r in s.results:
        if (r.get("cache") or {}).get("hit_rate") is not None:
            hits[(r["length"], r["method"], r["budget"])].append(float(r["cache"]["hit_rate"]))
    if hits:
        lines += [
            "",
            "## Mean decode hit rate of the slot pool",
            "",
            "Share of the selected blocks already on the device at a decode step (`cache.stats()[\"hit_rate\"]` of "
            "each sample's batch), mean over samples.",
            "",
            "| method | " + " | ".join(_point(x) for x in lengths) + " |",
            "|---|" + "---:|" * len(lengths),
        ]
        for method, budget in s.columns:
            if any((x, method, budget) in hits for x in lengths):
                cells = [_fmt(_mean(hits.get((x, method, budget), [])), 3) for x in lengths]
                lines.append(f"| {_label(method, budget)} | " + " | ".join(cells) + " |")
    if s.failed:
        groups: dict[tuple, list[dict]] = defaultdict(list)
        for e in s.failed:
            groups[(e["task"], e["length"], _label(e["method"], e["budget"]))].append(e)
        lines += ["", "## Failed (last attempt; rerun the study to retry)", "", "| task | length | method | samples | "
                  "error |", "|---|---:|---|---:|---|"]  # fmt: skip
        for (task, length, label), errors in sorted(groups.items()):
            message = errors[0]["error"].replace("|", "/").replace("\n", " ")[:100]
            lines.append(f"| {task} | {_point(length)} | {label} | {len(errors)} | {message} |")
    info = h.get("suite_info") or {}
    if info.get("not_built"):
        lines += ["", "## Not built", ""] + [f"- `{k}`: {v}" for k, v in info["not_built"].items()]
    if info.get("essay_haystack"):
        hay = info["essay_haystack"]
        lines += [
            "",
            f"Essay haystack: {hay['source']} ({hay['licence']}), Python {hay['python']}, sha256 {hay['sha256'][:16]}.",
        ]
    if plot_file:
        lines += ["", f"![{study}]({plot_file})"]
    return "\n".join(lines) + "\n"


def plot(study: str, results_dir, path: Path) -> bool:
    """Plot the task-averaged score per method over lengths (or buckets) to ``path``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    s = _Study(results_dir, study)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, budget in s.columns:
        ys = [s.average(p, method, budget)[0] for p in s.points]
        ax.plot([_point(p) for p in s.points], [float("nan") if y is None else y for y in ys], marker="o",
                label=_label(method, budget))  # fmt: skip
    ax.set_xlabel("length bucket (words)" if s.by_bucket else "context length (tokens)")
    ax.set_ylabel("score, average over tasks")
    ax.set_title(study)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(study: str, results_dir="results", out_dir="docs/results", plots: bool = True) -> Path:
    """Write ``{out_dir}/{study}.md`` (and ``{study}.png`` when ``plots`` and matplotlib is installed)."""
    out = Path(out_dir)
    png = out / f"{study}.png"
    made = plots and plot(study, results_dir, png)
    md = out / f"{study}.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(render(study, results_dir, png.name if made else None), encoding="utf-8")
    return md


def main(argv=None) -> int:
    """Command line: write (or ``--check``) the report of one study."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study")
    p.add_argument("--results", default="results", help="results root (default: results)")
    p.add_argument("--out", default="docs/results", help="report folder (default: docs/results)")
    p.add_argument("--no-plot", action="store_true", help="skip the plot")
    p.add_argument("--check", action="store_true", help="exit 1 if the markdown is out of date")
    args = p.parse_args(argv)
    md = Path(args.out) / f"{args.study}.md"
    try:
        if args.check:
            png = Path(args.out) / f"{args.study}.png"
            text = render(args.study, args.results, png.name if png.exists() and not args.no_plot else None)
            if not md.exists() or md.read_text(encoding="utf-8") != text:
                print(f"{md} is out of date; run python -m eval_harness.report {args.study}", file=sys.stderr)
                return 1
            return 0
        print(f"wrote {write_report(args.study, args.results, args.out, plots=not args.no_plot)}")
    except FileNotFoundError as err:
        print(f"report: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
