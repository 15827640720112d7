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
