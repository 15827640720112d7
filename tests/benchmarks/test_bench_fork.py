"""The fork benchmark: the three ways answer every question, the refilled fork with the new fork's tokens."""

from __future__ import annotations

import json

from benchmarks import bench_fork


def test_every_way_answers_and_the_refilled_fork_answers_as_a_new_one(tmp_path, capsys):
    out = tmp_path / "forks.json"
    assert bench_fork.main(["--shape", "tiny", "--layers", "2", "--context", "300", "--question", "7",
                            "--questions", "3", "--new-tokens", "5", "--budget", "4096", "--dtype", "float32",
                            "--device", "cpu", "--profile", "--out", str(out)]) == 0  # fmt: skip
    result = json.loads(out.read_text())
    assert result["complete"] and result["metadata"]["workload"] == bench_fork.WORKLOAD
    rows, summary = result["rows"], result["summary"]
    for way in bench_fork.WAYS:
        assert [r["question"] for r in rows[way]] == [0, 1, 2]
        assert all(len(r["tokens"]) == 5 and 0 <= r["make_s"] <= r["ttft_s"] <= r["total_s"] for r in rows[way])
    # A budget over the whole context: all three give the same tokens.
    assert summary["into"]["same_tokens_as_new"] == summary["dynamic"]["same_tokens_as_new"] == 3
    assert summary["new_total_over_into"] == summary["new"]["total_s"] / summary["into"]["total_s"]
    assert "new fork / refilled fork" in capsys.readouterr().out
    # The profile of one more refilled question: operations per source line, this library's among them.
    profile = result["profile"]
    assert profile["kind"] == "top-level aten operations"
    assert profile["events"] == sum(n for _, n, _ in profile["by_line"]) > 0
    lines = [line for line, _, _ in profile["by_line"]]
    assert any(line.startswith(("cache/", "attention/", "kernels/", "store/")) and ".py(" in line for line in lines)
    # Per line, the operations by name; their totals add up to the events.
    assert set(profile["by_kind"]) == set(lines)
    assert sum(profile["kinds"].values()) == profile["events"]
    assert all(sum(profile["by_kind"][line].values()) == n for line, n, _ in profile["by_line"])
    assert all(kind.startswith("aten::") for kind in profile["kinds"])
    assert sum(n for _, n in profile["aten_ops_by_line"]) == profile["events"]  # the same operations on the CPU


def test_host_calls_are_sorted_into_launches_copies_memsets_and_syncs():
    assert [bench_fork._host_call_kind(name) for name in bench_fork.HOST_CALLS] == [
        "launch", "launch", "launch", "launch", "copy", "memset", "sync", "sync", "sync"]


def test_each_runtime_call_goes_to_the_innermost_frame_that_holds_it():
    """Attribution by time: a call inside a nested frame goes to the inner one, one after it back to the outer,
    one outside every frame to "?", and frames of other code are skipped."""
    from types import SimpleNamespace

    def event(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    outer = event("hf_offload/cache/blocks.py(10): refill", 0, 100)
    inner = event("site-packages/hf_offload/attention/prefill.py(20): add", 10, 30)
    other = event("torch/nn/modules/module.py(5): _call_impl", 12, 20)
    calls = [event("cudaLaunchKernel", 15, 16), event("cudaMemcpyAsync", 40, 41), event("cudaLaunchKernel", 150, 151),
             event("cudaLaunchKernel", 30, 31)]  # fmt: skip
    assert bench_fork.source_lines([outer, inner, other, *calls], calls) == [
        "attention/prefill.py(20): add", "cache/blocks.py(10): refill", "?", "attention/prefill.py(20): add"]
