"""Scores of the RULER and LongBench tasks, written from their published definitions.

RULER (Hsieh et al., 2024; ``scripts/eval/synthetic/constants.py``): ``string_match_all`` (share of the references
found in the prediction) and ``string_match_part`` (1 if any reference is found), both case-insensitive substring
tests, averaged over samples, times 100, rounded to 2 decimals; predictions are first stripped and cleared of
control characters (RULER's ``postprocess_pred``).

LongBench (Bai et al., 2023; THUDM/LongBench ``metrics.py`` and ``eval.py``): per sample the best score over the
reference answers, averaged, times 100. ``qa_f1`` (SQuAD-style normalisation), ``qa_f1_zh`` and ``rouge_zh``
(jieba words), ``rouge`` (ROUGE-L F of the ``rouge`` package 1.0.1), classification, retrieval (en/zh), count, and
code similarity (fuzzywuzzy's ``fuzz.ratio``).

Which parts come from packages, and why the others do not:

* Code similarity is ``rapidfuzz.fuzz.ratio``, rounded: the value of fuzzywuzzy 0.18 ``fuzz.ratio`` with
  python-Levenshtein installed, and of its maintained successor thefuzz. LongBench does not pin python-Levenshtein;
  without it fuzzywuzzy falls back to ``difflib.SequenceMatcher``, whose matching blocks are not a longest common
  subsequence (``"cabc"`` / ``"ac"``: 33 there, 67 here).
* ROUGE-L stays written here, cross-checked against ``rouge`` 1.0.1 (the package LongBench calls; unmaintained since
  2021, and its recursive LCS fails on long sentence pairs). ``rouge-score`` computes another ROUGE-L: it lowercases,
  drops non-alphanumerics and counts repeated words, where ``rouge`` 1.0.1 counts distinct words of sentences split
  at every ``"."``; the two agree on 244 of 2,000 random text pairs.
* The RULER string matches, SQuAD-style F1, classification, retrieval and count scores are a few lines each of the
  published code; no maintained package carries LongBench's or RULER's versions of them.

``rapidfuzz`` and ``jieba`` are optional (the ``eval`` extra): a metric that needs one imports it when first called
and raises an ``ImportError`` naming the extra if it is missing.
"""

from __future__ import annotations

import importlib
import re
import string
from collections import Counter
from collections.abc import Sequence

EVAL_EXTRA_HINT = "install the evaluation extra: pip install 'hf-offload[eval]'"
_PUNCTUATION = frozenset(string.punctuation)


# ----------------------------------------------------------------------------------------------------------- RULER
def ruler_postprocess(prediction: str) -> str:
    """RULER's clean-up of a prediction: strip, drop control characters (``\\x00``-``\\x1f``), strip again."""
    return re.sub(r"[\x00-\x1f]", "", prediction.strip()).strip()


