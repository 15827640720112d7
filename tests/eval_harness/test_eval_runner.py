"""The evaluation runner end to end on a tiny random model: RULER and LongBench-E with dense and OffloadCache,
metrics recorded, resume, errors, report and the ``eval`` command."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from eval_harness.cli import main
from eval_harness.longbench import LongBenchSuite
from eval_harness.metrics import ruler_postprocess, string_match_all_one
from eval_harness.report import render, write_report
from eval_harness.rescore import rescore_file
from eval_harness.ruler import RulerSuite
from eval_harness.runner import parse_budget, read_study, run_study
from hf_offload import OffloadCache

from ..fixtures.tiny import LONGBENCH_DIR, tiny_model, tiny_tokenizer

LB_TASKS = ["hotpotqa", "trec", "passage_count", "lcc", "samsum"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(len(tok))


def cache_factory(model):
    def make_cache(method, budget):
        if method == "dense":
            return DynamicCache(config=model.config)
        return OffloadCache(
            model, budget_tokens=budget, block_tokens=16, sink_tokens=16, window_tokens=16, selector=method
        )

    return make_cache


def ruler_run(tmp_path, tok, model, **kw):
    args = dict(
        study="ruler_tiny", suite=RulerSuite(tok, samples=2), model=model, tokenizer=tok,
        make_cache=cache_factory(model), tasks=["niah_single_1", "vt"], lengths=[512], methods=["dense", "solohead"],
        budgets=[128], results_dir=tmp_path, max_new_tokens=6, progress=False,
    )  # fmt: skip
    args.update(kw)
    return run_study(**args)


def test_ruler_run_records_scores_and_resumes(tmp_path, tok, model, monkeypatch):
    monkeypatch.setenv("HF_OFFLOAD_MODELS", "/models")  # a setting the header records
    first = ruler_run(tmp_path, tok, model)
    assert (first.ran, first.skipped, first.failed) == (8, 0, 0)  # 2 tasks x 2 methods x 2 samples
    lines = [json.loads(x) for x in first.path.read_text().splitlines()]
    header, results = lines[0], lines[1:]
    assert header["type"] == "header" and header["study"] == "ruler_tiny"
    assert {"machine", "versions", "git_commit", "source_sha256", "suite_info"} <= set(header)
    assert header["suite_info"]["not_built"].keys() == {"qa_1", "qa_2"}
    assert header["environment"]["HF_OFFLOAD_MODELS"] == "/models"
    assert "HF_OFFLOAD_GIT_COMMIT" not in header["environment"]
    for r in results:
        assert r["type"] == "result" and r["length"] == 512 and isinstance(r["prediction"], str)
        assert r["score"] == 100.0 * string_match_all_one(ruler_postprocess(r["prediction"]), r["references"])
        assert r["new_tokens"] <= 6 and r["time_s"] > 0
        target = 512 - (128 if r["task"] == "niah_single_1" else 30)
        assert r["prompt_tokens"] == r["extra"]["target_prompt_tokens"] == target
        if r["method"] == "dense":
            assert r["budget"] is None and r["budget_tokens"] is None and "cache" not in r
        else:
            assert r["budget"] == "128" and r["budget_tokens"] == 128
            assert r["cache"]["host_kv_bytes"] > 0 and r["cache"]["hit_rate"] is not None

    again = ruler_run(tmp_path, tok, model)
    assert (again.ran, again.skipped, again.path) == (0, 8, None)  # everything was done: no new file

    # an interrupted run: the last three results are missing -> only those run
    first.path.write_text("\n".join(json.dumps(x) for x in lines[:-3]) + "\n")
    resumed = ruler_run(tmp_path, tok, model)
    assert (resumed.ran, resumed.skipped) == (3, 5)
    _, all_results = read_study(tmp_path, "ruler_tiny")
    assert len(all_results) == 8

    md = render("ruler_tiny", tmp_path)
    assert "| dense |" in md and "| solohead 128 |" in md and "## Not built" in md and "`qa_1`" in md
    assert "| niah_single_1 | 512 |" in md
    hits = md.split("## Mean decode hit rate of the slot pool")[1].split("##")[0]
    assert "| solohead 128 |" in hits and "| dense |" not in hits  # dense has no cache stats
    missed = md.split("## Mean estimated attention left out")[1].split("##")[0]
    shares = [r["missed_mass"]["mean"] for r in all_results if r["method"] == "solohead"]
    assert all(0 < x < 1 for x in shares) and len(shares) == 4
    assert f"| solohead 128 | {sum(shares) / len(shares):.3f} |" in missed and "| dense |" not in missed


def test_longbench_e_run_and_report(tmp_path, tok, model):
    suite = LongBenchSuite(tok, data=str(LONGBENCH_DIR), e=True, use_datasets=False)
    summary = run_study(
        study="lbe_tiny", suite=suite, model=model, tokenizer=tok, make_cache=cache_factory(model), tasks=LB_TASKS,
        lengths=[256], methods=["dense", "streaming"], budgets=["1/2"], budget_min_tokens=64, results_dir=tmp_path,
        max_new_tokens=4, progress=False,
    )  # fmt: skip
    assert (summary.ran, summary.failed) == (14, 0)  # 7 records x 2 methods
    _, results = read_study(tmp_path, "lbe_tiny")
    by_id = {(r["sample_id"], r["method"]): r for r in results}
    streaming = by_id[("hq-e-0001", "streaming")]
    assert streaming["budget_tokens"] == max(64, (streaming["prompt_tokens"] + 4) // 2)
    assert streaming["extra"]["truncated"] and streaming["extra"]["source_length"] == 1850
    for r in results:
        assert r["score"] == 100.0 * suite_score(suite, r)
    # the file alone scores again to the same numbers (trec's class names travel in "extra")
    (path,) = (tmp_path / "lbe_tiny").glob("*.jsonl")
    rescored = rescore_file(path)
    assert (rescored.checked, rescored.differ) == (14, [])
    assert any(r["extra"].get("all_classes") for r in results)
    out = write_report("lbe_tiny", tmp_path, tmp_path / "docs", plots=False)
    md = out.read_text()
    assert "| method | 0-4k | 4-8k | 8k+ |" in md and "| streaming 1/2 |" in md


def suite_score(suite, r):
    from eval_harness.metrics import longbench_score

    record = next(x for x in suite.records(r["task"]) if x["_id"] == r["sample_id"])
    return longbench_score(r["task"], r["prediction"], r["references"], record["all_classes"])


class EchoModel(torch.nn.Module):
    """Stands in for a model that answers correctly: generate() appends the expected answer, EOS and padding."""

    def __init__(self, tok, answers: dict[tuple, str]):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tok, self.answers = tok, answers
        self.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        self.config = tiny_model(len(tok)).config

    def generate(self, input_ids, attention_mask, max_new_tokens, **_):
        rows = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist()):
            prompt = tuple(i for i, m in zip(ids, mask) if m)
            new = self.tok(self.answers[prompt], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            new = (new + [self.tok.pad_token_id] * max_new_tokens)[:max_new_tokens]
            rows.append(ids + new)
        return torch.tensor(rows)


def test_correct_answers_score_100_in_batches(tmp_path, tok):
    suite = RulerSuite(tok, samples=3)
    answers = {}
    for task in ("niah_multivalue", "fwe"):
        for s in suite.samples(task, 1024):
            answers[tuple(s["input_ids"])] = " " + ", ".join(s["outputs"]) + "."
    echo = EchoModel(tok, answers)
    summary = run_study(
        study="echo", suite=suite, model=echo, tokenizer=tok, make_cache=lambda m, b: None,
        tasks=["niah_multivalue", "fwe"], lengths=[1024], methods=["dense"], budgets=[], results_dir=tmp_path,
        batch_size=2, progress=False,
    )  # fmt: skip
    assert summary.ran == 6
    _, results = read_study(tmp_path, "echo")
    assert [r["score"] for r in results] == [100.0] * 6
    assert {r["batch"] for r in results} == {1, 2}  # 3 samples in batches of 2
    assert all(r["new_tokens"] == len(tok(" " + ", ".join(r["references"]) + ".")["input_ids"]) for r in results)


def test_plain_progress_without_tqdm(tmp_path, tok, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails -> printed progress lines
    suite = RulerSuite(tok, samples=2)
    answers = {tuple(s["input_ids"]): s["outputs"][0] for s in suite.samples("niah_single_1", 1024)}
    run_study(
        study="plain", suite=suite, model=EchoModel(tok, answers), tokenizer=tok, make_cache=lambda m, b: None,
        tasks=["niah_single_1"], lengths=[1024], methods=["dense"], budgets=[], results_dir=tmp_path,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "plain: 2 samples to run" in out and "plain: 2/2 niah_single_1 1024 dense" in out


def test_full_budget_matches_dense_with_padding_and_chunked_prefill(tmp_path, tok, model):
    # a budget above every context makes OffloadCache exact: the same greedy tokens as DynamicCache, here with
    # left-padded batches of two prompts of different lengths and a chunked prefill
    suite = LongBenchSuite(tok, data=str(LONGBENCH_DIR), e=True, use_datasets=False)
    run_study(
        study="exact", suite=suite, model=model, tokenizer=tok, make_cache=cache_factory(model),
        tasks=["hotpotqa", "trec"], lengths=[300], methods=["dense", "solohead"], budgets=[4096],
        results_dir=tmp_path, max_new_tokens=5, batch_size=2, prefill_chunk_size=128, progress=False,
    )  # fmt: skip
    _, results = read_study(tmp_path, "exact")
    preds = {(r["sample_id"], r["method"]): r["prediction"] for r in results}
    ids = {r["sample_id"] for r in results}
    assert len(ids) == 4 and {r["batch"] for r in results} == {2}
    assert all(preds[(i, "dense")] == preds[(i, "solohead")] for i in ids)


def test_failures_are_recorded_reported_and_retried(tmp_path, tok, model):
    working = cache_factory(model)

    def flaky(method, budget):
        if method == "solohead":
            raise RuntimeError("out of memory (simulated)")
        return working(method, budget)

    kw = {"tasks": ["niah_single_1"], "methods": ["dense", "solohead"]}
    failed = ruler_run(tmp_path, tok, model, make_cache=flaky, **kw)
    assert (failed.ran, failed.failed) == (2, 2)
    lines = [json.loads(x) for x in failed.path.read_text().splitlines()[1:]]
    errors = [x for x in lines if x["type"] == "error"]
    assert len(errors) == 2 and "simulated" in errors[0]["error"] and errors[0]["method"] == "solohead"
    md = render("ruler_tiny", tmp_path)
    assert "## Failed" in md and "| niah_single_1 | 512 | solohead 128 | 2 | RuntimeError: out of memory" in md
    retried = ruler_run(tmp_path, tok, model, **kw)
    assert (retried.ran, retried.skipped) == (2, 2)  # only the failed items run again
    assert "## Failed" not in render("ruler_tiny", tmp_path)


def test_budgets():
    b = parse_budget("1/16", 512)
    assert b.resolve(32768) == 2048 and b.resolve(4096) == 512  # 4096 / 16 = 256 < 512
    assert parse_budget(2048).resolve(10**6) == 2048 and parse_budget("0.25", 1).resolve(1000) == 250
    for bad in ("0", "1/0", "-1/4", "lots", 1.5, True):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)
    with pytest.raises(ValueError, match="need at least one budget"):
        run_study(study="x", suite=None, model=None, tokenizer=None, make_cache=None, tasks="all", lengths=[1],
                  methods=["solohead"], budgets=[])  # fmt: skip


def test_eval_command_end_to_end(tmp_path, tok, model):
    folder = tmp_path / "tiny-model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(
        "study: cli_tiny\nsuite: ruler\nmodel: " + str(folder) + "\ntasks: [niah_single_1]\nlengths: [512]\n"
        "methods: [dense, streaming]\nbudgets: [128]\nsamples: 1\nmax_new_tokens: 2\n"
        "offload: {block_tokens: 16, sink_tokens: 16, window_tokens: 16}\n"
    )
    overrides = ["--set", f"results_dir={tmp_path / 'results'}", "--set", f"report_dir={tmp_path / 'docs'}"]
    assert main([str(recipe), *overrides, "--set", "plots=false"]) == 0
    _, results = read_study(tmp_path / "results", "cli_tiny")
    assert sorted(r["method"] for r in results) == ["dense", "streaming"]
    md = Path(tmp_path / "docs" / "cli_tiny.md").read_text()
    assert "| streaming 128 |" in md and str(folder) in md


def test_results_record_prompt_hash_and_estimate_kernel(tmp_path, tok, model):
    from eval_harness.runner import prompt_sha256

    sel = "quantkey[bits=4,tail_bits=2]"  # estimates the unselected blocks; on a CPU the torch reference does
    run = ruler_run(tmp_path, tok, model, methods=[sel], tasks=["niah_single_1"], batch_size=2)
    header, *results = [json.loads(x) for x in run.path.read_text().splitlines()]
    assert header["estimate_kernel"] == ["reference"]
    suite = RulerSuite(tok, samples=2)
    prompts = {s["id"]: prompt_sha256(s["input_ids"]) for s in suite.samples("niah_single_1", 512)}
    assert len(set(prompts.values())) == 2
    for r in results:
        assert r["estimate_kernel"] == ["reference"] and r["prompt_sha256"] == prompts[r["sample_id"]]
        # The accuracy certificate of the sample's own sequence, from the estimate of the unselected blocks.
        missed = r["missed_mass"]
        assert missed["source"] == "tail" and 0 < missed["mean"] <= missed["max"] < 1 and missed["steps"] > 0
        assert missed["per_sequence"] is True and set(missed["call"]) == {"mean", "max", "last"}
        assert isinstance(r["first_token"], int) and r["first_token"] >= 0
        assert r["cache"]["attended_blocks"] > 0
    # One call of two samples: each its own share, the call's pooled mean theirs.
    assert results[0]["batch"] == 2 and results[0]["missed_mass"]["mean"] != results[1]["missed_mass"]["mean"]
    call = results[0]["missed_mass"]["call"]
    assert call == results[1]["missed_mass"]["call"]
    assert call["mean"] == pytest.approx((results[0]["missed_mass"]["mean"] + results[1]["missed_mass"]["mean"]) / 2)
    dense = ruler_run(tmp_path, tok, model, study="dense_only", methods=["dense"], tasks=["niah_single_1"])
    header, *results = [json.loads(x) for x in dense.path.read_text().splitlines()]
    assert header["estimate_kernel"] == [] and all(r["estimate_kernel"] == [] for r in results)
    assert all(r["missed_mass"] is None for r in results)
    assert prompt_sha256([1, 22, 333]) == hashlib.sha256(b"1,22,333").hexdigest()
