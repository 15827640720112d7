"""The API reference builds with pdoc (``python docs/build_api.py``) and documents the public names."""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _build_api():
    spec = importlib.util.spec_from_file_location("build_api", ROOT / "docs" / "build_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_public_modules_cover_the_packages_and_skip_private_ones():
    modules = _build_api().public_modules()
    for name in ("hf_offload", "hf_offload.cache", "hf_offload.config", "hf_offload.selectors",
                 "hf_offload.selectors.base", "hf_offload.store", "hf_offload.store.host", "hf_offload.kernels",
                 "hf_offload.planner", "hf_offload.tools.bench", "eval_harness", "eval_harness.runner",
                 "eval_harness.ruler"):  # fmt: skip
        assert name in modules
    assert not [name for name in modules if any(part.startswith("_") for part in name.split("."))]
    assert len(modules) == len(set(modules))


def test_api_reference_builds_and_documents_the_public_names(tmp_path):
    pytest.importorskip("pdoc")
    build_api = _build_api()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pages = build_api.build(tmp_path)
    # pdoc warns (and leaves a module out) when a module fails to import.
    failed = [str(w.message) for w in caught if "import" in str(w.message).lower()]
    assert not failed, failed
    assert len(pages) == len(build_api.public_modules())
    assert (tmp_path / "index.html").is_file() and (tmp_path / "search.js").is_file()

    def page(module: str) -> str:
        return (tmp_path / f"{module.replace('.', '/')}.html").read_text(encoding="utf-8")

    def documented(module: str) -> set[str]:  # module-level names (sections) and class members (classattr divs)
        found = re.findall(r'<section id="([\w.]+)">|<div id="([\w.]+)" class="classattr">', page(module))
        return {a or b for a, b in found}

    top = documented("hf_offload")
    for name in ("OffloadCache", "OffloadConfig", "Selector", "SoloHeadSelector", "HeadwiseSelector",
                 "register_selector", "get_selector", "enable_offload_attention", "disable_offload_attention"):  # fmt: skip
        assert name in top, name
    assert {"OffloadCache", "OffloadCache.stats", "OffloadLayer"} <= documented("hf_offload.cache")
    assert {"OffloadConfig", "OffloadConfig.replace"} <= documented("hf_offload.config")
    assert {"Selector", "Selector.score", "Selector.summarize", "Selection"} <= documented("hf_offload.selectors.base")
    assert {"HostBlockPool", "DeviceSlotPool"} <= documented("hf_offload.store")
    assert "OnlineSoftmax" in documented("hf_offload.kernels")
    assert {"plan", "ModelShape", "largest_batch", "largest_resident_batch"} <= documented("hf_offload.planner")
    assert {"run_bench", "fill_random"} <= documented("hf_offload.tools.bench")
    assert documented("eval_harness.runner")
    # Docstrings are rendered (Google style: "Args:" becomes an argument list), and packages link their modules.
    config = page("hf_offload.config")
    assert "budget_tokens" in config and "transfer_cap_blocks" in config
    assert "Arguments:" in page("hf_offload.planner")
    assert 'href="hf_offload/cache.html"' in page("hf_offload")
    search = (tmp_path / "search.js").read_text(encoding="utf-8")
    assert "register_selector" in search and "OffloadCache" in search
