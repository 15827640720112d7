"""The README's quickstart runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_quickstart_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    quickstart = next(b for b in blocks if "Quickstart" in b or "LlamaConfig" in b)
    exec(compile(quickstart, "README-quickstart", "exec"), {})
    assert "hit rate" in capsys.readouterr().out


def test_generated_results_tables_are_up_to_date():
    import subprocess
    import sys

    script = README.parent / "benchmarks" / "report.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_every_public_name_the_docs_mention_imports():
    import importlib

    root = README.parent
    texts = [README, root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md"))]
    names: set[str] = set()
    for path in texts:
        text = path.read_text()
        for module, imported in re.findall(r"from (hf_offload[\w.]*) import ([\w, ]+)", text):
            names.update(f"{module}.{name.strip()}" for name in imported.split(",") if name.strip())
        names.update(re.findall(r"\b(hf_offload(?:\.\w+)+)", text))
    assert len(names) >= 5
    for dotted in sorted(names):
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"{dotted} (mentioned in the docs) does not exist"
            obj = getattr(obj, attr)


def test_every_path_the_guides_cite_exists():
    """Links and backticked repository paths (``results/...``, ``hf_offload/...``; ``{a,b}`` and ``*`` expanded) of
    the tuning guide, the troubleshooting page and the results index name files that exist. docs/history.md may name
    removed raw files: it says they are in the git history."""
    root = README.parent
    roots = ("results/", "docs/", "hf_offload/", "benchmarks/", "tests/", "notebooks/", "recipes/", "eval_harness/")

    def expand(text: str) -> list[str]:
        m = re.search(r"\{([^{}]*)\}", text)
        if not m:
            return [text]
        return [x for alt in m.group(1).split(",") for x in expand(text[: m.start()] + alt + text[m.end():])]

    missing = []
    for page in (root / "docs" / "tuning.md", root / "docs" / "troubleshooting.md", root / "results" / "README.md"):
        text = page.read_text()
        paths = [page.parent / t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)
                 if not t.startswith(("http", "#", "mailto"))]  # fmt: skip
        for code in re.findall(r"`([^`\n]+)`", text):
            if code.startswith(roots) and " " not in code:
                paths += [root / p for p in expand(code.split("#")[0])]
        missing += [f"{page.name}: {p}" for p in paths
                    if not (any(p.parent.glob(p.name)) if "*" in p.name else p.exists())]  # fmt: skip
    assert not missing, missing
