"""RULER and LongBench metrics against hand-worked cases from the published definitions, and ROUGE-L against the
``rouge`` package LongBench calls (in the test extra) on random inputs."""

from __future__ import annotations

import random
import sys

import pytest

from eval_harness import metrics as M


# ------------------------------------------------------------------------------------------------------------ RULER
def test_string_match_all_averages_share_of_references():
    # sample 1: "123" and "456" found, "789" not -> 2/3; sample 2: nothing -> 0; mean 1/3 * 100 = 33.333 -> 33.33
    preds = ["The numbers are 123 and 456.", "nothing"]
    refs = [["123", "456", "789"], ["x"]]
    assert M.string_match_all(preds, refs) == 33.33
    assert M.string_match_all_one(preds[0], refs[0]) == pytest.approx(2 / 3)


def test_string_match_part_is_any_reference_case_insensitive():
    # sample 1: "abc" occurs in "ABC def" (case-insensitive) -> 1; sample 2: no -> 0; mean 0.5 * 100 = 50.0
    assert M.string_match_part(["ABC def", "xyz"], [["abc", "zzz"], ["q"]]) == 50.0
    # all: "ABC" found, "zzz" not -> 1/2 -> 50.0
    assert M.string_match_all(["ABC def"], [["abc", "zzz"]]) == 50.0


def test_ruler_postprocess_strips_control_characters():
    # strip -> "12\x07 34" -> drop \x07 -> "12 34"
    assert M.ruler_postprocess("\n 12\x07 34 \n") == "12 34"


def test_string_match_rejects_mismatched_lists():
    with pytest.raises(ValueError, match="one reference list per prediction"):
        M.string_match_all(["a", "b"], [["a"]])


# ----------------------------------------------------------------------------------------------------------- qa_f1
def test_qa_f1_normalises_articles_and_punctuation():
    # "The Kettlewick village" -> "kettlewick village"; answer "kettlewick": overlap 1, P = 1/2, R = 1 -> F1 = 2/3
    assert M.qa_f1_score("The Kettlewick village", "kettlewick") == pytest.approx(2 / 3)
    # "Paris, France." -> [paris, france] vs [paris] -> 2/3
    assert M.qa_f1_score("Paris, France.", "Paris") == pytest.approx(2 / 3)
    # multiset overlap: [cat, cat] vs [cat, dog] -> overlap 1, P = 1/2, R = 1/2 -> 0.5
    assert M.qa_f1_score("a cat cat", "cat dog") == pytest.approx(0.5)
    assert M.qa_f1_score("dog", "cat") == 0.0


# ------------------------------------------------------------------------------------------------------------ rouge
def test_rouge_l_single_sentence():
    # ref words {the, cat, lay, on, mat}: m = 5; prediction {the, cat, sat, on, mat}: n = 5
    # LCS "the cat on the mat" -> word set {the, cat, on, mat}: 4; R = P = 4/5; F = 2 * 0.64 / (1.6 + 1e-8)
    f = M.rouge_l_f("the cat sat on the mat", "the cat lay on the mat")
    assert f == pytest.approx(1.28 / 1.60000001, abs=1e-12)


def test_rouge_l_union_over_prediction_sentences():
    # Lin's example: r = w1 w2 w3 w4 w5; c1 = w1 w2 w6 w7 w8, c2 = w1 w3 w8 w9 w5
    # LCS(r, c1) = {w1, w2}, LCS(r, c2) = {w1, w3, w5}: union 4. m = 5, n = 8 distinct prediction words
    # R = 4/5, P = 4/8: F = 2 * 0.4 / (1.3 + 1e-8)
    f = M.rouge_l_f("w1 w2 w6 w7 w8. w1 w3 w8 w9 w5", "w1 w2 w3 w4 w5")
    assert f == pytest.approx(0.8 / 1.30000001, abs=1e-12)


