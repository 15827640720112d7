"""The README's quickstart runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


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
