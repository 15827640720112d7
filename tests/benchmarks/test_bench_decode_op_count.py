"""benchmarks/decode_op_count.py at a tiny size on the CPU: the JSON holds the operations per layer and decode step
by phase for the dense reference and each offloaded setting, and the phases add up to the total."""

from __future__ import annotations

import json

from benchmarks import decode_op_count


def test_op_count_tiny(tmp_path, capsys):
    out = tmp_path / "op_count.json"
    argv = ["--layers", "2", "--hidden", "64", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--context", "512", "--batch", "2", "--budget", "128", "--warmup", "1", "--steps", "4",
            "--out", str(out)]  # fmt: skip
    assert decode_op_count.main(argv) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["cache"], r["transfer"], r["selector"]) for r in runs] == [("dense", None, None)] + [
        ("offload", t, s) for t in ("kernel", "torch") for s in ("meanbound", "solohead")
    ]
    dense = runs[0]
    assert dense["per_layer_step"]["attention"] > 0 and dense["per_layer_step"]["select"] == 0
    for r in runs:
        phases = r["per_layer_step"]
        assert all(v >= 0 for v in phases.values())
        assert abs(sum(phases.values()) - r["ops_per_layer_step"]) < 1e-9
        assert r["per_layer_step"]["model"] == dense["per_layer_step"]["model"]  # the same decoder layer around it
        assert len(r["tokens"]) == 2 and len(r["tokens"][0]) == 5
        for phase, names in r["top_ops_per_layer_step"].items():
            assert abs(sum(names.values()) - phases[phase]) < 1e-9
    for r in runs[1:]:
        assert r["per_layer_step"]["select"] > 0 and r["per_layer_step"]["recall"] > 0
        assert r["offload_ops_per_layer_step"] > dense["offload_ops_per_layer_step"]
        kernel_launches = r["top_ops_per_layer_step"]["recall"].get("copy_pieces (kernel launch)", 0)
        assert (kernel_launches == 1) == (r["transfer"] == "kernel")
    assert "kernel/meanbound" in capsys.readouterr().out


def test_op_count_of_a_quantkey_selector_with_the_estimate(tmp_path):
    out = tmp_path / "op_count.json"
    argv = ["--layers", "1", "--hidden", "64", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "16",
            "--context", "512", "--batch", "1", "--budget", "128", "--warmup", "1", "--steps", "2", "--no-dense",
            "--transfers", "kernel", "--selectors", "quantkey", "quantkey[bits=4,tail_bits=2,tail_near=3]",
            "--out", str(out)]  # fmt: skip
    assert decode_op_count.main(argv) == 0
    plain, default = json.loads(out.read_text())["runs"]
    assert default["per_layer_step"]["attention"] > plain["per_layer_step"]["attention"]  # the estimate's work