def test_rouge_l_keeps_the_packages_quirks():
    # "cat sat. " splits at "." into "cat sat" and " " -> "" (an empty sentence, whose one word is ""):
    # n = |{cat, sat, ""}| = 3, m = 2, union 2: R = 1, P = 2/3 -> F = (4/3) / (5/3 + 1e-8)
    assert M.rouge_l_f("cat sat. ", "cat sat") == pytest.approx((4 / 3) / (5 / 3 + 1e-8), abs=1e-12)
    # LCS tie-break as in rouge 1.0.1: LCS("a b", "b a") reconstructs {b}; with the second sentence "a" the union
    # is {a, b}: R = P = 1 -> F = 2 / (2 + 1e-8)
    assert M.rouge_l_f("b a. a", "a b") == pytest.approx(2 / (2 + 1e-8), abs=1e-12)
    # one sentence "b a": union {b}, R = P = 1/2 -> F = 0.5 / (1 + 1e-8)
    assert M.rouge_l_f("b a", "a b") == pytest.approx(0.5 / (1 + 1e-8), abs=1e-12)
    # no sentence at all: rouge raises, LongBench scores 0
    assert M.rouge_score("", "a b") == 0.0
    assert M.rouge_score("...", "a b") == 0.0


# ------------------------------------------------------------------------------------------------- classification
def test_classification_score():
    classes = ["Human being", "Human", "Date", "Location"]
    # matches [Human being, Human]; "Human" is part of the answer but not it -> removed -> [Human being] -> 1/1
    assert M.classification_score("Human being", "Human being", all_classes=classes) == 1.0
    # matches [Date, Location], the answer among them -> 1/2
    assert M.classification_score("Date or Location", "Date", all_classes=classes) == 0.5
    # nothing named -> 0 (the release's similarity fallback is unreachable)
    assert M.classification_score("no idea", "Date", all_classes=classes) == 0.0


def test_classification_score_keeps_the_removal_quirk():
    # matches [Human, Hum, Human being]; removing "Human" during the pass skips "Hum" -> [Hum, Human being] -> 1/2
    assert M.classification_score("Human being", "Human being", all_classes=["Human", "Hum", "Human being"]) == 0.5


# ------------------------------------------------------------------------------------------------ retrieval, count
def test_retrieval_and_count():
    # numbers [3, 12]; one equals the answer's 3 -> 1/2
    assert M.retrieval_score("Paragraph 3 and Paragraph 12", "Paragraph 3") == 0.5
    assert M.retrieval_zh_score("答案是段落5", "段落5") == 1.0
    assert M.retrieval_score("I do not know", "Paragraph 3") == 0.0
    # numbers [4, 6]; one is 4 -> 1/2
    assert M.count_score("There are 4 unique paragraphs out of 6", "4") == 0.5
    with pytest.raises(ValueError, match="Paragraph N"):
        M.retrieval_score("Paragraph 1", "the first one")


# ---------------------------------------------------------------------------------------------------- code, fuzzy
def test_fuzz_ratio_is_the_indel_similarity():
    # 200 * LCS / (len(a) + len(b)), rounded half to even:
    # "abcd" / "abce": LCS "abc" = 3 of 8 characters -> 75
    assert M.fuzz_ratio("abcd", "abce") == 75
    # "kitten" / "sitting": LCS "ittn" = 4 of 13 -> 61.5 -> 62
    assert M.fuzz_ratio("kitten", "sitting") == 62
    # LCS "a" = 1 of 16 -> 12.5 -> 12 (half to even)
    assert M.fuzz_ratio("abcdefgh", "ixyzuvwa") == 12
    # LCS "ac" = 2 of 6 -> 66.7 -> 67 (fuzzywuzzy's difflib fallback matches only "c": 33)
    assert M.fuzz_ratio("cabc", "ac") == 67
    assert M.fuzz_ratio("", "") == 100 and M.fuzz_ratio("", "x") == 0


