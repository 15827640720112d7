"""LongBench: reading the jsonl format (folder, zip, URL), prompts, middle truncation, chat rule, buckets."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading
import zipfile

import pytest

from eval_harness.longbench import (
    LONGBENCH_E_TASKS,
    MAX_NEW_TOKENS,
    NO_CHAT_TASKS,
    PROMPTS,
    LongBenchSuite,
    build_prompt,
    length_bucket,
    load_records,
    middle_truncate,
)

from ..fixtures.tiny import LONGBENCH_DIR, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_load_records_from_folder_with_stdlib():
    records = load_records(LONGBENCH_DIR, "hotpotqa", e=True, use_datasets=False)
    assert [r["_id"] for r in records] == ["hq-e-0001", "hq-e-0002"]
    assert records[0]["answers"] == ["Kettlewick"] and records[0]["dataset"] == "hotpotqa_e"
    assert load_records(LONGBENCH_DIR, "hotpotqa", use_datasets=False)[0]["_id"] == "hq-0001"


def test_load_records_through_datasets():
    pytest.importorskip("datasets")
    via_datasets = load_records(LONGBENCH_DIR, "trec", e=True, use_datasets=True)
    assert via_datasets == load_records(LONGBENCH_DIR, "trec", e=True, use_datasets=False)


def test_load_records_from_zip(tmp_path):
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.write(LONGBENCH_DIR / "lcc_e.jsonl", "data/lcc_e.jsonl")
    records = load_records(str(archive), "lcc", e=True, use_datasets=False)
    assert records[0]["answers"] == ["    return total / len(values)"]


def test_load_records_from_url(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_OFFLOAD_CACHE", str(tmp_path / "cache"))
    with zipfile.ZipFile(tmp_path / "served.zip", "w") as z:
        z.write(LONGBENCH_DIR / "trec_e.jsonl", "data/trec_e.jsonl")
    shutil.copytree(LONGBENCH_DIR, tmp_path / "site")
    shutil.move(tmp_path / "served.zip", tmp_path / "site" / "data.zip")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "site"))
    handler.log_message = lambda *a, **k: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        records = load_records(url, "passage_count", e=True, use_datasets=False)
        assert records[0]["answers"] == ["4"]
        # a zip URL is downloaded once into the cache, then read from there
        assert load_records(url + "/data.zip", "trec", e=True, use_datasets=False)[1]["answers"] == ["Date"]
        assert len(list((tmp_path / "cache" / "longbench").glob("*-data.zip"))) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no qasper_e.jsonl"):
        load_records(tmp_path, "qasper", e=True, use_datasets=False)
    bad = tmp_path / "qasper.jsonl"
    bad.write_text(json.dumps({"input": "q", "context": "c", "answers": ["a"]}) + "\n")
    with pytest.raises(ValueError, match="lacks the LongBench field"):
        load_records(tmp_path, "qasper", use_datasets=False)


def test_prompt_template_and_chat_rule(tok):
    record = load_records(LONGBENCH_DIR, "hotpotqa", e=True, use_datasets=False)[0]
    ids, cut = build_prompt(tok, "hotpotqa", record, 100_000)
    text = tok.decode(ids)
    assert not cut
    assert text == tok.apply_chat_template(
        [{"role": "user", "content": PROMPTS["hotpotqa"].format(**record)}], tokenize=False, add_generation_prompt=True
    )
    trec = load_records(LONGBENCH_DIR, "trec", e=True, use_datasets=False)[0]
    ids, _ = build_prompt(tok, "trec", trec, 100_000)
    assert "trec" in NO_CHAT_TASKS and "<|im_start|>" not in tok.decode(ids)
    assert tok.decode(ids) == PROMPTS["trec"].format(**trec)


def test_middle_truncation_keeps_both_ends(tok):
    record = load_records(LONGBENCH_DIR, "hotpotqa", e=True, use_datasets=False)[0]
    full = PROMPTS["hotpotqa"].format(**record)
    ids = tok(full)["input_ids"]
    assert len(ids) > 200
    text, cut = middle_truncate(tok, full, 200)
    assert cut
    assert text == tok.decode(ids[:100]) + tok.decode(ids[-100:])
    assert text.startswith("Answer the question based on the given passages.")
    assert text.endswith(f"Question: {record['input']}\nAnswer:")
    prompt, cut = build_prompt(tok, "hotpotqa", record, 200, chat=False)
    assert cut and abs(len(prompt) - 200) <= 2  # re-tokenized at the joint, as the release does


def test_suite_samples(tok):
    suite = LongBenchSuite(tok, data=str(LONGBENCH_DIR), e=True, use_datasets=False)
    assert suite.resolve_tasks("all") == list(LONGBENCH_E_TASKS)
    assert suite.resolve_tasks(["qasper_e", "lcc"]) == ["qasper", "lcc"]
    with pytest.raises(ValueError, match="not a longbench_e dataset"):
        suite.resolve_tasks(["dureader"])
    samsum = suite.samples("samsum", 4096)[0]
    assert samsum["max_new_tokens"] == MAX_NEW_TOKENS["samsum"] == 128 and samsum["stop_at_newline"]
    hotpot = suite.samples("hotpotqa", 128)
    assert [s["extra"]["truncated"] for s in hotpot] == [True, True]
    assert hotpot[0]["max_new_tokens"] == 32 and not hotpot[0]["stop_at_newline"]
    assert hotpot[1]["outputs"] == ["Salmon", "salmon"]
    assert suite.score("hotpotqa", hotpot[1], "salmon.") == 100.0
    assert suite.sample_ids("trec", 4096) == ["trec-e-0001", "trec-e-0002"]
    one = LongBenchSuite(tok, data=str(LONGBENCH_DIR), e=True, samples=1, use_datasets=False)
    assert one.sample_ids("trec", 4096) == one.sample_ids("trec", 4096) and len(one.sample_ids("trec", 4096)) == 1


def test_length_buckets():
    # the release's eval.py: length < 4000 -> 0-4k, < 8000 -> 4-8k, else 8k+
    assert [length_bucket(x) for x in (0, 3999, 4000, 7999, 8000, 20000)] == [
        "0-4k", "0-4k", "4-8k", "4-8k", "8k+", "8k+"
    ]  # fmt: skip


def test_fixture_is_copyable(tmp_path):
    # a folder laid out like the release's zip (data/...) is found too
    shutil.copytree(LONGBENCH_DIR, tmp_path / "data")
    assert load_records(tmp_path, "lcc", e=True, use_datasets=False)[0]["_id"] == "lcc-e-0001"
