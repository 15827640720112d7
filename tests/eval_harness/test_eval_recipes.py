"""Recipes: defaults < YAML < --set overrides, typed validation, clear errors; the shipped recipes load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval_harness.cli import main
from eval_harness.recipes import RECIPES_DIR, Recipe, load_recipe, parse_override, valid_keys

BASE = "study: demo\nsuite: ruler\nmodel: some/model\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", sorted(RECIPES_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_load(path):
    recipe = load_recipe(path)
    assert recipe.study == path.stem
    assert recipe.suite in ("ruler", "longbench", "longbench_e")
    # Every shipped study pairs dense with budgets given as a share of the context (1/16; the 1,024-token study at
    # 32K: 1/32), at least 512 tokens.
    assert "dense" in recipe.methods and recipe.budgets in (["1/16"], ["1/32"]) and recipe.budget_min_tokens == 512


def test_ruler_recipe_is_the_published_study():
    recipe = load_recipe("ruler_qwen05")  # a bare name resolves to recipes/ruler_qwen05.yaml
    assert recipe.model == "qwen2.5-coder-0.5b-instruct"  # the hf_offload.tools.models registry name
    assert recipe.lengths == [4096, 8192, 16384, 32768]
    assert recipe.methods == ["dense", "quantkey", "meanbound", "solohead", "headwise", "streaming"]  # the default first
    assert recipe.samples == 50


def test_precedence_defaults_yaml_overrides(tmp_path):
    path = write(tmp_path, BASE + "samples: 7\nlengths: [4K, 8192]\n")
    recipe = load_recipe(path)
    assert recipe.samples == 7  # YAML over default (50)
    assert recipe.batch_size == 1  # default
    assert recipe.lengths == [4096, 8192]
    recipe = load_recipe(path, ["samples=3", "chat=false", "budgets=['1/8', 1024]", "offload.block_tokens=32"])
    assert recipe.samples == 3 and recipe.chat is False  # override over YAML
    assert recipe.budgets == ["1/8", 1024]
    assert recipe.offload == {"block_tokens": 32}
    assert load_recipe(path, ["data=null"]).data is None


def test_unknown_keys_list_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown recipe key\(s\) 'sample'.*valid keys: study, suite, model"):
        load_recipe(write(tmp_path, BASE + "sample: 3\n"))
    with pytest.raises(ValueError, match="unknown recipe key.*'lenghts'.*valid keys"):
        load_recipe(write(tmp_path, BASE), ["lenghts=[1024]"])
    assert "budget_min_tokens" in valid_keys()


def test_type_and_value_errors(tmp_path):
    path = write(tmp_path, BASE)
    with pytest.raises(ValueError, match="'samples' must be an integer or null"):
        load_recipe(path, ["samples=many"])
    with pytest.raises(ValueError, match="suite must be one of ruler, longbench, longbench_e"):
        load_recipe(path, ["suite=needle"])
    with pytest.raises(ValueError, match="bad budget '1/0'"):
        load_recipe(path, ["budgets=['1/0']"])
    with pytest.raises(ValueError, match="a share must lie in"):
        load_recipe(path, ["budgets=['3/2']"])
    with pytest.raises(ValueError, match="like '4K'"):
        load_recipe(path, ["lengths=[four]"])
    with pytest.raises(ValueError, match="not built.*SQuAD"):
        load_recipe(path, ["tasks=[niah_single_1, qa_1]"])
    with pytest.raises(ValueError, match="dureader: not longbench_e dataset"):
        load_recipe(path, ["suite=longbench_e", "tasks=[qasper_e, dureader]"])
    with pytest.raises(ValueError, match="key=value"):
        parse_override("samples")
    with pytest.raises(ValueError, match="lacks the required key.*model"):
        load_recipe({"study": "x", "suite": "ruler"})
    with pytest.raises(FileNotFoundError, match="shipped recipes: .*ruler_qwen05"):
        load_recipe("no_such_recipe")


def test_recipe_by_name_from_an_installed_wheel_asks_for_a_file(tmp_path, monkeypatch):
    from eval_harness import recipes

    monkeypatch.setattr(recipes, "RECIPES_DIR", tmp_path / "recipes")  # a wheel has no recipes/ beside its packages
    with pytest.raises(FileNotFoundError, match="which an installed wheel does not have: pass the path of a YAML"):
        load_recipe("ruler_qwen05")


def test_recipe_from_dict_and_dump():
    recipe = load_recipe({"study": "s", "suite": "longbench_e", "model": "m", "samples": None})
    assert isinstance(recipe, Recipe) and recipe.samples is None
    assert recipe.to_dict()["suite"] == "longbench_e"


def test_cli_dry_run_and_errors(tmp_path, capsys):
    path = write(tmp_path, BASE)
    assert main([str(path), "--set", "samples=2", "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 2
    assert main([str(path), "--set", "colour=blue"]) == 2
    assert "valid keys" in capsys.readouterr().err
    assert main([str(path), "--set", "methods=[dense, solohaed]"]) == 2  # before any model is loaded
    assert "Unknown selector 'solohaed'" in capsys.readouterr().err
