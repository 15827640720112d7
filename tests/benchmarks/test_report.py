"""benchmarks/report.py: how the generated pages name the methods of a results file."""

from __future__ import annotations


def test_method_labels_name_the_selector_and_graphs_off():
    from benchmarks.report import _method_label

    def label(**args):
        return _method_label({"metadata": {"args": args}})

    assert label(quantkey_selector="quantkey")("quantkey-auto") == "quantkey-auto"
    assert label(quantkey_selector="quantkey[bits=4]")("quantkey") == "quantkey (quantkey[bits=4])"
    assert label(quantkey_selector="quantkey[bits=4]")("dynamic") == "dynamic"
    off = label(quantkey_selector="quantkey[bits=4]", cuda_graphs="off")
    assert off("quantkey") == "quantkey (quantkey[bits=4], cuda_graphs=False)"
    assert off("solohead") == "solohead (cuda_graphs=False)"
    assert off("quantkey-graphs") == "quantkey-graphs (quantkey[bits=4])"  # graphs forced on: no note
    assert label()("solohead") == "solohead"  # files from before either option


def test_summary_page_ranks_each_method_at_its_best_batch(tmp_path):
    """The summary page from a folder of bench_decode files (here the committed same-run files at 64K and 128K):
    each method's best batch, its ratio to DynamicCache's best, and OffloadCache against headwise-copy at the same
    batch."""
    import json
    import shutil

    from benchmarks import report

    src = report.REPO / "results" / "decode" / "same_run_h200"
    folder = tmp_path / "summary"
    folder.mkdir()
    for name in ("bench_decode_64k_same_run.json", "bench_decode_128k_same_run.json"):
        shutil.copy(src / name, folder / name)
    page = report.render_summary(folder)
    runs = json.loads((src / "bench_decode_64k_same_run.json").read_text())["runs"]
    best = {m: max((r for r in runs if r["method"] == m), key=lambda r: r["tokens_per_s"])
            for m in ("dynamic", "quantkey-auto")}
    ratio = best["quantkey-auto"]["tokens_per_s"] / best["dynamic"]["tokens_per_s"]
    row = next(line for line in page.splitlines() if line.startswith("| quantkey-auto | 12 |"))
    assert f"{ratio:.2f}x" in row and "## 65,536 tokens" in page and "## 131,072 tokens" in page
    head = next(r for r in runs if r["method"] == "headwise-copy")
    ours = next(r for r in runs if r["method"] == "quantkey-auto" and r["batch"] == head["batch"])
    assert f"**{ours['tokens_per_s'] / head['tokens_per_s']:.1f}x**" in page
    assert report.render_summary(tmp_path / "empty") is None  # no folder, no bench_decode file: no page
