"""Every score committed under results/, computed again from its stored answer with eval_harness.metrics: equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from eval_harness import rescore

RESULTS = Path(__file__).resolve().parents[2] / "results"
COMMITTED = list(rescore.committed_files(RESULTS))


def test_every_answer_file_is_found():
    # 59 RULER study files (plain and .gz) and the 2 needle benchmark files
    names = [p.name for p in COMMITTED]
    assert sum(".jsonl" in n for n in names) >= 59 and sum(n.endswith(".json") for n in names) == 2


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_scores_rescore_exactly(path):
    # (where, stored, re-scored) of each score that differs, exact comparison; a file of only failed samples
    # ("type": "error" lines, e.g. ruler_qwen15-20261130T153752453207Z) has nothing to check
    assert rescore.rescore_file(path).differ == []


def test_a_changed_metric_is_caught(tmp_path, monkeypatch):
    # the RULER share-of-references metric swapped for "any reference": 2 of 3 found scores 66.67 -> 100
    header = '{"type": "header", "suite": "ruler", "suite_info": {"tasks": {"t": {"metric": "string_match_all"}}}}'
    result = '{"type": "result", "task": "t", "prediction": " 12 and 34", "references": ["12", "34", "56"], "score": '
    result += "%r}"
    path = tmp_path / "s.jsonl"
    path.write_text(header + "\n" + result % (100.0 * (2 / 3)) + "\n")
    assert rescore.rescore_file(path).differ == []
    monkeypatch.setattr(rescore, "string_match_all_one", rescore.string_match_part_one)
    assert rescore.rescore_file(path).differ == [("line 2", 100.0 * (2 / 3), 100.0)]


def test_cli_prints_totals(capsys):
    assert rescore.main([str(RESULTS)]) == 0
    scores, _, _, files, _, differ, _ = capsys.readouterr().out.strip().splitlines()[-1].split()
    # when this test was written: 43,782 scores in 61 files (43,650 RULER samples, 120 needle samples and the
    # 12 needle runs' counts)
    assert int(scores) >= 43_782 and int(files) >= 61 and differ == "0"
