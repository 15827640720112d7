"""benchmarks/bench_decode_step.py at the tiny shape on the CPU: every lookahead setting decodes with and without
moving bytes, and the JSON holds the phase times and the hidden share of the recall."""

from __future__ import annotations

import json

import torch

from benchmarks import bench_decode_step
from hf_offload.kernels.gather import kernels_available


def test_lookahead_both_with_hidden_share(tmp_path, capsys):
    out = tmp_path / "decode_step.json"
    argv = ["--shape", "tiny", "--context", "1024", "--batch", "2", "--budget", "64", "--steps", "3", "--warmup", "1",
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


def test_copies_skipped_takes_the_kernel_path_arguments(monkeypatch):
    """The no-bytes mode of --hidden-share forwards every argument of the kernel path's recall (the cache passes
    precomputed piece offsets) with each entry's id set to -1, and restores the function afterwards."""
    import inspect

    import torch

    from benchmarks import bench_decode_step
    from hf_offload.store import transfer

    calls = []

    def recorder(host, pool, ids, batch_idx, slot_idx, head_idx=None, offsets=None):
        calls.append((ids.clone(), batch_idx, slot_idx, head_idx, offsets))

    # The stand-in takes what the real function takes (a new argument must reach the no-bytes mode too).
    assert list(inspect.signature(transfer.recall_blocks_kernel).parameters) == list(
        inspect.signature(recorder).parameters)  # fmt: skip
    monkeypatch.setattr(transfer, "recall_blocks_kernel", recorder)
    ids, b, s, offsets = torch.tensor([3, -1, 7]), torch.zeros(3, dtype=torch.long), torch.arange(3), ("o", "d")
    with bench_decode_step.copies_skipped():
        transfer.recall_blocks_kernel("host", "pool", ids, b, s, None, offsets)
    assert transfer.recall_blocks_kernel is recorder
    (got_ids, got_b, got_s, got_h, got_offsets), = calls
    assert torch.equal(got_ids, torch.full((3,), -1)) and got_b is b and got_s is s and got_h is None
    assert got_offsets == offsets


def test_rounds_alternate_the_modes_and_share_uses_medians(tmp_path):
    out = tmp_path / "decode_step.json"
    argv = ["--shape", "tiny", "--context", "1024", "--batch", "2", "--budget", "64", "--steps", "2", "--warmup", "1",
            "--transfers", "torch", "--lookahead", "off", "--hidden-share", "--alone-repeats", "2", "--rounds", "3",
            "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert bench_decode_step.main(argv) == 0
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [(r["round"], r["bytes_moved"]) for r in runs] == [(i, moved) for i in range(3) for moved in (True, False)]
    (share,) = data["hidden_share"]
    moved = sorted(r["step_ms"] for r in runs if r["bytes_moved"])
    resident = sorted(r["step_ms"] for r in runs if not r["bytes_moved"])
    assert share["rounds"] == 3
    assert share["step_ms"] == moved[1] and share["resident_step_ms"] == resident[1]
    assert share["hidden_share"] == 1 - (moved[1] - resident[1]) / share["recall_alone_ms"]
    pairs = [(a["step_ms"], b["step_ms"]) for a, b in zip(runs[::2], runs[1::2])]
    assert share["hidden_share_per_round"] == [1 - (a - b) / share["recall_alone_ms"] for a, b in pairs]
