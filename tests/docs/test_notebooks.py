"""The notebooks: stored as valid nbformat 4 JSON without outputs, and each runs to its end at the small size.

The notebooks run inside this process without Jupyter: the code cells of one notebook are executed in order in one
namespace (as a kernel would), with ``HF_OFFLOAD_NOTEBOOK_SIZE=small`` and matplotlib (where installed) on the
non-interactive Agg backend. Each notebook leaves its numbers in the namespace (``SUMMARY``, ``results``), and the
checks below assert on those, not on printed text.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from hf_offload.selectors import SELECTORS

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
SIZE_SWITCH = 'SIZE = os.environ.get("HF_OFFLOAD_NOTEBOOK_SIZE", "small")'

# nbformat 4 cell keys (v4.5 schema): anything else, e.g. stored outputs on a markdown cell, is invalid.
_CELL_KEYS = {
    "code": {"cell_type", "id", "metadata", "source", "execution_count", "outputs"},
    "markdown": {"cell_type", "id", "metadata", "source", "attachments"},
    "raw": {"cell_type", "id", "metadata", "source", "attachments"},
}
_CELL_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _source(cell: dict) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


def _code_cells(notebook: dict) -> list[str]:
    return [_source(cell) for cell in notebook["cells"] if cell["cell_type"] == "code"]


# ------------------------------------------------------------------------------------------------ what each leaves
def _check_quickstart(ns: dict) -> None:
    s = ns["SUMMARY"]
    assert s["size"] == "small"
    assert s["exact_identical"] is True  # a budget covering the context reproduces DynamicCache's tokens
    assert 0 < s["device_kv_bytes"] < s["dense_kv_bytes"]  # the sparse budget keeps less KV on the device
    assert 0 < s["host_kv_bytes"] <= s["dense_kv_bytes"]
    assert s["device_summary_bytes"] > 0 and s["recalled_bytes"] >= s["decode_recalled_bytes"] >= 0
    assert 0.0 <= s["hit_rate"] <= 1.0
    assert s["decode_steps"] == len(s["offload_tokens"]) - 1  # the first new token comes from the prefill
    assert s["peak_bytes"] == {"dense": None, "offload": None}  # measured on CUDA only


def _check_sweep(ns: dict) -> None:
    results, budgets, selectors = ns["results"], ns["BUDGETS"], ns["SELECTOR_NAMES"]
    assert len(results) == len(budgets) * len(selectors) == ns["SUMMARY"]["rows"]  # one row per (selector, budget)
    assert {(r["selector"], r["budget_tokens"]) for r in results} == {(s, b) for s in selectors for b in budgets}
    assert all(0.0 <= r["quality"] <= 1.0 for r in results)
    assert ns["dense_quality"] == 1.0  # the agreement measure scores dense against itself as 1
    for selector in selectors:
        rows = sorted((r for r in results if r["selector"] == selector), key=lambda r: r["budget_tokens"])
        device = [r["device_kv_bytes"] for r in rows]
        if selector == "streaming":  # its slot pool holds sink + window only, whatever the budget
            assert len(set(device)) == 1
        else:
            assert device == sorted(device) and device[0] < device[-1]  # the slot pool grows with the budget
        assert all(d < ns["dense_kv"] for d in device)
        assert len({r["host_kv_bytes"] for r in rows}) == 1  # the host holds the whole context at every budget
    streaming = {r["quality"] for r in results if r["selector"] == "streaming"}
    assert len(streaming) == 1  # sink + window only: the budget does not change what it attends to


def _check_selector(ns: dict) -> None:
    s, results, budgets = ns["SUMMARY"], ns["results"], ns["BUDGETS"]
    assert s["planted_best_block"] == 5
    assert s["registered"] is True
    assert {r["selector"] for r in results} == {"meankey", "solohead", "headwise"}
    assert len(results) == 3 * len(budgets) == s["rows"]
    assert all(0.0 <= r["agreement"] <= 1.0 for r in results)
    for budget in budgets:
        summary_bytes = {r["selector"]: r["device_summary_bytes"] for r in results if r["budget_tokens"] == budget}
        assert 2 * summary_bytes["meankey"] == summary_bytes["solohead"]  # one mean key vs. kmin + kmax


CHECKS = {
    "01_quickstart.ipynb": _check_quickstart,
    "02_budget_sweep.ipynb": _check_sweep,
    "03_writing_a_selector.ipynb": _check_selector,
}


# ---------------------------------------------------------------------------------------------------------- tests
def test_the_three_notebooks_exist():
    assert set(CHECKS) <= {path.name for path in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_nbformat4_without_outputs(path):
    nb = _load(path)
    assert nb["nbformat"] == 4 and isinstance(nb["nbformat_minor"], int)
    assert isinstance(nb["metadata"], dict) and isinstance(nb["cells"], list) and nb["cells"]
    assert set(nb) <= {"cells", "metadata", "nbformat", "nbformat_minor"}
    ids = []
    for cell in nb["cells"]:
        kind = cell["cell_type"]
        assert kind in _CELL_KEYS, kind
        assert set(cell) <= _CELL_KEYS[kind], (kind, set(cell) - _CELL_KEYS[kind])
        assert isinstance(cell["metadata"], dict)
        source = cell["source"]
        assert isinstance(source, str) or all(isinstance(line, str) for line in source)
        if nb["nbformat_minor"] >= 5:
            assert _CELL_ID.match(cell["id"]), cell["id"]
            ids.append(cell["id"])
        if kind == "code":
            assert cell["outputs"] == [], "clear the outputs before committing"
            assert cell["execution_count"] is None, "clear the outputs before committing"
            for line in _source(cell).splitlines():
                assert not line.lstrip().startswith(("!", "%")), f"no shell or magic commands: {line!r}"
    assert len(ids) == len(set(ids)), "cell ids must be unique"
    code = _code_cells(nb)
    assert SIZE_SWITCH in code[0], "the first code cell holds the size switch"


@pytest.mark.filterwarnings("ignore:FigureCanvasAgg is non-interactive")
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_at_small_size(path, monkeypatch):
    monkeypatch.setenv("HF_OFFLOAD_NOTEBOOK_SIZE", "small")
    monkeypatch.setenv("MPLBACKEND", "Agg")  # read when matplotlib is first imported
    if "matplotlib" in sys.modules:
        sys.modules["matplotlib"].use("Agg")
    registered = dict(SELECTORS)  # a notebook may register a selector by name; leave the registry as it was
    namespace = {"__name__": "__main__"}
    try:
        for number, source in enumerate(_code_cells(_load(path)), start=1):
            exec(compile(source, f"{path.name}, code cell {number}", "exec"), namespace)
    finally:
        SELECTORS.clear()
        SELECTORS.update(registered)
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
    assert "SUMMARY" in namespace, "the last code cell sets SUMMARY"
    assert namespace["SUMMARY"]["size"] == "small"
    CHECKS.get(path.name, lambda ns: None)(namespace)
