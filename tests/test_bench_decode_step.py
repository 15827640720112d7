"""benchmarks/bench_decode_step.py at the tiny shape on the CPU: every lookahead setting decodes with and without
moving bytes, and the JSON holds the phase times and the hidden share of the recall."""

from __future__ import annotations

import json

import torch

from benchmarks import bench_decode_step
from hf_offload.kernels.gather import kernels_available


def test_lookahead_both_with_hidden_share(tmp_path, capsys):
    out = tmp_path / "decode_step.json"
    argv = ["--shape", "tiny", "--context", "256", "--batch", "2", "--budget", "64", "--steps", "3", "--warmup", "1",
            "--transfers", "kernel", "torch", "--lookahead", "both", "--hidden-share", "--alone-repeats", "2",
            "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert bench_decode_step.main(argv) == 0
    data = json.loads(out.read_text())
    paths = ["kernel", "torch"] if kernels_available(torch.device("cpu")) else ["torch"]
    assert [s["transfer"] for s in data["skipped"]] == sorted({"kernel", "torch"} - set(paths))
    runs = data["runs"]
    assert [(r["transfer"], r["lookahead"], r["bytes_moved"]) for r in runs] == [
        (p, la, moved) for p in paths for la in (False, True) for moved in (True, False)
    ]
    for r in runs:
        timing = r["stats"]["timing"]
        assert timing["timed_steps"] == 2 and r["stats"]["decode_steps"] == 3
        phases = sum(timing[f"{p}_ms"] for p in ("select", "prefetch", "recall", "attention"))
        assert abs(timing["rest_ms"] - (timing["step_ms"] - phases)) < 1e-6
        assert (r["stats"]["prefetched_blocks"] > 0) == r["lookahead"]
        assert (timing["prefetch_ms"] > 0) == r["lookahead"]
        if r["bytes_moved"]:
            assert r["decode_recalled_bytes_per_step"] > 0
    shares = data["hidden_share"]
    assert [(s["transfer"], s["lookahead"]) for s in shares] == [(p, la) for p in paths for la in (False, True)]
    for s in shares:
        assert s["recall_alone_ms"] > 0 and s["recall_alone_blocks_per_layer"] > 0
        assert s["hidden_share"] == 1 - s["exposed_recall_ms"] / s["recall_alone_ms"]
        assert s["exposed_recall_ms"] == s["step_ms"] - s["resident_step_ms"]
    printed = capsys.readouterr().out
    assert "hidden share" in printed and data["metadata"]["args"]["lookahead"] == "both"


def test_profile_host_writes_operators_by_host_time(tmp_path):
    out = tmp_path / "decode_step.json"
    argv = ["--shape", "tiny", "--context", "256", "--batch", "2", "--budget", "64", "--steps", "2", "--warmup", "1",
            "--transfers", "torch", "--lookahead", "off", "--profile", "2", "--profile-host", "--device", "cpu",
            "--out", str(out)]  # fmt: skip
    assert bench_decode_step.main(argv) == 0
    profiles = list(tmp_path.glob("decode_step.torch.*.prof.txt"))
    assert len(profiles) == 1
    text = profiles[0].read_text()
    assert text.startswith("2 decode steps, by host time, starting with a capture round")
    assert "Self CPU" in text
