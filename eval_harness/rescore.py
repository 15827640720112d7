"""Score stored answers again with :mod:`eval_harness.metrics` and compare with the scores stored beside them.

A results file keeps each answer with its references and score (``results/<study>/*.jsonl``, RULER and LongBench
suites; ``results/core_needle/*.json``, the needle benchmark), so a change of a metric can be checked against every
committed run without a model::

    python -m eval_harness.rescore results          # exit 1 if any stored score differs from its re-scored value
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import files
from .metrics import longbench_score, ruler_postprocess, string_match_all_one, string_match_part_one
from .needle import score as needle_score


@dataclass
class Rescored:
    """What re-scoring one file found: ``checked`` scores, and ``(where, stored, rescored)`` for each that differs."""

    path: Path
    checked: int = 0
    differ: list[tuple[str, object, object]] = field(default_factory=list)

    def add(self, where: str, stored, rescored) -> None:
        """Count one score; remember it if ``stored != rescored`` (exact comparison)."""
        self.checked += 1
        if stored != rescored:
            self.differ.append((where, stored, rescored))


def result_score(header: dict, result: dict) -> float:
    """The score (0..100) of one ``"type": "result"`` line of a study file, from its prediction and references.

    RULER takes the task's metric from the header (``suite_info.tasks[task].metric``); LongBench takes the dataset's
    metric, with the sample's class names from ``extra.all_classes`` (classification datasets).
    """
    suite = header["suite"]
    prediction, references = result["prediction"], result["references"]
    if suite == "ruler":
        metric = header["suite_info"]["tasks"][result["task"]]["metric"]
        one = string_match_part_one if metric == "string_match_part" else string_match_all_one
        return 100.0 * one(ruler_postprocess(prediction), references)
    if suite in ("longbench", "longbench_e"):
        all_classes = result.get("extra", {}).get("all_classes")
        return 100.0 * longbench_score(result["task"], prediction, references, all_classes)
    raise ValueError(f"no metric for suite {suite!r}: expected ruler, longbench or longbench_e")


def rescore_study_file(path) -> Rescored:
    """Re-score every result line of one study jsonl (plain or ``.gz``); each line follows the header before it."""
    out = Rescored(Path(path))
    header = None
    with files.open_text(path) as f:
        for number, line in enumerate(f, 1):
            record = json.loads(line)
            if record.get("type") == "header":
                header = record
            elif record.get("type") == "result":
                if header is None:
                    raise ValueError(f"{path}:{number}: a result line before any header line")
                out.add(f"line {number}", record["score"], result_score(header, record))
    return out


def rescore_needle_file(path) -> Rescored:
    """Re-score every sample of a needle benchmark file (``benchmarks/needle_core.py``) and each run's count."""
    out = Rescored(Path(path))
    for i, run in enumerate(files.read_json(path)["runs"]):
        samples = run["samples"]
        if not samples or samples[0]["expected"] is None:
            continue  # random-token prompts: nothing was scored
        for j, sample in enumerate(samples):
            out.add(f"run {i} sample {j}", sample["correct"], needle_score(sample["output"], sample["expected"]))
        out.add(f"run {i} correct", run["correct"], sum(needle_score(s["output"], s["expected"]) for s in samples))
    return out


def committed_files(results_dir) -> Iterator[Path]:
    """The answer files under ``results_dir``: every study jsonl (plain or ``.gz``) and the needle benchmark files."""
    root = Path(results_dir)
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        yield from files.find(folder, "*.jsonl")
    yield from files.find(root / "core_needle", "*.json") if (root / "core_needle").is_dir() else ()


def rescore_file(path) -> Rescored:
    """:func:`rescore_study_file` for a jsonl file, :func:`rescore_needle_file` for a json file."""
    return rescore_study_file(path) if files.plain_name(path).endswith(".jsonl") else rescore_needle_file(path)


def main(argv=None) -> int:
    """``python -m eval_harness.rescore [RESULTS_DIR]``: one line per file, then the totals; exit 1 if any differs."""
    parser = argparse.ArgumentParser(prog="python -m eval_harness.rescore", description=__doc__.split("\n\n")[0])
    parser.add_argument("results_dir", nargs="?", default="results", help="folder of results (default: results)")
    args = parser.parse_args(argv)
    checked = differ = n_files = 0
    for path in committed_files(args.results_dir):
        found = rescore_file(path)
        n_files += 1
        checked += found.checked
        differ += len(found.differ)
        print(f"{found.checked:6d} scores  {len(found.differ):4d} differ  {path}")
        for where, stored, rescored in found.differ[:5]:
            print(f"    {where}: stored {stored!r}, re-scored {rescored!r}")
    print(f"{checked} scores in {n_files} files, {differ} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
