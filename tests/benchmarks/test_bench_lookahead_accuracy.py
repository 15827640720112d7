"""benchmarks/lookahead_accuracy.py on a small random Llama: every setting decodes the tokens of lookahead off, the
speculative settings prefetch, and the shares it reports are the counters' ratios."""

from __future__ import annotations

import json

from benchmarks import lookahead_accuracy


def test_lookahead_accuracy_on_a_random_model(tmp_path):
    out = tmp_path / "accuracy.json"
    assert lookahead_accuracy.main(["--model", "random", "--layers", "4", "--context", "320", "--prompts", "1",
                                    "--steps", "6", "--budget", "64", "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["results"]
    assert set(rows) == {"off", "same", "next"}
    assert rows["off"]["prefetched"] == 0 and rows["off"]["precision"] is None
    for name in ("same", "next"):
        row = rows[name]
        assert row["same_tokens_as_off"] and len(row["tokens"][0]) == 6
        assert row["prefetched"] > 0 and row["precision"] == row["used"] / row["prefetched"]
        assert 0 <= row["covered"] <= 1 and 0 <= row["hit_rate"] <= 1
