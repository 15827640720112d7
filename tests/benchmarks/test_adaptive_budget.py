"""benchmarks/adaptive_budget.py on the CPU at the tiny shape, replaying a decode recorded from a tiny random model:
both runs of bench_decode.py, fixed and adaptive budget, pair up, and the adaptive one attends between the base
budget and the cap, leaving out less of the estimated attention."""

from __future__ import annotations

import json

from benchmarks import adaptive_budget

from ..helpers import tiny_recording


def test_decode_compares_a_fixed_and_an_adaptive_budget(tmp_path, capsys):
    recording = tiny_recording()
    path = recording.save(tmp_path / "tiny.safetensors")
    out = tmp_path / "adaptive.json"
    argv = ["decode", "--shape", "tiny", "--budget", "64", "--max-budget", "128", "--missed-mass-target", "0.01",
            "--steps", "2", "--warmup", "1", "--bandwidth-mib", "8", "--device", "cpu", "--contexts", "256",
            "--batches", "2", "--methods", "dynamic", "quantkey", "--workload", f"recorded:{path}",
            "--out", str(out)]  # fmt: skip
    assert adaptive_budget.main(argv) == 0
    data = json.loads(out.read_text())
    (row,) = data["comparison"]  # the dense method has no budget to compare
    assert (row["method"], row["context"], row["batch"]) == ("quantkey", 256, 2)
    fixed, adaptive = row["fixed"], row["adaptive"]
    assert data["fixed"]["workload"]["kind"] == data["adaptive"]["workload"]["kind"] == "recorded"
    assert fixed["tokens_per_s"] > 0 and adaptive["tokens_per_s"] > 0
    # Whole blocks beside the open block: 64 tokens attend 3 sealed blocks of 16, 128 tokens 7.
    assert fixed["attended_tokens"] == 3 * 16
    assert fixed["attended_tokens"] < adaptive["attended_tokens"] <= 7 * 16
    assert adaptive["missed_mass"]["mean"] < fixed["missed_mass"]["mean"]
    (run,) = [r for r in data["adaptive"]["runs"] if r["method"] == "quantkey"]
    assert run["stats"]["attended_blocks"] * 16 == adaptive["attended_tokens"]
    assert run["stats"]["missed_mass"] == adaptive["missed_mass"]
    assert "quantkey" in capsys.readouterr().out
