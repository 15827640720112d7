"""Generate ``docs/results/{study}.md`` (and a plot, with matplotlib) from the raw results in ``results/{study}/``.

Usage::

    python -m eval_harness.report STUDY [--results results] [--out docs/results] [--no-plot] [--check]

Tables: the mean score (0-100, the suites' published scores) per method and budget, averaged over tasks, per
context length (LongBench-E: per length bucket); the same per task; the mean time per sample; the tasks left out;
and the items whose last attempt failed; and the paired difference of every method against dense over the same samples
(:func:`pair_scores`, :func:`paired_bootstrap`): per task and length, averaged over tasks per length and over all
cells, the mean of dense minus the method in points, a 95% paired bootstrap interval (:data:`BOOTSTRAP_RESAMPLES`
resamples, fixed seed :data:`BOOTSTRAP_SEED`, each task and length resampled on its own) and the samples where dense
scored higher / the method scored higher / both equal. Samples pair by ``prompt_sha256`` where every record has one,
else by sample id within task and length; a cell where dense and a method hold different samples is refused
(``ValueError``). Methods whose results ran at another git commit or batch size than dense's (their files' headers)
are named beside the tables. Where records carry the accuracy certificate (``missed_mass``), how it tracks the score
each sample lost against dense (:func:`certificate_fit`: Spearman's rank correlation with a bootstrap interval, by
quarters of the certificate). Nothing in the markdown is typed by hand.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass
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


# ------------------------------------------------------------------------------------------- paired comparison
BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class PairedDiff:
    """Dense minus a method over the same samples, in points (0-100).

    Attributes:
        mean: the mean difference (for an average over cells: the mean over cells of their mean differences).
        low: lower end of the 95% paired bootstrap interval.
        high: upper end.
        dense_higher: samples where dense scored higher.
        method_higher: samples where the method scored higher.
        equal: samples with equal scores.
        cells: how many (task, point) cells the figure covers.
    """

    mean: float
    low: float
    high: float
    dense_higher: int
    method_higher: int
    equal: int
    cells: int = 1


def pair_scores(dense: list[dict], method: list[dict], key) -> dict[tuple, tuple[list[float], list[float]]]:
    """Pair the results of dense and a method sample by sample, per cell.

    Args:
        dense: dense's result records (each with ``task``, ``score`` and what ``key`` reads).
        method: the method's.
        key: ``key(record) -> (cell, sample)``: the cell (e.g. ``(task, length)``) and the sample's identity in it
            (its prompt's sha256, or its sample id).

    Returns:
        ``{cell: (dense scores, method scores)}``, the two lists in the same sample order, for every cell where both
        have results; cells only one side has are left out (the tables show "-").

    Raises:
        ValueError: a cell where the two hold different samples (or one sample twice), naming them.
    """
    sides: list[dict[tuple, dict]] = []
    for records in (dense, method):
        cells: dict[tuple, dict] = defaultdict(dict)
        for r in records:
            cell, sample = key(r)
            if sample in cells[cell]:
                raise ValueError(f"paired comparison: sample {sample!r} appears twice in cell {cell} of {r['method']}")
            cells[cell][sample] = float(r["score"])
        sides.append(cells)
    out = {}
    for cell in sorted(set(sides[0]) & set(sides[1]), key=str):
        a, b = sides[0][cell], sides[1][cell]
        if a.keys() != b.keys():
            only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
            raise ValueError(
                f"paired comparison: cell {cell} holds different samples for dense and {method[0]['method']}: "
                f"{len(only_a)} only in dense ({', '.join(map(str, only_a[:3]))}{', ...' if len(only_a) > 3 else ''}), "
                f"{len(only_b)} only in the method ({', '.join(map(str, only_b[:3]))}"
                f"{', ...' if len(only_b) > 3 else ''}); rerun the study so that both cover the same samples"
            )  # fmt: skip
        order = sorted(a)
        out[cell] = ([a[i] for i in order], [b[i] for i in order])
    return out


def _resampled_means(diffs, resamples: int, seed: tuple):
    """Means of ``resamples`` resamples (with replacement, same size) of ``diffs``, from a generator seeded by
    ``seed``, a float64 array of shape ``[resamples]``."""
    import numpy as np

    d = np.asarray(diffs, dtype=np.float64)
    rng = np.random.default_rng([BOOTSTRAP_SEED, *seed])
    return d[rng.integers(0, len(d), size=(resamples, len(d)))].mean(axis=1)


def paired_bootstrap(
    cells: dict[tuple, tuple[list[float], list[float]]], resamples: int = BOOTSTRAP_RESAMPLES
) -> tuple[dict[tuple, PairedDiff], callable]:
    """Mean differences (dense minus method) with 95% paired bootstrap intervals, per cell and over cells.

    Each cell's samples are resampled on their own (generator seeded by :data:`BOOTSTRAP_SEED` and the cell's name,
    so a cell's interval does not depend on the other cells), and an average over cells is the mean of the cells'
    resampled means: a bootstrap stratified by cell. Intervals are the 2.5 and 97.5 percentiles.

    Args:
        cells: :func:`pair_scores`'s result.
        resamples: resamples per cell.

    Returns:
        ``(per_cell, average)``: ``{cell: PairedDiff}``, and ``average(cells) -> PairedDiff | None``, the average
        over the given cells (``None`` when none of them has pairs).
    """
    import zlib

    import numpy as np

    boot, diffs = {}, {}
    for cell, (a, b) in cells.items():
        diffs[cell] = [x - y for x, y in zip(a, b)]
        boot[cell] = _resampled_means(diffs[cell], resamples, (zlib.crc32(repr(cell).encode()),))

    def summary(chosen: list[tuple]) -> PairedDiff | None:
        chosen = [c for c in chosen if c in boot]
        if not chosen:
            return None
        means = np.mean([boot[c] for c in chosen], axis=0)
        low, high = np.percentile(means, [2.5, 97.5])
        flat = [d for c in chosen for d in diffs[c]]
        return PairedDiff(
            mean=float(np.mean([np.mean(diffs[c]) for c in chosen])), low=float(low), high=float(high),
            dense_higher=sum(d > 0 for d in flat), method_higher=sum(d < 0 for d in flat),
            equal=sum(d == 0 for d in flat), cells=len(chosen),
        )  # fmt: skip

    return {c: summary([c]) for c in cells}, summary


# --------------------------------------------------------------------------------- the certificate against scores
@dataclass(frozen=True)
class CertificateFit:
    """How well the accuracy certificate (a sample's estimated missed attention mass) tracks the score it lost
    against dense, over paired samples.

    Attributes:
        samples: paired samples with a certificate.
        spearman: Spearman's rank correlation between the certificate and the loss (dense minus the method, points);
            ``None`` where either is constant.
        low, high: its 95% bootstrap interval (samples resampled with replacement); ``None`` with ``spearman``.
        pearson: the linear correlation; ``None`` where either is constant.
        quartiles: per quarter of the samples by certificate, lowest first: ``(samples, mean certificate, mean loss,
            share of samples that lost points)``.
    """

    samples: int
    spearman: float | None
    low: float | None
    high: float | None
    pearson: float | None
    quartiles: tuple[tuple[int, float, float, float], ...]


def _ranks(x):
    """Ranks from 1 of a float64 array, ties given their average rank."""
    import numpy as np

    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    values, inverse = np.unique(x, return_inverse=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / np.bincount(inverse))[inverse]


def _correlation(x, y) -> float | None:
    import numpy as np

    if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return None
    return float(np.corrcoef(x, y)[0, 1])


def certificate_fit(certificates: list[float], losses: list[float], resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: tuple = ()) -> CertificateFit:  # fmt: skip
    """:class:`CertificateFit` of paired samples: each sample's certificate (``missed_mass["mean"]``) and its loss
    (dense's score minus the method's, points). The interval resamples the samples (generator seeded by
    :data:`BOOTSTRAP_SEED` and ``seed``); resamples whose ranks are constant are left out of it."""
    import numpy as np

    x, y = np.asarray(certificates, dtype=np.float64), np.asarray(losses, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"certificate_fit: {len(x)} certificates for {len(y)} losses")
    spearman = _correlation(_ranks(x), _ranks(y)) if len(x) else None
    low = high = None
    if spearman is not None:
        rng = np.random.default_rng([BOOTSTRAP_SEED, *seed])
        boot = [r for idx in rng.integers(0, len(x), size=(resamples, len(x)))
                if (r := _correlation(_ranks(x[idx]), _ranks(y[idx]))) is not None]  # fmt: skip
        if boot:
            low, high = (float(v) for v in np.percentile(boot, [2.5, 97.5]))
    quartiles = []
    order = np.argsort(x, kind="mergesort")
    for part in np.array_split(order, 4) if len(x) >= 4 else [order]:
        if len(part):
            quartiles.append((len(part), float(x[part].mean()), float(y[part].mean()), float((y[part] > 0).mean())))
    return CertificateFit(len(x), spearman, low, high, _correlation(x, y), tuple(quartiles))


def _fmt_diff(d: PairedDiff | None, of: int | None = None) -> str:
    if d is None:
        return "-"
    cover = "" if of is None or d.cells == of else f" ({d.cells}/{of})"
    text = f"{d.mean:.1f} [{d.low:.1f}, {d.high:.1f}] {d.dense_higher}/{d.method_higher}/{d.equal}{cover}"
    return text.replace("-0.0", "0.0")


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
        self.file_header = {x["_file"]: x for x in self.headers}
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

    def runs(self, method: str, budget) -> dict[str, list]:
        """The git commits, code versions (the headers' ``source_sha256``: the library and harness sources, so a
        copy of a commit's tree run without its git directory, or a later commit that changed only other files,
        is the same code), batch sizes and estimate kernels a method's results ran with (from their files'
        headers, and the records' own ``estimate_kernel`` where they have one), each sorted."""
        found: dict[str, set] = {"commit": set(), "code": set(), "batch size": set(), "estimate kernel": set()}
        for r in self.results:
            if (r["method"], r["budget"]) == (method, budget):
                h = self.file_header.get(r["_file"], {})
                found["commit"].add(_short(h.get("git_commit"), 10))
                found["code"].add((h.get("source_sha256") or "unknown")[:10])
                found["batch size"].add((h.get("generation") or {}).get("batch_size"))
                kernels = r.get("estimate_kernel", h.get("estimate_kernel"))
                if kernels:
                    found["estimate kernel"].add("+".join(kernels))
        return {k: sorted(v, key=str) for k, v in found.items()}

    def paired_section(self) -> list[str]:
        """Markdown lines of the paired comparison of every method against dense (see :func:`paired_bootstrap`)."""
        lines = ["", "## Paired difference against dense", ""]
        dense = [r for r in self.results if r["method"] == DENSE]
        if not dense:
            return lines + ["This study has no dense results, so there is no paired comparison."]
        methods = [c for c in self.columns if c[0] != DENSE]
        by_prompt = all(r.get("prompt_sha256") for r in self.results)
        lines += [
            "Dense minus the method, in points, over the same samples: mean difference, 95% paired bootstrap "
            f"interval ({BOOTSTRAP_RESAMPLES:,} resamples, seed {BOOTSTRAP_SEED}; averages resample each task and "
            "length on its own and average the tasks' means, as the first table does), then the samples where dense "
            "scored higher / the method scored higher / both equal. Samples pair by "
            + ("their prompt's sha256 (`prompt_sha256`) within task and length."
               if by_prompt else "sample id within task and length (these records carry no prompt hash; the suite "
               "builds the sample with one id at one task and length from the same seed for every method).")
            + " A positive difference: the method scores lower than dense.",
        ]  # fmt: skip
        base = self.runs(DENSE, None)
        # One code version: equal source hashes where every file records one, else equal commits.
        by_code = all("unknown" not in self.runs(m, b)["code"] for m, b in [(DENSE, None), *methods])
        version = "code" if by_code else "commit"
        notes = []
        for method, budget in methods:
            mine = self.runs(method, budget)
            differ = [f"{k} {', '.join(map(str, mine[k]))} (dense: {', '.join(map(str, base[k])) or '-'})"
                      for k in (version, "batch size") if mine[k] != base[k]]  # fmt: skip
            if by_code and mine["code"] != base["code"]:
                differ[0] += f", commit {', '.join(mine['commit'])} (dense: {', '.join(base['commit'])})"
            if differ:
                notes.append(f"- `{_label(method, budget)}` ran at {'; '.join(differ)}.")
        what = "code (source sha256)" if by_code else "commit"
        if notes:
            lines += ["", f"Runs that differ from dense in {what} or batch size (from the result headers):", "",
                      *notes]  # fmt: skip
        elif by_code:
            lines += ["", f"Every method ran with the code and batch size of dense (source sha256 "
                      f"{', '.join(base['code'])}; commits {', '.join(base['commit'])}; batch size "
                      f"{', '.join(map(str, base['batch size']))})."]  # fmt: skip
        else:
            lines += ["", f"Every method ran at the commit and batch size of dense ({', '.join(base['commit'])}; "
                      f"batch size {', '.join(map(str, base['batch size']))})."]  # fmt: skip
        kernels = {_label(m, b): k for m, b in methods if (k := self.runs(m, b)["estimate kernel"])}
        if kernels:
            lines += ["", "Estimate of the unselected blocks that ran (from the records): "
                      + "; ".join(f"`{label}` {', '.join(k)}" for label, k in kernels.items()) + "."]  # fmt: skip

        def key(r):
            sample = r["prompt_sha256"] if by_prompt else str(r["sample_id"])
            return (r["task"], self.axis(r)), (int(r["length"]), sample)

        stats = {}
        for method, budget in methods:
            mine = [r for r in self.results if (r["method"], r["budget"]) == (method, budget)]
            stats[(method, budget)] = paired_bootstrap(pair_scores(dense, mine, key))
        head = "| method | " + " | ".join(_point(p) for p in self.points) + " | all |"
        rule = "|---|" + "---:|" * (len(self.points) + 1)
        lines += ["", "Average over tasks (cells: difference [interval] dense higher/method higher/equal; where "
                  "fewer task-length cells than the study's have both: (cells with both/cells)):",
                  "", head, rule]  # fmt: skip
        every = [(t, p) for t in self.tasks for p in self.points]
        for (method, budget), (_, average) in stats.items():
            cells = [_fmt_diff(average([(t, p) for t in self.tasks]), len(self.tasks)) for p in self.points]
            cells.append(_fmt_diff(average(every), len(every)))
            lines.append(f"| {_label(method, budget)} | " + " | ".join(cells) + " |")
        lines += ["", "Per task:", "", "| method | task | " + head[len("| method | "):], "|---" + rule]
        for (method, budget), (per_cell, average) in stats.items():
            for t in self.tasks:
                cells = [_fmt_diff(per_cell.get((t, p))) for p in self.points]
                if any(c != "-" for c in cells):
                    cells.append(_fmt_diff(average([(t, p) for p in self.points]), len(self.points)))
                    lines.append(f"| {_label(method, budget)} | {t} | " + " | ".join(cells) + " |")
        return lines + self._first_token_lines(dense, methods, key)

    def _first_token_lines(self, dense: list[dict], methods: list, key) -> list[str]:
        """Per method, of its answers that differ from dense's: how many part at the first generated token (the
        prefill's, exact attention: arithmetic, not selection), over the samples where both records carry
        ``first_token``; nothing where none do."""
        base = {key(r): r for r in dense if r.get("first_token") is not None}
        rows = []
        for method, budget in methods:
            pairs = [(base[key(r)], r) for r in self.results if (r["method"], r["budget"]) == (method, budget)
                     and r.get("first_token") is not None and key(r) in base]  # fmt: skip
            if not pairs:
                continue
            differ = [(d, m) for d, m in pairs if d["prediction"] != m["prediction"]]
            first = [(d, m) for d, m in differ if d["first_token"] != m["first_token"]]
            scored = [(d, m) for d, m in differ if float(d["score"]) != float(m["score"])]
            scored_first = [(d, m) for d, m in scored if d["first_token"] != m["first_token"]]
            lower = sum(float(d["score"]) > float(m["score"]) for d, m in scored_first)
            rows.append(f"| {_label(method, budget)} | {len(pairs):,} | {len(differ):,} | {len(first):,} | "
                        f"{len(scored):,} | {len(scored_first):,} ({lower:,} lower / {len(scored_first) - lower:,} "
                        "higher) |")  # fmt: skip
        if not rows:
            return []
        return ["", "Where answers part from dense's (records with `first_token`): at the first generated token, "
                "which the prefill computes with exact attention, a difference is arithmetic (the order of the "
                "prefill's sums against `DynamicCache`'s), not selection; after it, the decode's selection and "
                "arithmetic both.", "",
                "| method | samples | answers differ | from the first token | scores differ | from the first token |",
                "|---|---:|---:|---:|---:|---|", *rows]  # fmt: skip

    def certificate_section(self) -> list[str]:
        """Markdown lines of how the accuracy certificate tracks the score lost against dense (:func:`certificate_fit`),
        per method whose records carry ``missed_mass``, per point and over all; none where no record carries it."""
        dense = [r for r in self.results if r["method"] == DENSE]
        methods = [c for c in self.columns if c[0] != DENSE]
        by_prompt = all(r.get("prompt_sha256") for r in self.results)

        def key(r):
            return r["task"], self.axis(r), int(r["length"]), (r["prompt_sha256"] if by_prompt else str(r["sample_id"]))

        base = {key(r): float(r["score"]) for r in dense}
        rows = []
        for method, budget in methods:
            pairs = defaultdict(list)  # point -> [(certificate, loss)]
            for r in self.results:
                mean = (r.get("missed_mass") or {}).get("mean")
                if (r["method"], r["budget"]) == (method, budget) and mean is not None and key(r) in base:
                    pairs[self.axis(r)].append((float(mean), base[key(r)] - float(r["score"])))
            if not pairs:
                continue
            for point in [*self.points, "all"]:
                chosen = [p for q, ps in pairs.items() for p in ps] if point == "all" else pairs.get(point, [])
                if chosen:
                    import zlib

                    fit = certificate_fit([c for c, _ in chosen], [d for _, d in chosen],
                                          seed=(zlib.crc32(repr((method, budget, point)).encode()),))  # fmt: skip
                    rows.append((_label(method, budget), point, fit))
        if not rows:
            return []
        whose = self.certificate_whose()
        lines = ["", "## The accuracy certificate against the score lost", "",
                 "Per sample: the estimated share of attention its decode steps left out (`missed_mass[\"mean\"]` "
                 f"{whose}) against the points it lost to dense on the same sample (dense minus the "
                 "method). Spearman's rank correlation with a 95% bootstrap interval (samples resampled, "
                 f"{BOOTSTRAP_RESAMPLES:,} times), the linear correlation, and the samples in four quarters by "
                 "certificate, lowest first: mean certificate, mean loss in points, share of samples that lost points.",
                 "", "| method | " + ("bucket" if self.by_bucket else "length") + " | samples | Spearman [interval] | "
                 "Pearson | quarters: certificate / loss / share lost |", "|---|---:|---:|---|---:|---|"]  # fmt: skip
        for label, point, fit in rows:
            rho = "-" if fit.spearman is None else f"{fit.spearman:.2f}" + (
                "" if fit.low is None else f" [{fit.low:.2f}, {fit.high:.2f}]")
            quarters = "; ".join(f"{c:.3f} / {d:.1f} / {share:.2f}" for _, c, d, share in fit.quartiles)
            lines.append(f"| {label} | {point if point == 'all' else _point(point)} | {fit.samples} | {rho} | "
                         f"{_fmt(fit.pearson, 2)} | {quarters} |")  # fmt: skip
        return lines

    def certificate_whose(self) -> str:
        """Whose certificate the records hold: each sample's own sequence's (records with ``per_sequence``), or
        their ``generate()`` call's (the batch's, in files written before), or a mix."""
        carried = [r for r in self.results if (r.get("missed_mass") or {}).get("mean") is not None]
        own = sum(bool(r["missed_mass"].get("per_sequence")) for r in carried)
        batched = sorted({int(r.get("batch") or 1) for r in carried if not r["missed_mass"].get("per_sequence")})
        shared = ("of its `generate()` call: the batch's, shared by the samples of one call (batch sizes "
                  f"{', '.join(map(str, batched))})")  # fmt: skip
        if own == len(carried):
            return "of the sample's own sequence"
        if own == 0:
            return shared
        return (f"{shared} for {len(carried) - own:,} of the {len(carried):,} samples; the sample's own for the "
                "rest")

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


def _mean_table(s, lengths: list, title: str, value, note: str) -> list[str]:
    """A section of the per-sample ``value(record)`` (``None``: none) of ``s.results``, mean over samples per method
    and length; nothing where no record has one (each result carries its batch's cache figures)."""
    found: dict[tuple, list[float]] = defaultdict(list)
    for r in s.results:
        if value(r) is not None:
            found[(r["length"], r["method"], r["budget"])].append(float(value(r)))
    if not found:
        return []
    lines = ["", f"## {title}", "", note, "", "| method | " + " | ".join(_point(x) for x in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]  # fmt: skip
    for method, budget in s.columns:
        if any((x, method, budget) in found for x in lengths):
            cells = [_fmt(_mean(found.get((x, method, budget), [])), 3) for x in lengths]
            lines.append(f"| {_label(method, budget)} | " + " | ".join(cells) + " |")
    return lines


def _short(commit: str | None, n: int) -> str:
    """A commit's first ``n`` hex digits, or "none (a copy without git)" where a run recorded none."""
    return commit[:n] if commit else "none (a copy without git)"


def render(study: str, results_dir="results", plot_file: str | None = None) -> str:
    """The markdown report of a study (``plot_file``: name of a plot image beside it to link, if any)."""
    s = _Study(results_dir, study)
    h = s.header
    model, versions, machine = h.get("model", {}), h.get("versions", {}), h.get("machine", {})
    name = (h.get("settings") or {}).get("model") or model.get("name_or_path") or "-"
    commits = sorted({x.get("git_commit") or "" for x in s.headers}) or [""]
    sources = sorted({x["source_sha256"][:10] for x in s.headers if x.get("source_sha256")})
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
        f"transformers {versions.get('transformers')}; git commit(s) {', '.join(_short(c, 12) for c in commits)}"
        + (f"; source sha256 {', '.join(sources)}." if sources else "."),
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
    lines += _mean_table(
        s, lengths, "Mean decode hit rate of the slot pool", lambda r: (r.get("cache") or {}).get("hit_rate"),
        "Share of the selected blocks already on the device at a decode step (`cache.stats()[\"hit_rate\"]` of "
        "each sample's batch), mean over samples.",
    )  # fmt: skip
    lines += _mean_table(
        s, lengths, "Mean estimated attention left out", lambda r: (r.get("missed_mass") or {}).get("mean"),
        "Estimated share of the attention that decode steps did not attend exactly (`cache.stats()[\"missed_mass\"]`"
        f"'s mean {s.certificate_whose()}: the selector's estimate, not a bound), mean over samples.",
    )  # fmt: skip
    lines += s.paired_section()
    lines += s.certificate_section()
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