def test_code_sim_names_the_extra_when_rapidfuzz_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "rapidfuzz", None)  # import rapidfuzz -> ImportError
    monkeypatch.setitem(sys.modules, "rapidfuzz.fuzz", None)
    with pytest.raises(ImportError, match=r"code-similarity metric needs rapidfuzz; .*hf-offload\[eval\]"):
        M.code_sim_score("x = 1", "x = 1")


def test_code_sim_takes_the_first_plain_line():
    answer = "    return total / len(values)"
    # the fence line has a backtick and is skipped; the next line equals the answer -> 100 / 100
    assert M.code_sim_score("```python\n    return total / len(values)\n```", answer) == 1.0
    # a comment line is skipped too
    assert M.code_sim_score("# done\n    return total / len(values)", answer) == 1.0
    # "abcd" vs "abce" -> 0.75
    assert M.code_sim_score("\n\nabcd", "abce") == 0.75


# ------------------------------------------------------------------------------------------------ dataset scoring
def test_longbench_score_first_line_rule_and_best_answer():
    classes = ["Human being", "Human", "Date", "Location"]
    # trec keeps the first line: "Human being" -> 1.0 (the whole text would match Date too -> 0.5)
    assert M.longbench_score("trec", "Human being\nDate", ["Human being"], classes) == 1.0
    assert M.classification_score("Human being\nDate", "Human being", all_classes=classes) == 0.5
    # triviaqa first line "Kettlewick" -> F1 1.0
    assert M.longbench_score("triviaqa_e", "Kettlewick\nor maybe Harrowgate", ["Kettlewick"]) == 1.0
    # hotpotqa keeps the whole text; best over answers: "salmon" vs "Salmon" = 1.0, vs "salmon trout" = 2/3
    assert M.longbench_score("hotpotqa", "salmon", ["salmon trout", "Salmon"]) == 1.0
    assert set(M.LONGBENCH_METRICS) >= {"qasper", "lcc", "repobench-p", "passage_count", "vcsum"}
    with pytest.raises(ValueError, match="unknown LongBench dataset"):
        M.longbench_score("squad", "x", ["x"])


# -------------------------------------------------------------------------------------------------------- Chinese
def test_chinese_metrics_name_the_extra_when_jieba_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "jieba", None)  # import jieba -> ImportError
    with pytest.raises(ImportError, match=r"hf-offload\[eval\]"):
        M.qa_f1_zh_score("北京", "北京")
    with pytest.raises(ImportError, match="jieba"):
        M.rouge_zh_score("北京", "北京")


def test_chinese_metrics_with_jieba():
    pytest.importorskip("jieba")
    # identical texts: every word matches -> 1.0; the punctuation token "。" is dropped by the normalisation
    assert M.qa_f1_zh_score("北京是中国的首都。", "北京是中国的首都") == pytest.approx(1.0)
    assert M.rouge_zh_score("北京是中国的首都", "北京是中国的首都") == pytest.approx(1.0, abs=1e-7)
    assert M.qa_f1_zh_score("上海", "北京") == 0.0


# ------------------------------------------------------------------------------------- against reference packages
def _random_text(rng: random.Random) -> str:
    vocab = "a b c the cat sat on mat dog ran x y".split()
    return "".join(rng.choice([" ", "", " . ", ".", "  "]) + rng.choice(vocab) for _ in range(rng.randint(0, 25)))


def test_rouge_matches_the_rouge_package():
    rouge = pytest.importorskip("rouge")
    scorer = rouge.Rouge()
    rng = random.Random(0)
    for _ in range(2000):
        hyp, ref = _random_text(rng), _random_text(rng)
        try:
            expected = scorer.get_scores([hyp], [ref], avg=True)["rouge-l"]["f"]
        except Exception:  # LongBench's bare except
            expected = 0.0
        assert M.rouge_score(hyp, ref) == expected, (hyp, ref)
