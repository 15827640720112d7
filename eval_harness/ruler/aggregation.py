"""RULER aggregation tasks (Hsieh et al., 2024, section 3.1 "Aggregation"): common words extraction (``cwe``) and
frequent words extraction (``fwe``).

* ``cwe``: a numbered list of words in which 10 common words appear 30 times each and every other word 3 times
  (6 and 1 for contexts under 4K, as in RULER), after one solved example (40 words, 10 and 3 repeats; 20 words,
  3 and 1 under 4K); the answer is the 10 common words. 120 new tokens.
* ``fwe``: a text of random 6-letter "coded" words whose counts follow a Zeta (Zipf) distribution with
  ``alpha = 2`` over ``prompt_tokens // 50`` words; the most frequent word is ``...`` (noise, to be ignored) and the
  answer is the next three. 50 new tokens.

The list is tokenized whole and its size (the number of distinct words; for ``fwe``, the Zeta scale) is the largest
that keeps the prompt within the requested tokens. Template sentences from RULER's
``scripts/data/synthetic/constants.py`` (Apache-2.0).
"""

from __future__ import annotations

import random
import string

from .prompt import answer_prefix_text, chat_frame, compose, encode, fit_count
from .words import cwe_word_pool

CWE_MAX_NEW_TOKENS = 120
FWE_MAX_NEW_TOKENS = 50
NUM_COMMON = 10

