"""Dependencies point one way: tools -> library -> kernels, and no import cycles among the library's modules.

Every module under ``hf_offload`` is parsed with ``ast`` (nothing is imported), function-local imports included:
- nothing outside ``hf_offload/tools`` imports ``hf_offload.tools``, ``eval_harness`` or ``benchmarks``;
- modules under ``hf_offload/kernels`` import nothing from ``hf_offload`` outside ``kernels``;
- the module-level imports among ``hf_offload``'s modules form no cycle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_offload"


@dataclass(frozen=True)
class Import:
    """One imported module, resolved to its absolute dotted name.

    Attributes:
        target: the imported module, e.g. ``hf_offload.cache`` (for ``from .cache import X`` and ``import
            hf_offload.cache``); for ``from package import name`` the name is a candidate submodule too (see
            :func:`imports`).
        line: the line of the import statement.
        top_level: the statement runs when the module is imported (module body, also inside ``if`` / ``try``),
            not only when a function or class body's function runs; ``if TYPE_CHECKING:`` blocks are not top level.
    """

    target: str
    line: int
    top_level: bool


def module_name(path: Path) -> str:
    """``hf_offload/cache/blocks.py`` -> ``hf_offload.cache.blocks``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    found = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}
    assert "hf_offload" in found and "hf_offload.planner" in found, "the package was not found"
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_import(call: ast.Call) -> str | None:
    """The module of ``importlib.import_module("x")`` or ``__import__("x")`` when given as a literal string."""
    func = call.func
    named = (isinstance(func, ast.Name) and func.id in ("__import__", "import_module")) or (
        isinstance(func, ast.Attribute) and func.attr == "import_module"
    )
    if named and call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def imports(name: str, path: Path, known: set[str]) -> list[Import]:
    """The imports of one module, relative ones resolved against ``name``; ``importlib.import_module`` and
    ``__import__`` calls with a literal module name count too.

    ``from pkg import x`` yields ``pkg.x`` where that is a module in ``known``, else ``pkg`` (an attribute of it).
    """
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, top_level: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(Import(alias.name, child.lineno, top_level) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (child.level - 1)]
                    base = ".".join(base_parts + ([child.module] if child.module else []))
                else:
                    base = child.module or ""
                for alias in child.names:
                    sub = f"{base}.{alias.name}"
                    found.append(Import(sub if sub in known else base, child.lineno, top_level))
            elif isinstance(child, ast.Call) and _dynamic_import(child) is not None:
                target = _dynamic_import(child)
                level = len(target) - len(target.lstrip("."))
                if level:
                    base_parts = package.split(".")
                    target = ".".join(base_parts[: len(base_parts) - (level - 1)] + [target[level:]])
                found.append(Import(target, child.lineno, top_level))
                visit(child, top_level)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                visit(child, False)
            else:  # class bodies, if / try / with blocks run at import time
                visit(child, top_level)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)), True)
    return found


def _all_imports() -> dict[str, list[Import]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def _within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def test_the_import_parser_sees_relative_absolute_and_function_local_imports(tmp_path):
    source = (
        "import os\nfrom typing import TYPE_CHECKING\nfrom .cache import X\nfrom .. import planner\n"
        "if TYPE_CHECKING:\n    from .store import Y\n"
        "def f():\n    import eval_harness.needle\n    from hf_offload.tools import models\n"
        "    importlib.import_module('benchmarks.report')\n    __import__('..kernels', fromlist=['x'])\n"
    )
    path = tmp_path / "hf_offload" / "sub" / "mod.py"
    path.parent.mkdir(parents=True)
    path.write_text(source, encoding="utf-8")
    got = {(i.target, i.top_level) for i in imports("hf_offload.sub.mod", path, {"hf_offload.planner"})}
    assert got == {("os", True), ("typing", True), ("hf_offload.sub.cache", True), ("hf_offload.planner", True),
                   ("hf_offload.sub.store", False), ("eval_harness.needle", False),
                   ("hf_offload.tools", False), ("benchmarks.report", False),
                   ("hf_offload.kernels", False)}  # fmt: skip


def test_the_library_never_imports_the_tools_the_evaluation_or_the_benchmarks():
    forbidden = ("hf_offload.tools", "eval_harness", "benchmarks")
    wrong = [
        f"{name} (line {i.line}) imports {i.target}"
        for name, found in _all_imports().items()
        if not _within(name, "hf_offload.tools")
        for i in found
        if any(_within(i.target, f) for f in forbidden)
    ]
    assert not wrong, "the library imports a layer above it:\n" + "\n".join(wrong)


def test_kernels_import_nothing_above_them():
    wrong = [
        f"{name} (line {i.line}) imports {i.target}"
        for name, found in _all_imports().items()
        if _within(name, "hf_offload.kernels")
        for i in found
        if _within(i.target, "hf_offload") and not _within(i.target, "hf_offload.kernels")
    ]
    assert not wrong, "a kernel imports a layer above it:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_cycle_finder():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_cycles_among_the_library_modules_at_module_level():
    graph: dict[str, set[str]] = {}
    for name, found in _all_imports().items():
        graph[name] = set()
        for i in found:
            # A package's own ``__init__`` importing its submodules, and a submodule importing a sibling through the
            # package, are ordinary; an edge to the importing module's own package is left out for that reason.
            if i.top_level and _within(i.target, "hf_offload") and i.target != name and not _within(name, i.target):
                graph[name].add(i.target)
    cycles = _cycles(graph)
    assert not cycles, "module-level import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_tools_are_the_only_place_the_console_script_and_the_model_fetcher_live():
    found = modules()
    assert {"hf_offload.tools.cli", "hf_offload.tools.models", "hf_offload.tools.plan"} <= set(found)
    assert not {"hf_offload.cli", "hf_offload.models", "hf_offload.demo", "hf_offload.bench"} & set(found)
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert 'hf-offload = "hf_offload.tools.cli:main"' in pyproject


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
