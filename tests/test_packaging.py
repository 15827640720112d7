"""``python -m build`` makes an sdist and, from it, a wheel that holds every module and runs the README's quickstart.

The wheel is installed without its dependencies into a folder of its own, and the quickstart runs from there in a
fresh interpreter outside the checkout (torch and transformers come from this environment), so a module or file the
wheel lacks fails here. About 15 s on two cores, most of it pip fetching setuptools into the isolated build
environment (the build needs the package index, as installing the test extra does).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("hf_offload", "eval_harness")


def _build(out: Path) -> tuple[Path, Path, str]:
    """``(wheel, sdist, build output)`` of ``python -m build`` on this checkout (the wheel is built from the sdist)."""
    done = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(REPO)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,), (sdist,) = out.glob("*.whl"), out.glob("*.tar.gz")
    return wheel, sdist, done.stdout + done.stderr


def _checkout_modules() -> set[str]:
    return {str(p.relative_to(REPO)) for package in PACKAGES for p in (REPO / package).rglob("*.py")}


def test_sdist_and_wheel_build_install_and_run_the_quickstart(tmp_path):
    # one test, so that pytest-xdist builds once
    pytest.importorskip("build")
    wheel, sdist, log = _build(tmp_path / "dist")

    # no deprecation warning (the license is an SPDX expression), the license file travels
    assert "deprecated" not in log.lower()
    metadata = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-py3')[0]}.dist-info/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata

    # every module of the checkout is in both
    names = set(zipfile.ZipFile(wheel).namelist())
    assert _checkout_modules() - names == set()
    assert any(n.endswith("entry_points.txt") for n in names) and any(n.endswith("licenses/LICENSE") for n in names)
    with tarfile.open(sdist) as tar:
        root = tar.getnames()[0].split("/")[0]
        inside = {n.removeprefix(root + "/") for n in tar.getnames()}
    assert _checkout_modules() | {"pyproject.toml", "README.md", "LICENSE"} <= inside

    # installed alone, the wheel runs the README's quickstart and the command line
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    quickstart = next(b for b in blocks if "LlamaConfig" in b)
    script = tmp_path / "quickstart.py"
    script.write_text("import hf_offload, eval_harness.metrics\nprint(hf_offload.__file__)\n" + quickstart)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(target), "HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, *rest = done.stdout.splitlines()
    assert first.startswith(str(target / "hf_offload")), first  # the wheel's copy, not the checkout's
    assert "hit rate" in rest[-1]
    cli = [sys.executable, str(target / "bin" / "hf-offload"), "--help"]
    done = subprocess.run(cli, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "plan" in done.stdout, done.stderr[-2000:]
