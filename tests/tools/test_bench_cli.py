"""``hf-offload bench``: decode speed and KV bytes of OffloadCache vs DynamicCache at the tiny shape, on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from hf_offload import OffloadConfig
from hf_offload.tools.bench import SHAPES, build_model, fill_random, main, run_bench
from hf_offload.planner import PRESETS, plan, shape_from_config

MIB = 1 << 20
CONTEXT, BATCH, BUDGET, STEPS = 600, 2, 128, 6


def test_bench_prints_and_writes_speed_and_bytes(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--shape", "tiny", "--context", str(CONTEXT), "--batch", str(BATCH), "--budget", str(BUDGET),
            "--steps", str(STEPS), "--selector", "solohead", "headwise", "--device", "cpu", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    runs = {r["method"]: r for r in result["runs"]}
    assert list(runs) == ["dense", "solohead", "headwise"]
    assert result["metadata"]["shape"] == "tiny" and result["metadata"]["device"] == "cpu"

    tiny = SHAPES["tiny"]
    layers, kv_heads, head_dim = tiny["num_hidden_layers"], tiny["num_key_value_heads"], tiny["head_dim"]
    per_token = 2 * kv_heads * head_dim * 2  # K and V, bf16, one layer
    held = CONTEXT + STEPS  # the filled context plus one token per decode step but the last sampled one
    block_tokens = OffloadConfig().block_tokens
    for method, r in runs.items():
        assert r["context_tokens"] == held
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(BATCH * 1e3 / r["ms_per_step"])
    dense = runs["dense"]
    assert dense["device_kv_bytes"] == layers * BATCH * held * per_token
    assert dense["host_kv_bytes"] == 0 and dense["hit_rate"] is None
    shape = shape_from_config(build_model("tiny", CONTEXT, STEPS, torch.device("cpu")).config)
    for method in ("solohead", "headwise"):
        r = runs[method]
        # Every sealed block is in host memory: whole blocks of all layers and sequences.
        assert r["host_kv_bytes"] == layers * BATCH * (held // block_tokens) * block_tokens * per_token
        predicted = plan(shape, held, BATCH, "offload", OffloadConfig(budget_tokens=BUDGET, selector=method))
        assert r["host_kv_bytes"] == predicted.host_kv_bytes
        assert r["device_kv_bytes"] == predicted.device_kv_bytes < dense["device_kv_bytes"]
        assert r["device_summary_bytes"] == predicted.device_summary_bytes > 0
        assert 0 < r["hit_rate"] < 1
        # Each step attends k = (budget - recent tokens) // block_tokens blocks per layer and sequence; the misses
        # among them are recalled, whole blocks or per-head pieces alike: (1 - hit rate) x L x B x k block bytes.
        k = (BUDGET - 1) // block_tokens  # the same for every step here: 1 <= recent <= block_tokens
        expected = (1 - r["hit_rate"]) * layers * BATCH * k * block_tokens * per_token
        assert r["decode_recalled_bytes_per_step"] == pytest.approx(expected)

    lines = printed.splitlines()
    assert any("ms/step" in line and "tok/s" in line and "hit rate" in line for line in lines)
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in runs}
    assert set(rows) == set(runs)
    for method, r in runs.items():
        ms, toks, device_mib, summary_mib, host_mib, hit, recall_mib = rows[method][1:]
        assert float(ms) == pytest.approx(r["ms_per_step"], abs=0.01)
        assert float(toks) == pytest.approx(r["tokens_per_s"], abs=0.1)
        assert float(device_mib) == pytest.approx(r["device_kv_bytes"] / MIB, abs=0.01)
        assert float(summary_mib) == pytest.approx(r["device_summary_bytes"] / MIB, abs=0.01)
        assert float(host_mib) == pytest.approx(r["host_kv_bytes"] / MIB, abs=0.01)
        assert hit == ("-" if r["hit_rate"] is None else f"{r['hit_rate']:.3f}")
        assert float(recall_mib) == pytest.approx(r["decode_recalled_bytes_per_step"] / MIB, abs=0.001)


def test_bench_help_shows_an_example(capsys):
    from hf_offload.tools.cli import main as cli_main

    with pytest.raises(SystemExit) as done:
        cli_main(["bench", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "example:" in out and "hf-offload bench --shape" in out
    assert cli_main(["--help"]) == 0
    assert "bench" in capsys.readouterr().out


def test_named_shapes_are_the_planner_presets():
    assert "tiny" in SHAPES
    for name, sizes in SHAPES.items():
        if name == "tiny":
            continue
        preset = PRESETS[name]
        assert sizes["num_hidden_layers"] == preset["num_hidden_layers"]
        assert sizes["num_key_value_heads"] == preset["num_key_value_heads"]
        assert sizes["head_dim"] == preset["head_dim"]


def test_fill_random_writes_the_same_kv_into_both_caches():
    from transformers import DynamicCache

    from hf_offload import OffloadCache

    model = build_model("tiny", 100, 2, torch.device("cpu"))
    tiny = SHAPES["tiny"]
    dense = DynamicCache(config=model.config)
    offload = OffloadCache(model, budget_tokens=64)
    for cache in (dense, offload):
        torch.manual_seed(1)  # the values come from the default generator, the keys from their own
        fill_random(cache, 2, 100, tiny["num_key_value_heads"], tiny["head_dim"], "cpu", chunk=40)
        assert cache.get_seq_length() == 100
    for idx in range(tiny["num_hidden_layers"]):
        keys, values = offload.dense_kv(idx)
        assert keys.dtype == torch.bfloat16 and keys.shape == (2, tiny["num_key_value_heads"], 100, tiny["head_dim"])
        assert torch.equal(keys, dense.layers[idx].keys) and torch.equal(values, dense.layers[idx].values)


def test_too_few_steps_is_an_error():
    for steps in (1, 2):  # the first two steps are not timed
        with pytest.raises(ValueError, match="steps must be at least 3"):
            run_bench("tiny", context=64, steps=steps, budget=64, device="cpu")


def test_set_passes_config_fields_and_rejects_unknown_ones(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = ["--context", "256", "--budget", "128", "--steps", "3", "--device", "cpu", "--no-dense",
            "--set", "block_tokens=32", "--set", "pool_tokens=256", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["metadata"]["overrides"] == {"block_tokens": 32, "pool_tokens": 256}
    (run,) = result["runs"]
    tiny = SHAPES["tiny"]
    per_token = 2 * tiny["num_key_value_heads"] * tiny["head_dim"] * 2
    held = 256 + 3
    # The slot pool is pool_tokens per layer and sequence; the open block's buffer is one whole block.
    assert run["device_kv_bytes"] == tiny["num_hidden_layers"] * (256 + 32) * per_token
    assert run["host_kv_bytes"] == tiny["num_hidden_layers"] * (held // 32) * 32 * per_token
    for bad in (["--set", "colour=red"], ["--set", "budget_tokens=64"], ["--set", "block_tokens=24"],
                ["--selector", "nosuch"]):  # fmt: skip
        with pytest.raises(SystemExit) as done:
            main(["--steps", "3", *bad])
        assert done.value.code == 2
    assert "power of two" in capsys.readouterr().err


def test_a_setting_the_device_cannot_run_is_a_clean_error(capsys):
    argv = ["--context", "256", "--budget", "128", "--steps", "3", "--device", "cpu", "--no-dense",
            "--set", "cuda_graphs=True"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "cuda_graphs=True needs a CUDA device" in err and "Traceback" not in err
