"""RULER generators: prompt lengths in the tokenizer's tokens, needle depths, answers, seeds and errors."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from eval_harness.ruler import NOT_BUILT, TASKS, RulerSuite, make_ruler_samples
from eval_harness.ruler.niah import RULER_DEPTHS

from ..fixtures.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.mark.parametrize("length", [2048, 4096])
@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_length_within_one_percent(tok, task, length):
    samples = make_ruler_samples(tok, task, length, n=2, seed=3)
    for s in samples:
        target = length - TASKS[task].max_new_tokens
        assert s["target_prompt_tokens"] == target
        assert s["prompt_tokens"] == len(s["input_ids"])
        assert 0.99 * target <= len(s["input_ids"]) <= target, (task, len(s["input_ids"]), target)
        if TASKS[task].family in ("niah", "variable_tracking"):
            assert len(s["input_ids"]) == target  # haystack tasks are exact
        assert s["max_new_tokens"] == TASKS[task].max_new_tokens
        assert s["task"] == task and s["length"] == length and s["seed"] == 3
        assert s["outputs"] and all(isinstance(o, str) and o for o in s["outputs"])


def test_max_new_tokens_are_rulers():
    expected = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120, "freq_words_extraction": 50}
    assert {t.family: t.max_new_tokens for t in TASKS.values()} == expected


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_multikey_2"])
def test_needles_at_requested_depths(tok, task):
    depths = [[0.0], [0.1], [0.5], [0.9], [1.0]]
    samples = make_ruler_samples(tok, task, 4096, n=len(depths), depths=depths)
    for s, want in zip(samples, depths):
        assert s["depths"] == want
        # where the needle went, as a share of the haystack: within one haystack unit of the request
        assert s["actual_depths"][0] == pytest.approx(want[0], abs=0.04)
        (pos,) = s["needle_positions"]
        text = tok.decode(s["input_ids"][pos : pos + 40])
        assert text.lstrip().startswith("One of the special magic numbers for ")
        assert s["outputs"][0] in text
    positions = [s["needle_positions"][0] for s in samples]
    assert positions == sorted(positions)


def test_default_depths_are_rulers_grid(tok):
    for s in make_ruler_samples(tok, "niah_multikey_1", 2048, n=3):
        assert len(s["depths"]) == 4 and all(d in RULER_DEPTHS for d in s["depths"])
        assert s["depths"] == sorted(s["depths"])
    assert RULER_DEPTHS[0] == 0.0 and RULER_DEPTHS[-1] == 1.0 and len(RULER_DEPTHS) == 40


@pytest.mark.parametrize("task", [t for t in TASKS if t.startswith("niah")])
def test_niah_answers_and_question(tok, task):
    cfg = TASKS[task].niah
    s = make_ruler_samples(tok, task, 2048, n=1, seed=1)[0]
    text = tok.decode(s["input_ids"])
    assert len(s["outputs"]) == cfg.num_values * cfg.num_queries
    for value in s["outputs"]:
        assert text.count(value) == 1, value  # each expected value is hidden exactly once
    assert len(s["needle_positions"]) == max(cfg.num_keys, cfg.num_queries) * cfg.num_values
    assert text.startswith("<|im_start|>user\n")
    assert text.rstrip().endswith("mentioned in the provided text " + ("is" if len(s["outputs"]) == 1 else "are"))
    assert f"for {s['query']} mentioned in the provided text?" in text


def test_vt_chain(tok):
    s = make_ruler_samples(tok, "vt", 2048, n=1, depths=[[0.1, 0.3, 0.5, 0.7, 0.9]])[0]
    text = tok.decode(s["input_ids"])
    names = s["outputs"]
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", n) for n in names)
    assert f"VAR {names[0]} = {s['value']}\n" in text
    for a, b in zip(names, names[1:]):
        assert f"VAR {b} = VAR {a}\n" in text
    assert s["actual_depths"] == pytest.approx([0.1, 0.3, 0.5, 0.7, 0.9], abs=0.04)
    assert text.count("Memorize and track the chain(s)") == 2  # the solved example, then the task
    assert text.rstrip().endswith(f"5 variables are assigned the value {s['value']}, they are:")


@pytest.mark.parametrize("length,common,other", [(2048, 6, 1), (4096, 30, 3)])
def test_cwe_counts(tok, length, common, other):
    s = make_ruler_samples(tok, "cwe", length, n=1)[0]
    text = tok.decode(s["input_ids"])
    task_part = text[text.rindex("Below is a numbered list") :]
    counts = Counter(re.findall(r"\d+\. (\S+?)(?= \d+\.|\n)", task_part))
    assert len(s["outputs"]) == 10
    for word in s["outputs"]:
        assert counts[word] == common
    assert max(c for w, c in counts.items() if w not in s["outputs"]) == other
    assert s["num_words"] == len(counts)


def test_fwe_answer_is_the_three_most_frequent(tok):
    s = make_ruler_samples(tok, "fwe", 2048, n=1)[0]
    text = tok.decode(s["input_ids"])
    coded = text[text.index("coded words.") + len("coded words.") : text.index("\nQuestion:")].split()
    ranking = [w for w, _ in Counter(coded).most_common()]
    assert ranking[0] == "..."
    assert set(ranking[1:4]) == set(s["outputs"])
    assert Counter(coded)[ranking[3]] > Counter(coded)[ranking[4]]


def test_seeds(tok):
    a = make_ruler_samples(tok, "niah_single_3", 1024, n=2, seed=0)
    b = make_ruler_samples(tok, "niah_single_3", 1024, n=2, seed=0)
    c = make_ruler_samples(tok, "niah_single_3", 1024, n=2, seed=1)
    longer = make_ruler_samples(tok, "niah_single_3", 2048, n=2, seed=0)
    assert [s["input_ids"] for s in a] == [s["input_ids"] for s in b]
    assert [s["outputs"] for s in a] != [s["outputs"] for s in c]
    assert [s["outputs"] for s in a] == [s["outputs"] for s in longer]  # same needles at every length
    assert a[0]["outputs"] != a[1]["outputs"]


def test_plain_prompts_without_chat_template(tok):
    s = make_ruler_samples(tok, "niah_single_1", 1024, n=1, chat=False)[0]
    text = tok.decode(s["input_ids"])
    assert "<|im_start|>" not in text
    assert text.startswith("A special magic number is hidden")
    assert text.endswith(" The special magic number for " + s["query"] + " mentioned in the provided text is")
    assert len(s["input_ids"]) == 1024 - 128


def test_errors(tok):
    with pytest.raises(ValueError, match="not built.*SQuAD"):
        make_ruler_samples(tok, "qa_1", 4096, n=1)
    with pytest.raises(ValueError, match="unknown RULER task"):
        make_ruler_samples(tok, "niah_single_9", 4096, n=1)
    with pytest.raises(ValueError, match="raise the length"):
        make_ruler_samples(tok, "niah_multikey_3", 256, n=1)
    with pytest.raises(ValueError, match="context length of at least"):
        make_ruler_samples(tok, "cwe", 512, n=1)
    with pytest.raises(ValueError, match="one list per sample"):
        make_ruler_samples(tok, "niah_single_1", 1024, n=2, depths=[[0.5]])
    with pytest.raises(ValueError, match="inserts 4 needles"):
        make_ruler_samples(tok, "niah_multivalue", 1024, n=1, depths=[[0.5]])
    with pytest.raises(ValueError, match="length must be an integer above 128"):
        make_ruler_samples(tok, "niah_single_1", 100, n=1)


def test_not_built_list_and_suite(tok):
    assert set(NOT_BUILT) == {"qa_1", "qa_2"}
    assert "SQuAD" in NOT_BUILT["qa_1"] and "HotpotQA" in NOT_BUILT["qa_2"]
    assert len(TASKS) + len(NOT_BUILT) == 13
    suite = RulerSuite(tok, samples=2)
    assert suite.resolve_tasks("all") == list(TASKS)
    info = suite.info(["niah_single_2"])
    assert info["not_built"] == NOT_BUILT
    assert info["essay_haystack"]["licence"].startswith("PSF")
    sample = suite.samples("niah_multivalue", 1024)[0]
    values = sample["outputs"]
    assert suite.score("niah_multivalue", sample, " " + " ".join(values) + "\n") == 100.0
    assert suite.score("niah_multivalue", sample, f"{values[0]}, {values[1].upper()}") == 50.0
    assert suite.sample_ids("vt", 1024) == ["0-0", "0-1"]
