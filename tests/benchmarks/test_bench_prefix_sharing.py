"""bench_prefix_sharing.py at a tiny size: the shared prefill's answers are the full prefills' token for token, the
forks share the prefix's host bytes, and the JSON says so."""

from __future__ import annotations

import json

from benchmarks import bench_prefix_sharing


def test_tiny_run_answers_as_the_full_prefills_and_shares_the_host_bytes(tmp_path):
    out = tmp_path / "ps.json"
    assert bench_prefix_sharing.main(["--model", "tiny", "--context", "300", "--questions", "3", "--budgets", "0", "64",
                                      "--new-tokens", "4", "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert result["complete"] and [r["full_budget"] for r in result["runs"]] == [True, False]
    for run in result["runs"]:
        assert len(run["full"]) == len(run["shared"]) == 3
        assert all(row["same_tokens_as_full"] for row in run["shared"])
        # three full prefills hold the document three times; the prefix and its forks hold it once
        assert run["host_bytes_shared"] < 0.5 * run["host_bytes_full"]
