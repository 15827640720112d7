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
