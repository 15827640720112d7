"""Shared-context evaluation: each question's prompt is RULER's for its key, forks answer like full prefills at the
whole-context budget, and the summary pairs the two ways."""

from __future__ import annotations

import pytest

from eval_harness.runner import prompt_sha256
from eval_harness.shared_context import make_context, run_context, summarize

from ..fixtures.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_each_question_asks_for_one_needle_of_the_shared_haystack(tok):
    context = make_context(tok, 1024, 4, index=0, seed=3)
    prefix = context["prefix"]
    text = tok.decode(prefix)
    assert len(context["questions"]) == 4 and len({q["key"] for q in context["questions"]}) == 4
    for q in context["questions"]:
        assert f"for {q['key']} is: {q['outputs'][0]}." in text  # the needle it asks for is in the shared prefix
        assert q["key"] in tok.decode(q["suffix"]) and q["outputs"][0] not in tok.decode(q["suffix"])
        assert abs(len(prefix) + len(q["suffix"]) - (1024 - 128)) <= 32  # RULER's prompt size (keys' sizes vary)
    # The key RULER asked is one of them: its prompt is RULER's, exactly the length's prompt tokens.
    assert 1024 - 128 in {len(prefix) + len(q["suffix"]) for q in context["questions"]}
    assert make_context(tok, 1024, 4, index=0, seed=3) == context != make_context(tok, 1024, 4, index=1, seed=3)


def test_forked_answers_equal_full_prefills_at_the_whole_context_budget(tok):
    model = tiny_model(len(tok), max_positions=1200)
    context = make_context(tok, 1024, 2, index=0)
    run = run_context(model, tok, context, 0, 1024, "full", new_tokens=6)
    full = [r for r in run["records"] if r["method"] == "full"]
    fork = [r for r in run["records"] if r["method"] == "fork"]
    assert len(full) == len(fork) == 2
    for a, b, q in zip(full, fork, context["questions"]):
        assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 6 and b["same_tokens_as_full"]
        assert a["prompt_sha256"] == b["prompt_sha256"] == prompt_sha256(context["prefix"] + q["suffix"])
    row = run["context"]
    assert row["budget_tokens"] >= len(context["prefix"]) + max(row["question_tokens"]) + 6
    assert row["host_bytes_fork"] < row["host_bytes_full"]  # one prefix in a shared pool against two prefills
    assert row["host_bytes_fork_over_one"] == row["host_bytes_fork"] / (row["host_bytes_full"] / 2) < 2
    forks = [r for r in run["records"] if r["method"] == "fork"]
    assert row["ttft_first_question_s"] == row["prefix_prefill_s"] + forks[0]["ttft_s"]
    assert row["ttft_later_over_first"] == forks[1]["ttft_s"] / row["ttft_first_question_s"]
    assert all(0 < r["fork_s"] < r["ttft_s"] for r in forks)  # a question's time to first token includes its fork
    # The reference without the library: a DynamicCache prefix deep-copied per question answers the same tokens.
    dynamic = [r for r in run["records"] if r["method"] == "dynamic"]
    assert [r["tokens"] for r in dynamic] == [r["tokens"] for r in full]
    assert all(r["same_tokens_as_full"] for r in dynamic)
    assert row["ttft_first_question_dynamic_s"] == row["prefix_prefill_dynamic_s"] + dynamic[0]["ttft_s"]
    assert row["ttft_later_over_first_dynamic"] == dynamic[1]["ttft_s"] / row["ttft_first_question_dynamic_s"]
    summary = summarize(run["records"], ["full"], [row])["full"]
    assert summary["identical"] == 2 and summary["full_minus_fork"]["equal"] == 2
    assert summary["identical_dynamic"] == 2 and summary["accuracy_dynamic"] == summary["accuracy_full"]
    assert summary["max_ttft_later_over_first_dynamic"] == row["ttft_later_over_first_dynamic"]
    for way, records in (("full", full), ("fork", fork), ("dynamic", dynamic)):
        assert summary[f"total_s_{way}"] == sum(r["total_s"] for r in records) / 2
        assert all(r["total_s"] >= r["ttft_s"] for r in records)
    assert summary["max_ttft_later_over_first"] == row["ttft_later_over_first"]
    assert summary["max_host_bytes_fork_over_one"] == row["host_bytes_fork_over_one"]


def test_admission_reaches_every_cache(tok, monkeypatch):
    import hf_offload

    seen = []
    real = hf_offload.OffloadCache

    def spy(*args, **kwargs):
        seen.append(kwargs.get("admission"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_offload, "OffloadCache", spy)
    model = tiny_model(len(tok), max_positions=1200)
    run = run_context(model, tok, make_context(tok, 1024, 2, index=0), 0, 1024, "1/16", new_tokens=2,
                      admission="always")  # fmt: skip
    assert seen == ["always"] * 3  # two full prefills and the prefix; forks take the prefix's settings
    assert all(r["host_kv_bytes"] > 0 for r in run["records"])
    assert {r["method"] for r in run["records"]} == {"full", "fork"}  # the DynamicCache reference: whole budget only


def test_the_summary_pairs_question_by_question():
    def rec(method, budget, sample, score):
        return {"task": "t", "length": 8, "method": method, "budget": budget, "sample_id": sample, "score": score,
                "ttft_s": 1.0, "total_s": 2.0, "same_tokens_as_full": score == 100.0}  # fmt: skip

    records = [rec("full", "full", s, 100.0) for s in "abcd"] + [rec("fork", "full", s, 100.0) for s in "abcd"]
    records += [rec("full", "1/16", s, 100.0) for s in "abcd"] + [rec("fork", "1/16", s, x) for s, x in
                                                                  zip("abcd", (0.0, 100.0, 100.0, 100.0))]  # fmt: skip
    out = summarize(records, ["full", "1/16"])
    assert out["full"]["accuracy_fork"] == 100.0 and out["1/16"]["accuracy_fork"] == 75.0
    d = out["1/16"]["full_minus_fork"]
    assert d["mean"] == 25.0 and d["dense_higher"] == 1 and d["equal"] == 3 and d["low"] <= 25.0 <= d["high"]
    assert out["1/16"]["fork_at_full_budget_minus_fork"]["mean"] == 25.0
    assert out["1/16"]["full_at_full_budget_minus_full"]["mean"] == 0.0


def test_one_fork_refilled_for_each_question_answers_as_new_forks(tok):
    model = tiny_model(len(tok), max_positions=1200)
    context = make_context(tok, 1024, 3, index=0)
    new = run_context(model, tok, context, 0, 1024, "1/16", new_tokens=5)
    reused = run_context(model, tok, context, 0, 1024, "1/16", new_tokens=5, reuse_fork=True)

    def forks(run):
        return [r for r in run["records"] if r["method"] == "fork"]
    assert [r["tokens"] for r in forks(reused)] == [r["tokens"] for r in forks(new)]
    assert [r["reused_fork"] for r in forks(reused)] == [False, True, True]
    assert not any(r["reused_fork"] for r in forks(new))
    assert reused["context"]["forks_held"] == 1 and new["context"]["forks_held"] == 3
