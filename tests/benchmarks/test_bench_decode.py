"""benchmarks/bench_decode.py on the CPU at the tiny shape: every method decodes, the JSON holds what the GPU run
reports (throughput, roofline, planner predictions), sweeps stop cleanly on out-of-memory and on the time budget."""

from __future__ import annotations

import json

import pytest
import torch

from hf_offload.config import DEFAULT_SELECTOR
from hf_offload.kernels.gather import kernels_available

from benchmarks import bench_decode

CONTEXT, BATCH, BUDGET, STEPS = 256, 2, 128, 2
COMMON = ["--shape", "tiny", "--budget", str(BUDGET), "--steps", str(STEPS), "--warmup", "1", "--bandwidth-mib", "8",
          "--device", "cpu"]  # fmt: skip


def _run(tmp_path, *extra) -> dict:
    out = tmp_path / "bench_decode.json"
    assert bench_decode.main([*COMMON, "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_every_method_decodes_and_reports_roofline_and_predictions(tmp_path, capsys):
    data = _run(tmp_path, "--contexts", str(CONTEXT), "--batches", str(BATCH), "--e2e", "--e2e-context", "128",
                "--e2e-prefill-chunk", "64", "--e2e-steps", "2")  # fmt: skip
    printed = capsys.readouterr().out
    assert bench_decode.DECODE_ONLY in printed and data["decode_only"] == bench_decode.DECODE_ONLY
    assert bench_decode.DECODE_ONLY in data["metadata"]["note"]
    assert data["complete"] is True
    bw = data["bandwidth"]
    assert bw["hbm_bytes_per_s"] > 0 and bw["h2d_pinned_bytes_per_s"] > 0

    runs = {r["method"]: r for r in data["runs"]}
    expected = [m for m in bench_decode.METHODS if torch.cuda.is_available() or m != "hf-offloaded"]
    if not (torch.cuda.is_available() and kernels_available(torch.device("cuda"))):
        expected = [m for m in expected if not m.endswith("-graphs")]
        assert {s["method"] for s in data["skipped"]} >= {"quantkey-graphs", "solohead-graphs"}
    assert sorted(runs) == sorted(expected)
    if not torch.cuda.is_available():
        (skip,) = [s for s in data["skipped"] if s["method"] == "hf-offloaded"]
        assert "CUDA" in skip["reason"]
    model = bench_decode.build_model("tiny", CONTEXT + 16, torch.device("cpu"))
    per_token = 2 * model.config.num_key_value_heads * model.config.head_dim * 2 * model.config.num_hidden_layers
    for method, r in runs.items():
        assert any(line.startswith(f"{method} ") for line in printed.splitlines())  # a table line as it went
        assert r["context"] == CONTEXT and r["batch"] == BATCH and r["steps"] == STEPS
        assert r["kv_tokens_end"] == CONTEXT == r["kv_tokens_start"] + 1 + STEPS
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0
        assert r["tokens_per_s"] == pytest.approx(BATCH * 1e3 / r["step_ms"])
        assert r["ms_per_output_token"] == pytest.approx(r["step_ms"] / BATCH)
        assert len(r["step_ms_each"]) == len(r["host_ms_each"]) == STEPS  # one entry per timed step
        assert sum(r["step_ms_each"]) == pytest.approx(r["step_ms"] * STEPS, rel=1e-3)
        assert all(ms > 0 for ms in r["host_ms_each"])
        roof = r["roofline"]
        for key in ("weight_bytes", "kv_read_bytes", "hbm_ms", "roofline_ms", "step_over_roofline"):
            assert roof[key] > 0, (method, key)
        assert roof["roofline_ms"] == pytest.approx(roof["hbm_ms"] + roof["pcie_ms"])
        assert roof["step_over_roofline"] == pytest.approx(r["step_ms"] / roof["roofline_ms"])
        pred = r["prediction"]
        assert pred["device_bytes"] > 0 and pred["kv_tokens"] == CONTEXT
    for method in ("dynamic", "static"):
        r = runs[method]
        assert r["cache_device_bytes"] == BATCH * CONTEXT * per_token == r["prediction"]["device_bytes"]
        assert r["host_bytes"] == 0 and r["hit_rate"] is None and r["recalled_bytes_per_step"] == 0
        assert r["roofline"]["kv_read_bytes"] > BATCH * (CONTEXT - STEPS) * per_token
    for method in ("quantkey", "solohead", "headwise-copy", "quantkey-auto", "solohead-auto"):
        r = runs[method]  # -auto: nothing admitted (no device memory on the CPU unless --admission-gib)
        pred = r["prediction"]
        # The planner predicts the OffloadCache's host (pinned pool) and device bytes exactly.
        assert r["host_bytes"] == pred["host_bytes"] == r["stats"]["host_reserved_bytes"] > 0
        assert r["host_kv_bytes"] == pred["host_kv_bytes"] == BATCH * (CONTEXT // 16) * 16 * per_token
        assert r["cache_device_bytes"] == pred["device_bytes"] and pred["device_matches"] and pred["host_matches"]
        assert 0 <= r["hit_rate"] <= 1
        assert r["roofline"]["kv_read_bytes"] == BUDGET * BATCH * per_token  # the budget, not the whole KV
        assert r["roofline"]["summary_bytes"] > 0
        assert r["recalled_bytes_per_step"] == r["stats"]["decode_recalled_bytes"] / STEPS
        assert r["host_recalled_bytes_per_step"] == r["recalled_bytes_per_step"] and r["admitted_kv_bytes"] == 0
    assert runs["headwise-copy"]["transfer"] == "torch"

    e2e = data["e2e"]
    assert [r["method"] for r in e2e["runs"]] == ["dynamic", "offload"]
    assert e2e["runs"][1]["selector"] == DEFAULT_SELECTOR  # the library default unless --e2e-selector
    for r in e2e["runs"]:
        assert r["prefill_s"] > 0 and r["decode_step_ms"] > 0
    assert isinstance(e2e["first_token_identical"], bool)


def test_auto_sweep_doubles_and_stops_at_out_of_memory(tmp_path, monkeypatch):
    real = bench_decode.run_config

    def run_config(model, env, method, context, batch, args, config=None):
        if batch >= 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, env, method, context, batch, args, config)

    monkeypatch.setattr(bench_decode, "run_config", run_config)
    data = _run(tmp_path, "--contexts", "64", "--batches", "auto", "--max-batch", "16", "--methods", "dynamic",
                "solohead", "--steps", "1", "--min-steps", "1", "--budget", "48")  # fmt: skip
    done = sorted((r["method"], r["batch"]) for r in data["runs"])
    assert done == [("dynamic", 1), ("dynamic", 2), ("solohead", 1), ("solohead", 2)]
    oom = [s for s in data["skipped"] if s["reason"].startswith("out of memory")]
    assert sorted((s["method"], s["batch"]) for s in oom) == [("dynamic", 4), ("solohead", 4)]
    assert len(data["skipped"]) == 2  # the sweep stopped: batches 8 and 16 were never tried


def test_auto_admission_keeps_blocks_on_the_device_and_the_planner_predicts_the_split(tmp_path):
    """--admission-gib admits one 16 MiB chunk: the first layer's blocks stay in (here: CPU) "device" memory, the
    second layer's go to the host pool; the planner predicts both sides; only host reads count as PCIe bytes."""
    data = _run(tmp_path, "--contexts", str(CONTEXT), "--batches", str(BATCH), "--methods", "solohead",
                "solohead-auto", "--admission-gib", "0.02", "--config-seconds", "0")  # fmt: skip
    runs = {r["method"]: r for r in data["runs"]}
    plain, auto = runs["solohead"], runs["solohead-auto"]
    total = plain["host_kv_bytes"]
    assert auto["admitted_kv_bytes"] == auto["prediction"]["admitted_kv_bytes"] == total // 2 > 0
    assert auto["host_kv_bytes"] == auto["prediction"]["host_kv_bytes"] == total // 2
    assert auto["host_bytes"] == auto["prediction"]["host_bytes"] == plain["host_bytes"] // 2
    assert auto["stats"]["device_kv_bytes"] == plain["stats"]["device_kv_bytes"] + total // 2
    assert auto["prediction"]["device_matches"] and auto["prediction"]["host_matches"]
    # Same selections and recalls; only the second layer's recalls cross from the host.
    assert auto["recalled_bytes_per_step"] == plain["recalled_bytes_per_step"] > 0
    assert auto["host_recalled_bytes_per_step"] < auto["recalled_bytes_per_step"]
    assert auto["roofline"]["pcie_bytes"] == auto["host_recalled_bytes_per_step"]
    assert auto["roofline"]["device_recall_bytes"] == auto["recalled_bytes_per_step"] - auto["host_recalled_bytes_per_step"]


def test_time_budget_skips_and_lists_the_rest(tmp_path):
    data = _run(tmp_path, "--contexts", "64", "128", "--batches", "1", "2", "--methods", "dynamic", "solohead",
                "--max-seconds", "0")  # fmt: skip
    assert data["runs"] == [] and data["complete"] is True
    listed = sorted((s["method"], s["context"], s["batch"]) for s in data["skipped"])
    assert listed == sorted((m, c, b) for m in ("dynamic", "solohead") for c in (64, 128) for b in (1, 2))
    assert all("time budget" in s["reason"] for s in data["skipped"])


def test_isolate_merges_one_process_per_sweep(tmp_path):
    """--isolate: each (context, method) sweep and the e2e run in a fresh process, merged into one JSON."""
    import json

    out = tmp_path / "isolated.json"
    code = bench_decode.main(["--shape", "tiny", "--contexts", "256", "--batches", "1", "--methods", "dynamic",
                              "solohead", "--warmup", "1", "--steps", "2", "--config-seconds", "0", "--device", "cpu",
                              "--e2e", "--e2e-context", "128", "--e2e-steps", "2", "--isolate", "--out", str(out),
                              "--method-batches", "solohead=2"])  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    assert data["complete"] and data["metadata"]["isolated"]
    assert sorted((r["method"], r["batch"]) for r in data["runs"]) == [("dynamic", 1), ("solohead", 2)]
    assert all(r["tokens_per_s"] > 0 for r in data["runs"])
    assert {r["method"] for r in data["e2e"]["runs"]} == {"dynamic", "offload"}


def test_isolated_children_get_the_offload_settings():
    """--isolate hands each child process the OffloadCache settings, not only the sweep's."""
    argv = ["--shape", "tiny", "--quantkey-selector", "quantkey[bits=4]", "--decode-capacity", "32",
            "--decode-attention", "pool", "--cuda-graphs", "off", "--graph-scope", "attention", "--fused-norms", "off",
            "--fused-rotary", "off",
            "--fused-projections", "off", "--seal-graphs", "off", "--profile-seal", "20", "--profile-kernels", "3",
            "--reselect-every", "2",
            "--max-budget", "4096", "--missed-mass-target", "0.05", "--isolate"]  # fmt: skip
    parent = bench_decode.parse_args(argv)
    child = bench_decode.parse_args([*bench_decode._child_argv(parent), "--contexts", "256", "--methods", "quantkey"])
    for name in ("quantkey_selector", "decode_capacity", "decode_attention", "cuda_graphs", "graph_scope",
                 "fused_norms", "fused_rotary", "fused_projections", "seal_graphs", "profile_seal", "profile_kernels",
                 "budget",
                 "steps", "reselect_every", "warmup", "max_budget", "missed_mass_target"):  # fmt: skip
        assert getattr(child, name) == getattr(parent, name), name


def test_kernel_profile_is_left_out_without_cuda_and_its_steps_come_off_the_fill(tmp_path):
    """--profile-kernels decodes its steps after the timed ones (the fill leaves room for them); without a CUDA
    device there is no kernel to time, and the row says so (None)."""
    plain = _run(tmp_path, "--contexts", str(CONTEXT), "--batches", str(BATCH), "--methods", "quantkey")
    data = _run(tmp_path, "--contexts", str(CONTEXT), "--batches", str(BATCH), "--methods", "quantkey",
                "--profile-kernels", "3")  # fmt: skip
    (run,), (base,) = data["runs"], plain["runs"]
    assert run["kernel_profile"] is None and "kernel_profile" not in base
    assert run["kv_tokens_start"] == base["kv_tokens_start"] - 3


def test_reused_selections_decode_and_warm_up_longer(tmp_path):
    """--reselect-every 2: the OffloadCache methods reuse every second step's selection (counted in the run's stats)
    and, without --warmup, warm up for 3 + 2 steps (both kinds of step capture their graphs first)."""
    assert bench_decode.parse_args(["--reselect-every", "2"]).warmup == 5
    assert bench_decode.parse_args([]).warmup == 3
    assert bench_decode.parse_args(["--reselect-every", "2", "--warmup", "1"]).warmup == 1
    data = _run(tmp_path, "--contexts", str(CONTEXT), "--batches", str(BATCH), "--methods", "quantkey",
                "--reselect-every", "2", "--steps", "6")  # fmt: skip
    (run,) = data["runs"]
    assert data["metadata"]["reselect_every"] == 2
    assert run["stats"]["reused_selections"] > 0


def test_method_batches_sweep_each_method_at_its_own_batches(tmp_path):
    """--method-batches: one run compares every method at its own batch sizes; the rest sweep --batches."""
    data = _run(tmp_path, "--contexts", "64", "--batches", "1", "--methods", "dynamic", "static", "solohead",
                "--method-batches", "dynamic=2,3", "solohead=2", "--config-seconds", "0")  # fmt: skip
    ran = sorted((r["method"], r["batch"]) for r in data["runs"])
    assert ran == [("dynamic", 2), ("dynamic", 3), ("solohead", 2), ("static", 1)]
    assert data["metadata"]["args"]["method_batches"] == {"dynamic": [2, 3], "solohead": [2]}


def test_method_batches_reach_isolated_children():
    """Each isolated sweep gets its own method's batches; a method without an entry sweeps --batches."""
    parent = bench_decode.parse_args(["--method-batches", "dynamic=4,8", "quantkey-auto=auto", "--isolate"])
    for method, batches in (("dynamic", [4, 8]), ("quantkey-auto", ["auto"]), ("static", ["auto"])):
        child = bench_decode.parse_args([*bench_decode._child_argv(parent), "--contexts", "256", "--methods", method,
                                         *bench_decode._method_batches_argv(parent, method)])  # fmt: skip
        assert bench_decode._batches_of(child, method) == batches, method
        assert set(child.method_batches) <= {method}


MALFORMED = [("dynamo=4", "METHOD one of"), ("dynamic", "METHOD=B,B"), ("dynamic=4,x", "positive integers"),
             ("dynamic=0", "positive integers"), ("static=4", "which --methods does not run")]


@pytest.mark.parametrize("item, says", MALFORMED)
def test_method_batches_reject_malformed_items(item, says, capsys):
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--methods", "dynamic", "quantkey", "--method-batches", item])
    assert says in capsys.readouterr().err


def test_host_free_bytes_never_count_the_pinned_cache_below_zero(monkeypatch):
    """Stale pinned-allocator statistics (more active than owned bytes) leave the available memory as it is."""
    monkeypatch.setattr(bench_decode, "available_host_bytes", lambda: 100 << 30)
    monkeypatch.setattr(bench_decode, "pinned_allocator_bytes", lambda: (0, 400 << 30))
    assert bench_decode.host_free_bytes() == 100 << 30
    monkeypatch.setattr(bench_decode, "pinned_allocator_bytes", lambda: (8 << 30, 2 << 30))
    assert bench_decode.host_free_bytes() == 106 << 30


def test_cap_needs_a_cuda_device(tmp_path):
    with pytest.raises(SystemExit, match="--cap-gib limits CUDA device memory"):
        bench_decode.main([*COMMON, "--device", "cpu", "--cap-gib", "24", "--out", str(tmp_path / "o.json")])
    assert not (tmp_path / "o.json").exists()


def test_the_fit_check_leaves_admitted_blocks_out_and_takes_the_process_headroom(monkeypatch):
    """A configuration fits where the cache's device bytes besides its admitted chunks (which go back to host memory
    before anything else runs out) and the margin fit what the process may still allocate (under --cap-gib, its
    memory fraction, not the device's free memory)."""
    from types import SimpleNamespace

    gib = bench_decode.GIB
    monkeypatch.setattr(bench_decode, "device_free_bytes", lambda device: 40 * gib)
    args = SimpleNamespace(device_margin_gib=3.0, host_margin_gib=8.0)
    pred = {"device_bytes": 64 * gib, "admitted_reserved_bytes": 50 * gib, "transient_device_bytes": 0,
            "host_bytes": 0}  # fmt: skip
    monkeypatch.setattr(bench_decode, "host_free_bytes", lambda: None)
    assert bench_decode.fit_problem("defaults", pred, torch.device("cuda"), args) is None
    pred["admitted_reserved_bytes"] = 0
    problem = bench_decode.fit_problem("defaults", pred, torch.device("cuda"), args)
    assert problem == "predicted not to fit device memory: 67.0 GiB needed, 40.0 GiB free"


def test_a_cache_with_graphs_warms_up_past_its_first_seal():
    """On CUDA an OffloadCache method warms up a block and two tokens more (its first seal captures the seal's graphs,
    which must not be timed); other caches, the CPU and --cuda-graphs off do not."""
    from hf_offload import OffloadConfig

    args = bench_decode.parse_args(["--budget", "512"])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert bench_decode.seal_warmup("defaults", args, cuda, None) == 16 + 2
    assert bench_decode.seal_warmup("quantkey", args, cuda, OffloadConfig(budget_tokens=512, block_tokens=8)) == 10
    assert bench_decode.seal_warmup("defaults", args, cpu, None) == 0
    assert bench_decode.seal_warmup("dynamic", args, cuda, None) == 0
    args = bench_decode.parse_args(["--budget", "512", "--cuda-graphs", "off"])
    assert bench_decode.seal_warmup("quantkey", args, cuda, None) == 0