_CWE_BEFORE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
_CWE_AFTER = "\nQuestion: What are the 10 most common words in the above list?"
_CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
_FWE_BEFORE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words."
)
_FWE_AFTER = (
    "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
_FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


def _word_list(words: list[str], common_repeats: int, other_repeats: int, shuffle_seed: str) -> str:
    items = words[:NUM_COMMON] * common_repeats + words[NUM_COMMON:] * other_repeats
    random.Random(shuffle_seed).shuffle(items)
    return _numbered(items)


def make_cwe_sample(tokenizer, prompt_tokens: int, length: int, rng: random.Random, chat: bool) -> dict:
    """Build one common-words-extraction prompt of at most ``prompt_tokens`` tokens (within one list item).

    Args:
        tokenizer: the model's tokenizer.
        prompt_tokens: prompt length in tokens (the context length minus the tokens to generate).
        length: the context length (RULER switches to fewer repeats below 4096).
        rng: the sample's random generator.
        chat: wrap the user message in the tokenizer's chat template.

    Returns:
        ``input_ids``, ``outputs`` (the 10 common words) and ``num_words`` (distinct words in the list).
    """
    short = length < 4096
    ex_n, ex_common, ex_other = (20, 3, 1) if short else (40, 10, 3)
    common, other = (6, 1) if short else (30, 3)
    pool = cwe_word_pool()
    singles = [w for w in pool if "-" not in w]
    order = rng.sample(singles, len(singles)) + [w for w in pool if "-" in w]
    example_words = rng.sample(singles, ex_n)
    seed = f"cwe:{rng.getrandbits(64)}"

    frame = chat_frame(tokenizer, chat)
    example = (
        _CWE_BEFORE
        + _word_list(example_words, ex_common, ex_other, seed + ":example")
        + _CWE_AFTER
        + _CWE_PREFIX
        + " "
        + _numbered(example_words[:NUM_COMMON])
        + "\n"
    )
    before_ids = encode(tokenizer, example + _CWE_BEFORE)
    after_ids = encode(tokenizer, _CWE_AFTER)
    answer_ids = encode(tokenizer, answer_prefix_text(_CWE_PREFIX, frame))
    budget = prompt_tokens - len(frame.head) - len(before_ids) - len(after_ids) - len(frame.tail) - len(answer_ids)

    def context(n: int) -> list[int]:
        if n > len(order):
            raise ValueError(f"cwe needs {n} distinct words; the word pool has {len(order)}")
        return encode(tokenizer, _word_list(order[:n], common, other, f"{seed}:{n}"))

    lowest = NUM_COMMON + 1
    per_item = max(1.0, len(encode(tokenizer, _numbered(order[:200]))) / 200)
    guess = int((budget / per_item - NUM_COMMON * common) / other) + NUM_COMMON
    smallest = len(context(lowest))
    if smallest > budget:
        need = prompt_tokens - budget + smallest
        raise ValueError(
            f"cwe needs at least {need} prompt tokens here (a context length of at least {need + CWE_MAX_NEW_TOKENS}): "
            f"the solved example, the template and the smallest list take {need}; got {prompt_tokens}"
        )
    n, _ = fit_count(lambda n: len(context(n)), budget, lowest, max(guess, lowest))
    return {
        "input_ids": compose(frame, before_ids, context(n), after_ids, answer_ids),
        "outputs": order[:NUM_COMMON],
        "num_words": n,
    }


def zeta(alpha: float) -> float:
    """Riemann zeta function for ``alpha > 1`` (partial sum plus Euler-Maclaurin tail; error below 1e-12)."""
    if not alpha > 1:
        raise ValueError(f"alpha must be greater than 1, got {alpha}")
    n = 1000
    partial = sum(k**-alpha for k in range(1, n))
    return partial + n ** (1 - alpha) / (alpha - 1) + 0.5 * n**-alpha + alpha * n ** (-alpha - 1) / 12


def make_fwe_sample(
    tokenizer, prompt_tokens: int, rng: random.Random, chat: bool, alpha: float = 2.0, word_letters: int = 6
) -> dict:
    """Build one frequent-words-extraction prompt of at most ``prompt_tokens`` tokens (within one coded word).

    Args:
        tokenizer: the model's tokenizer.
        prompt_tokens: prompt length in tokens (the context length minus the tokens to generate).
        rng: the sample's random generator.
        chat: wrap the user message in the tokenizer's chat template.
        alpha: Zeta distribution parameter (RULER: 2.0).
        word_letters: letters per coded word (RULER: 6).

    Returns:
        ``input_ids``, ``outputs`` (the three most frequent coded words after ``...``), ``vocab_size`` and
        ``num_words`` (coded words in the text).
    """
    vocab_size = prompt_tokens // 50
    if vocab_size < 5:
        raise ValueError(f"fwe needs at least 250 prompt tokens (a vocabulary of 5 words); got {prompt_tokens}")
    vocab: list[str] = []
    seen = set()
    while len(vocab) < vocab_size:
        word = "".join(rng.choices(string.ascii_lowercase, k=word_letters))
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    vocab[0] = "..."  # the most frequent "word" is noise
    z = zeta(alpha)
    seed = f"fwe:{rng.getrandbits(64)}"

    def words(scale: int, dots: int = 0) -> list[str]:
        out = [vocab[0]] * dots  # extra noise words fill the last few tokens (they only add to the noise count)
        for k, word in enumerate(vocab, start=1):
            out += [word] * int(scale * k**-alpha / z)
        random.Random(f"{seed}:{scale}:{dots}").shuffle(out)
        return out

    frame = chat_frame(tokenizer, chat)
    before_ids, after_ids = encode(tokenizer, _FWE_BEFORE), encode(tokenizer, _FWE_AFTER)
    answer_ids = encode(tokenizer, answer_prefix_text(_FWE_PREFIX, frame))
    budget = prompt_tokens - len(frame.head) - len(before_ids) - len(after_ids) - len(frame.tail) - len(answer_ids)

    def context(scale: int, dots: int = 0) -> list[int]:
        return encode(tokenizer, " " + " ".join(words(scale, dots)))

    lowest = int(4**alpha * z) + 1  # the 4th word (the last answer) appears at least once
    per_word = max(1.0, len(context(400)) / max(len(words(400)), 1))
    try:
        scale, size = fit_count(lambda s: len(context(s)), budget, lowest, int(budget / per_word))
    except ValueError as err:
        raise ValueError(f"fwe at {prompt_tokens} prompt tokens: {err}; raise the length") from None
    dots, _ = fit_count(lambda d: len(context(scale, d)), budget, 0, budget - size)
    return {
        "input_ids": compose(frame, before_ids, context(scale, dots), after_ids, answer_ids),
        "outputs": vocab[1:4],
        "vocab_size": vocab_size,
        "num_words": len(words(scale, dots)),
    }
