"""benchmarks/bench_estimate_path.py: a tiny shape end to end (eager wall time off CUDA)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_estimate_path


def test_tiny_run_times_every_piece_and_writes_json(tmp_path):
    out = tmp_path / "estimate.json"
    assert bench_estimate_path.main(["--context", "1024", "--batch", "2", "--budget", "256", "--kv-heads", "2",
                                     "--group", "2", "--head-dim", "32", "--layers", "2", "--calls", "1", "--reps",
                                     "1", "--device", "cpu", "--selector", "quantkey[bits=4,tail_bits=2,tail_near=3]", "--out",
                                     str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert set(data["us_per_layer"]) == {"select", "sdpa", "attention_lse", "attention_lse_reference", "estimate",
                                         "estimate_kernel", "estimate_kernel_index", "merge"}  # fmt: skip
    assert all(v > 0 for v in data["us_per_layer"].values())
    # 64 sealed blocks, 16 selected (budget 256 / 16), tail_near=3: 48 estimated token by token.
    assert (data["sealed_blocks"], data["selected_blocks"], data["near_blocks"]) == (64, 16, 48)
    pieces = data["us_per_layer"]
    extra = pieces["attention_lse"] + pieces["estimate"] + pieces["merge"] - pieces["sdpa"]
    assert data["estimate_extra_us_per_layer"] == pytest.approx(extra)


def test_a_selector_without_an_estimate_is_refused():
    with pytest.raises(SystemExit):
        bench_estimate_path.main(["--context", "1024", "--batch", "1", "--budget", "256", "--selector", "quantkey",
                                  "--device", "cpu"])  # fmt: skip