def string_match_all_one(prediction: str, references: Sequence[str]) -> float:
    """Share (0..1) of ``references`` that occur in ``prediction``, case-insensitive."""
    if not references:
        raise ValueError("references must not be empty")
    pred = prediction.lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part_one(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any of ``references`` occurs in ``prediction`` (case-insensitive), else 0.0."""
    if not references:
        raise ValueError("references must not be empty")
    pred = prediction.lower()
    return float(any(r.lower() in pred for r in references))


def string_match_all(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's ``string_match_all``: mean over samples of the share of references found, x 100, 2 decimals."""
    _check_pairs(predictions, references)
    return round(100 * sum(map(string_match_all_one, predictions, references)) / len(predictions), 2)


def string_match_part(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """RULER's ``string_match_part``: mean over samples of "any reference found", x 100, 2 decimals."""
    _check_pairs(predictions, references)
    return round(100 * sum(map(string_match_part_one, predictions, references)) / len(predictions), 2)


def _check_pairs(predictions, references) -> None:
    if len(predictions) != len(references) or not predictions:
        raise ValueError(
            f"need one reference list per prediction and at least one of each; got {len(predictions)} predictions "
            f"and {len(references)} reference lists"
        )


# --------------------------------------------------------------------------------------------- LongBench: helpers
def _optional(module: str, what: str):
    """Import ``module`` of the ``eval`` extra, or raise an ImportError that names the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{what} needs {module.split('.')[0]}; {EVAL_EXTRA_HINT}") from None


def _jieba():
    return _optional("jieba", "the Chinese LongBench metrics")


def _rapidfuzz_ratio():
    return _optional("rapidfuzz.fuzz", "the code-similarity metric").ratio


def normalize_answer(s: str) -> str:
    """Lower case; drop ASCII punctuation, the articles a/an/the and extra whitespace (LongBench / SQuAD)."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


_ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."  # noqa: E501 (data)


def normalize_zh_answer(s: str) -> str:
    """Lower case; drop ASCII and Chinese punctuation and all whitespace (LongBench)."""
    drop = _PUNCTUATION | frozenset(_ZH_PUNCTUATION)
    return "".join("".join(ch for ch in s.lower() if ch not in drop).split())


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """Token-overlap F1 of two token lists (multiset overlap)."""
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


# ---------------------------------------------------------------------------------------------- LongBench: metrics
def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    """F1 of the normalised words (:func:`normalize_answer`) of prediction and answer."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """F1 of jieba words, each normalised with :func:`normalize_zh_answer`, empty ones dropped."""
    jieba = _jieba()

    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in jieba.cut(text, cut_all=False)) if w]

    return f1_score(words(prediction), words(ground_truth))


def _lcs_words(ref: list[str], hyp: list[str]) -> set[str]:
    """The words of the LCS the ``rouge`` package reconstructs (its tie-breaking: on a mismatch it steps back in
    ``hyp`` unless stepping back in ``ref`` keeps a strictly longer LCS)."""
    n, m = len(ref), len(hyp)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        row, prev = table[i], table[i - 1]
        for j in range(1, m + 1):
            row[j] = prev[j - 1] + 1 if ref[i - 1] == hyp[j - 1] else max(prev[j], row[j - 1])
    out: set[str] = set()
    i, j = n, m
    while i and j:
        if ref[i - 1] == hyp[j - 1]:
            out.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return out


def _rouge_sentences(text: str) -> list[str]:
    return [" ".join(s.split()) for s in text.split(".") if len(s) > 0]


def rouge_l_f(prediction: str, ground_truth: str) -> float:
    """ROUGE-L (summary level) F score exactly as ``rouge.Rouge().get_scores(pred, ref)[0]["rouge-l"]["f"]``
    (rouge 1.0.1, default ``exclusive=True``).

    Both texts are split into sentences at every ``"."`` (empty pieces dropped, whitespace collapsed; a piece of
    only whitespace stays as an empty sentence) and sentences into words at single spaces. With ``U`` the set of
    words of the union of the LCS of every (reference sentence, prediction sentence) pair, ``m`` and ``n`` the
    numbers of distinct words of reference and prediction: ``R = |U| / m``, ``P = |U| / n``,
    ``F = 2PR / (P + R + 1e-8)``.

    Raises:
        ValueError: prediction or reference has no sentence (``rouge`` raises too; LongBench then scores 0).
    """
    hyp, ref = _rouge_sentences(prediction), _rouge_sentences(ground_truth)
    if not hyp or not ref:
        raise ValueError("Collections must contain at least 1 sentence.")
    hyp_words = [s.split(" ") for s in hyp]
    ref_words = [s.split(" ") for s in ref]
    m = len({w for s in ref_words for w in s})
    n = len({w for s in hyp_words for w in s})
    union: set[str] = set()
    for r in ref_words:
        for h in hyp_words:
            union |= _lcs_words(r, h)
    recall, precision = len(union) / m, len(union) / n
    return 2.0 * ((precision * recall) / (precision + recall + 1e-8))


def rouge_score(prediction: str, ground_truth: str, **_) -> float:
    """LongBench's ``rouge_score``: :func:`rouge_l_f`, or 0.0 where ``rouge`` raises (an empty text).

    The ``rouge`` package's recursive LCS also fails (and LongBench then scores 0) for a sentence pair of roughly
    1,000 words together; this implementation scores such pairs normally.
    """
    try:
        return rouge_l_f(prediction, ground_truth)
    except ValueError:
        return 0.0


def rouge_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """:func:`rouge_score` of the jieba words joined by spaces."""
    jieba = _jieba()
    return rouge_score(" ".join(jieba.cut(prediction, cut_all=False)), " ".join(jieba.cut(ground_truth, cut_all=False)))


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] = (), **_) -> float:
    """LongBench's classification score, including the published code's behaviour.

    The class names found in the prediction (substring test) are collected; those that are a part of the answer
    without being the answer are then removed in one pass over the list that skips the element after each removal
    (the published code removes from the list it iterates over). Score: ``1 / len(matches)`` if the answer is among
    the matches, else 0. (The published fallback to the most similar class is unreachable: it tests ``list != 0``.)
    """
    if not all_classes:
        raise ValueError("classification_score needs the sample's all_classes")
    matches = [c for c in all_classes if c in prediction]
    i = 0
    while i < len(matches):
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _number_share(prediction: str, expected: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return 0.0 if not numbers else sum(n == expected for n in numbers) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the numbers in the prediction that equal the paragraph number of ``"Paragraph N"``."""
    found = re.findall(r"Paragraph (\d+)", ground_truth)
    if not found:
        raise ValueError(f"retrieval answer {ground_truth!r} does not name a 'Paragraph N'")
    return _number_share(prediction, found[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the numbers in the prediction that equal the paragraph number of ``"段落N"``."""
    found = re.findall(r"段落(\d+)", ground_truth)
    if not found:
        raise ValueError(f"retrieval answer {ground_truth!r} does not name a '段落N'")
    return _number_share(prediction, found[0])


def count_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the numbers in the prediction that equal the answer."""
    return _number_share(prediction, str(ground_truth))


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` (with python-Levenshtein; thefuzz's): ``round(rapidfuzz.fuzz.ratio(a, b))``.

    ``100 * (1 - d / (len(a) + len(b)))`` with ``d`` the insert/delete edit distance, i.e. ``200 * LCS / (len(a) +
    len(b))``, rounded half to even as Python's ``round``; 100 for two empty strings, 0 if only one is empty.
    """
    return round(_rapidfuzz_ratio()(a, b))


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """Similarity (0..1) of the first prediction line that has no backtick, ``#`` or ``//`` to the answer line."""
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzz_ratio(line, ground_truth) / 100


#: Metric per LongBench dataset (LongBench ``eval.py``).
LONGBENCH_METRICS = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}

#: Datasets whose prediction is cut to its first line before scoring (LongBench ``eval.py``).
FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def longbench_score(dataset: str, prediction: str, answers: Sequence[str], all_classes=None) -> float:
    """One sample's LongBench score (0..1): the dataset's metric, best over the answers, after the first-line rule.

    Args:
        dataset: a LongBench dataset name (``_e`` suffix allowed).
        prediction: the generated text.
        answers: the sample's reference answers.
        all_classes: the sample's class names (classification datasets).
    """
    name = dataset.removesuffix("_e")
    if name not in LONGBENCH_METRICS:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; choose from {', '.join(LONGBENCH_METRICS)}")
    if name in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = LONGBENCH_METRICS[name]
    best = 0.0
    for answer in answers:
        best = max(best, metric(prediction, answer, all_classes=all_classes or ()))
    return best
