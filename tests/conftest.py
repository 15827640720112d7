"""Shared fixtures and the markers that say what a test needs.

Markers (declared in pyproject.toml) are applied here, so a test states its need once and the skip names it:

- ``cuda``: needs CUDA (skip reason "needs CUDA").
- ``triton``: needs the Triton kernels to run: Triton on CUDA, or Triton's CPU interpreter (``TRITON_INTERPRET=1``)
  without one.

Every skip reason says what would make the test run; the end of a run counts the skips by reason.
"""

from __future__ import annotations

import collections
import os
import re

import pytest
import torch

from hf_offload.kernels.gather import kernels_available

from .helpers import ARCHS

NEEDS_CUDA = "needs CUDA"
NEEDS_TRITON = "needs Triton on CUDA, or TRITON_INTERPRET=1 with triton installed"

# The install command of each optional module a test imports with ``pytest.importorskip``.
INSTALL = {
    "pdoc": "pip install 'hf-offload[docs]'",
    "datasets": "pip install 'hf-offload[eval]'",
    "jieba": "pip install 'hf-offload[eval]'",
    "gguf": "pip install 'hf-offload[test]'",
    "rapidfuzz": "pip install 'hf-offload[test]'",
    "rouge": "pip install 'hf-offload[test]' (rouge 1.0.1, the reference the ROUGE-L metric is compared with)",
}
_NOT_IMPORTED = re.compile(r"could not import '([\w.]+)'")


def pytest_configure(config):
    """Under pytest-xdist, each worker takes its share of the cores for torch's threads: the tiny models' operations
    are too small to gain from threads, and more threads than cores over all workers only make them wait."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    triton = kernels_available(torch.device("cuda" if cuda else "cpu"))
    for item in items:
        if not cuda and item.get_closest_marker("cuda"):
            item.add_marker(pytest.mark.skip(reason=NEEDS_CUDA))
        elif not triton and item.get_closest_marker("triton"):
            item.add_marker(pytest.mark.skip(reason=NEEDS_TRITON))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A skip for a missing optional module names the command that installs it."""
    report = yield
    if report.skipped and isinstance(report.longrepr, tuple):
        path, line, reason = report.longrepr
        found = _NOT_IMPORTED.search(reason)
        if found:
            module = found.group(1).split(".")[0]
            report.longrepr = (path, line, f"Skipped: needs {module}: {INSTALL.get(module, f'pip install {module}')}")
    return report


def pytest_terminal_summary(terminalreporter):
    """The skipped tests counted by reason, most first."""
    reasons = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        if isinstance(report.longrepr, tuple):
            reasons[report.longrepr[2].removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", "skipped tests by reason")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:5d}  {reason}")


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """Give every test the grad mode it started with: benchmark entry points that tests call in-process switch
    autograd off for their whole run."""
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)
