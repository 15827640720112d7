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


def test_a_gz_results_file_reads_like_its_plain_twin(tmp_path):
    """A results file committed gzip-compressed (``gzip -9 -n``) reads the same as the plain file it came from:
    lines of a study, a JSON file, and the order of a folder's files."""
    import gzip
    import json
    import shutil

    from eval_harness import files
    from eval_harness.runner import read_lines

    plain, packed = tmp_path / "plain" / "study", tmp_path / "packed" / "study"
    plain.mkdir(parents=True)
    lines = [{"type": "header", "x": "é"}, {"type": "result", "task": "t", "score": 1.0}]
    for name in ("study-1.jsonl", "study-1-b.jsonl", "study-2.jsonl"):
        (plain / name).write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines), encoding="utf-8")
    shutil.copytree(plain, packed)
    for name in ("study-1.jsonl", "study-2.jsonl"):  # a mix of plain and compressed files, as committed
        with (packed / name).open("rb") as src, gzip.GzipFile(packed / f"{name}.gz", "wb", 9, mtime=0) as dst:
            shutil.copyfileobj(src, dst)
        (packed / name).unlink()

    strip = lambda xs: [{k: v for k, v in x.items() if k != "_file"} for x in xs]  # noqa: E731
    assert strip(read_lines(tmp_path / "packed", "study")) == strip(read_lines(tmp_path / "plain", "study"))
    names = [p.name for p in files.find(plain, "*.jsonl")]
    assert [files.plain_name(p) for p in files.find(packed, "*.jsonl")] == names
    assert files.read_text(packed / "study-2.jsonl.gz") == (plain / "study-2.jsonl").read_text(encoding="utf-8")
    assert files.read_text(packed / "study-2.jsonl") == files.read_text(packed / "study-2.jsonl.gz")  # the .gz twin

    (plain / "a.json").write_text(json.dumps({"runs": [1, 2]}))
    with gzip.open(packed / "a.json.gz", "wt") as f:
        f.write(json.dumps({"runs": [1, 2]}))
    assert files.read_json(packed / "a.json.gz") == files.read_json(plain / "a.json") == {"runs": [1, 2]}


def test_every_committed_study_page_is_up_to_date(monkeypatch):
    """Each docs/results page of a RULER study, regenerated from results/ (plain and .gz jsonl files alike)."""
    from benchmarks import report
    from eval_harness.report import main

    monkeypatch.chdir(report.REPO)  # the pages name the results folder as the command sees it: results/STUDY/
    studies = sorted(p.stem for p in report.DOCS.glob("ruler_*.md"))
    assert studies
    assert [s for s in studies if main([s, "--check"]) != 0] == []
