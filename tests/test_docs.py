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
