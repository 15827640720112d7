"""persist_model.py at a tiny size: a cache saved, loaded in a new process and continued gives the uninterrupted
cache's tokens and planned selections, at the whole-context budget and a sparse one, and the JSON says so."""

from __future__ import annotations

import json

import pytest

from benchmarks import persist_model


def test_tiny_run_continues_as_the_uninterrupted_cache(tmp_path):
    out = tmp_path / "pm.json"
    assert persist_model.main(["--model", "tiny", "--context", "400", "--batch", "2", "--budgets", "0", "64",
                               "--first", "3", "--more", "5", "--dir", str(tmp_path), "--device", "cpu",
                               "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["runs"]
    assert [row["budget"] for row in rows] == ["full", "budget_64"]
    for row in rows:
        assert row["tokens_identical"] and row["selections_identical"] and row["counters_identical"], row
        assert row["planned_selections"][0] == row["planned_selections"][1] > 0
        assert row["graphs"][0]["graph_replays"] == row["graphs"][1]["graph_replays"] == 0  # no graphs on the CPU
        assert row["max_abs_logit_diff"] < 1e-3 * max(row["max_abs_logit"], 1.0)
    assert not list(tmp_path.glob("persist_model_*"))  # the cache files went with the run


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", ["auto", "off"])
def test_tiny_run_on_cuda_continues_as_the_uninterrupted_cache(tmp_path, graphs):
    """On CUDA with graphs the loaded cache's continuation replays graphs too (its selections are then not compared:
    a replayed graph plans inside the graph); with graphs off every step's selection is compared."""
    out = tmp_path / "pm.json"
    assert persist_model.main(["--model", "tiny", "--context", "600", "--batch", "2", "--budgets", "0", "64",
                               "--first", "3", "--more", "24", "--dir", str(tmp_path), "--device", "cuda",
                               "--cuda-graphs", graphs, "--out", str(out)]) == 0  # fmt: skip
    for row in json.loads(out.read_text())["runs"]:
        assert row["tokens_identical"] and row["counters_identical"], row
        assert row["max_abs_logit_diff"] < 1e-2 * max(row["max_abs_logit"], 1.0)
        uninterrupted, loaded = row["graphs"]
        if graphs == "off":
            assert row["selections_identical"] is True
            assert uninterrupted["graph_replays"] == loaded["graph_replays"] == 0
        else:
            assert row["selections_identical"] is None
            assert uninterrupted["graph_replays"] > 0 and loaded["graph_replays"] > 0, row["graphs"]
