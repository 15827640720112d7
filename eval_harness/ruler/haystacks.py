"""The haystacks of the RULER generators, as endless streams of token units.

* ``noise``: RULER's repeated filler line, ``"The grass is green. The sky is blue. The sun is yellow. Here we go.
  There and back again."``, one line per unit (RULER joins the repeats with newlines too).
* ``essay``: RULER uses Paul Graham's essays, which cannot be shipped. This haystack is instead the documentation
  text of Python standard-library modules from :func:`eval_harness.needle.haystack_text` (CPython docstrings,
  PSF-2.0 licence; present on every machine with Python, nothing is downloaded), with runs of whitespace collapsed to
  one space as RULER does with the essays. A unit is one sentence (long sentences are split every 40 words), so
  needles go between sentences as in RULER. Longer contexts than the text repeat it.
* ``needle``: distractor needles with random keys and values (RULER's "needle" haystack); built by the NIAH task.
"""

from __future__ import annotations

import functools
import re
import weakref
from collections.abc import Iterator

from .prompt import cycle_units, encode, encode_many

NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_MAX_SENTENCE_WORDS = 40
_essay_cache: dict[int, tuple[weakref.ref, list[list[int]]]] = {}


def noise_units(tokenizer) -> Iterator[list[int]]:
    """The noise haystack: one ``NOISE_LINE`` plus newline per unit, forever."""
    return cycle_units([encode(tokenizer, NOISE_LINE + "\n")])


@functools.lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """The essay haystack as sentences (whitespace collapsed; sentences over 40 words split into 40-word pieces)."""
    from ..needle import haystack_text

    text = " ".join(haystack_text().split())
    sentences: list[str] = []
    for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z(\"'`])", text):
        words = sentence.split(" ")
        for start in range(0, len(words), _MAX_SENTENCE_WORDS):
            sentences.append(" ".join(words[start : start + _MAX_SENTENCE_WORDS]))
    return tuple(s for s in sentences if s)


def essay_units(tokenizer) -> Iterator[list[int]]:
    """The essay haystack: one sentence (with its leading space) per unit, the text repeated forever."""
    hit = _essay_cache.get(id(tokenizer))
    if hit is None or hit[0]() is not tokenizer:
        units = encode_many(tokenizer, [" " + s for s in essay_sentences()])
        try:
            _essay_cache[id(tokenizer)] = (weakref.ref(tokenizer), units)
        except TypeError:
            pass
        return cycle_units(units)
    return cycle_units(hit[1])


def essay_info() -> dict:
    """Source, licence and identity of the essay haystack (for result metadata)."""
    from ..needle import haystack_info

    info = dict(haystack_info())
    info.update(
        {
            "used_for": "RULER essay-haystack tasks (niah_single_2/3, niah_multikey_1, niah_multivalue, "
            "niah_multiquery) in place of the Paul Graham essays",
            "processing": f"whitespace collapsed; split into sentences, at most {_MAX_SENTENCE_WORDS} words each",
            "sentences": len(essay_sentences()),
        }
    )
    return info


def essay_contains(text: str) -> bool:
    """Whether ``text`` occurs in the essay haystack (case-insensitive)."""
    from ..needle import haystack_text

    return text.lower() in _lower_haystack(haystack_text())


@functools.lru_cache(maxsize=2)
def _lower_haystack(text: str) -> str:
    return text.lower()
