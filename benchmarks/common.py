"""Helpers shared by the benchmark scripts: CUDA timing, run metadata and result files."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def synced_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished the work queued on it (CUDA; any other device: now)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def cuda_event_ms(fn, warmup: int, reps: int) -> list[float]:
    """Milliseconds of ``fn`` per repetition on the current stream (CUDA events), after ``warmup`` synced runs."""
    for _ in range(warmup):
        fn()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def cuda_timed(fn, repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs, timed with CUDA events after one warm-up run."""
    times = cuda_event_ms(fn, 1, repeat)
    return sorted(times)[len(times) // 2] / 1e3


def cuda_graph_us(fn, calls: int = 10, reps: int = 30, warmup: int = 3) -> float:
    """Median microseconds per call of ``fn(i)`` (``i``: the call's index, e.g. to alternate input sets) from CUDA
    graphs of ``calls`` calls: ``fn(0)`` and ``fn(1)`` run once outside the capture (compilation), then ``warmup``
    untimed replays and ``reps`` timed ones (CUDA events); the host's launch time is left out, as in a decode step's
    graph."""
    for i in range(min(calls, 2)):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    ms = cuda_event_ms(graph.replay, warmup=warmup, reps=reps)
    del graph
    return sorted(ms)[len(ms) // 2] * 1e3 / calls


def git_commit() -> str | None:
    """HEAD of this checkout, or ``$HF_OFFLOAD_GIT_COMMIT`` where the code runs from a copy without git."""
    if os.environ.get("HF_OFFLOAD_GIT_COMMIT"):
        return os.environ["HF_OFFLOAD_GIT_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return done.stdout.strip() or None
    except Exception:
        return None


_COMMIT_AT_START: list = []  # HEAD when this process first asked (its results record the code it started with)


def _commit_at_start() -> str | None:
    """:func:`git_commit` as it was at this process's first call (made at import), not when a long run ends."""
    if not _COMMIT_AT_START:
        _COMMIT_AT_START.append(git_commit())
    return _COMMIT_AT_START[0]


def _script() -> str:
    """The running script: its path relative to the repository where it lies inside it, else as given."""
    script = Path(sys.argv[0]).resolve()
    repo = Path(__file__).resolve().parent.parent
    return str(script.relative_to(repo)) if script.is_relative_to(repo) else sys.argv[0]


def run_metadata(args, **extra) -> dict:
    """Machine, versions, git commit, the script (its path in the repository where it lies there), arguments and
    ``extra`` for a results file."""
    import transformers

    cuda = torch.cuda.is_available()
    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        versions["triton"] = triton.__version__
    except ImportError:
        pass
    return {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "cpu_count": os.cpu_count(),
        },
        "versions": versions,
        "git_commit": _commit_at_start(),
        "script": _script(),
        "args": vars(args),
        **extra,
    }


def write_results(path: str, payload: dict) -> None:
    """Write ``payload`` as indented JSON to ``path`` (folders created; a file beside it renamed over it, so that a
    run stopped mid-write leaves the last whole file) and say where."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    part.write_text(json.dumps(payload, indent=1))
    os.replace(part, out)
    print(f"wrote {out}")


_commit_at_start()  # at import, i.e. when a benchmark script starts
