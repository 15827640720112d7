"""RULER needle-in-a-haystack tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context
Language Models?", section 3.1 "Retrieval: Needle-in-a-haystack").

A needle is ``"One of the special magic {values} for {key} is: {value}."``. The eight NIAH tasks differ in haystack
(noise, essay, or other needles), key and value types (adjective-noun words, 7-digit numbers, UUIDs), and in how many
keys, values per key and queried keys there are (the task table in :mod:`eval_harness.ruler.tasks`, from RULER's
``synthetic.yaml``). As in RULER, the needles are shuffled and inserted at sorted depths drawn from 40 evenly spaced
depths in ``[0, 1]``, unless depths are given; the answer is every value of every queried key, and the prompt ends
with RULER's answer prefix. The template sentences are RULER's (``scripts/data/synthetic/constants.py``, Apache-2.0),
in their singular form when a single value is asked for, as RULER's generator rewrites them.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

from .haystacks import essay_contains, essay_units, noise_units
from .prompt import answer_prefix_text, assemble, batched_units, chat_frame, compose, encode
from .words import key_words

#: RULER's needle depths: 40 evenly spaced percentages 0..100, rounded to integers, as fractions.
RULER_DEPTHS: tuple[float, ...] = tuple(round(100 * i / 39) / 100 for i in range(40))
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class NiahConfig:
    """One NIAH task: haystack type, key/value types and counts (RULER ``synthetic.yaml``)."""

    haystack: str  # "noise" | "essay" | "needle"
    key_type: str  # "words" | "numbers" | "uuids"
    value_type: str
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


def _random_item(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return rng.choice(key_words())
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}; use 'words', 'numbers' or 'uuids'")


def _templates(kind: str, query: str, singular: bool) -> tuple[str, str, str]:
    if singular:
        one = kind[:-1]
        return (
            f"A special magic {one} is hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {one} afterwards.\n",
            f"\nWhat is the special magic {one} for {query} mentioned in the provided text?",
            f" The special magic {one} for {query} mentioned in the provided text is",
        )
    return (
        f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kind} afterwards.\n",
        f"\nWhat are all the special magic {kind} for {query} mentioned in the provided text?",
        f" The special magic {kind} for {query} mentioned in the provided text are",
    )


def _join_queries(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def make_niah_sample(
    tokenizer, cfg: NiahConfig, prompt_tokens: int, rng: random.Random, chat: bool, depths=None
) -> dict:
    """Build one NIAH prompt of exactly ``prompt_tokens`` tokens.

    Args:
        tokenizer: the model's tokenizer.
        cfg: the task's :class:`NiahConfig`.
        prompt_tokens: prompt length in tokens (RULER: the context length minus the tokens to generate).
        rng: the sample's random generator (keys, values, depths, distractors).
        chat: wrap the user message in the tokenizer's chat template.
        depths: optional needle depths in ``[0, 1]``, one per needle (``num_keys x num_values``); default: a sorted
            draw from :data:`RULER_DEPTHS`.

    Returns:
        ``input_ids``, ``outputs`` (the expected values), ``depths`` (requested, per needle in prompt order),
        ``actual_depths`` (fraction of the haystack tokens before each needle), ``needle_positions`` (token index
        of each needle in ``input_ids``), ``needles`` (their text) and ``query`` (the queried keys).
    """
    n_keys = max(cfg.num_keys, cfg.num_queries)
    keys: list[str] = []
    while len(keys) < n_keys:
        key = _random_item(rng, cfg.key_type)
        if key in keys or (cfg.haystack == "essay" and essay_contains(key)):
            continue
        keys.append(key)
    values = [[_random_item(rng, cfg.value_type) for _ in range(cfg.num_values)] for _ in keys]
    needles = [NEEDLE.format(kind=cfg.value_type, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    if depths is None:
        depths = sorted(rng.sample(RULER_DEPTHS, len(needles)))
    else:
        depths = [float(d) for d in depths]
        if len(depths) != len(needles):
            raise ValueError(f"this task inserts {len(needles)} needles; got {len(depths)} depths")
    queried = rng.sample(range(n_keys), cfg.num_queries)
    query = _join_queries([keys[i] for i in queried])
    answers = [v for i in queried for v in values[i]]
    singular = cfg.num_queries * cfg.num_values == 1
    before, after, prefix = _templates(cfg.value_type, query, singular)

    frame = chat_frame(tokenizer, chat)
    line = (lambda s: " " + s) if cfg.haystack == "essay" else (lambda s: s + "\n")
    signals = [(d, encode(tokenizer, line(text))) for d, text in zip(depths, needles)]
    before_ids, after_ids = encode(tokenizer, before), encode(tokenizer, after)
    answer_ids = encode(tokenizer, answer_prefix_text(prefix, frame))
    fixed = len(frame.head) + len(before_ids) + len(after_ids) + len(frame.tail) + len(answer_ids)
    fill = prompt_tokens - fixed - sum(len(ids) for _, ids in signals)
    if fill < 1:
        raise ValueError(
            f"a {prompt_tokens}-token prompt leaves no room for the haystack: template, question and needles take "
            f"{prompt_tokens - fill} tokens; raise the length to at least {prompt_tokens - fill + 64 + MAX_NEW_TOKENS}"
        )
    if cfg.haystack == "noise":
        units = noise_units(tokenizer)
    elif cfg.haystack == "essay":
        units = essay_units(tokenizer)
    elif cfg.haystack == "needle":
        real = set(keys)

        def distractors(count: int) -> list[str]:
            out = []
            while len(out) < count:
                key = _random_item(rng, cfg.key_type)
                if key not in real:
                    value = _random_item(rng, cfg.value_type)
                    out.append(line(NEEDLE.format(kind=cfg.value_type, key=key, value=value)))
            return out

        units = batched_units(distractors, tokenizer)
    else:
        raise ValueError(f"unknown haystack {cfg.haystack!r}; use 'noise', 'essay' or 'needle'")
    built = assemble(units, fill, signals)
    offset = len(frame.head) + len(before_ids)
    return {
        "input_ids": compose(frame, before_ids, built.ids, after_ids, answer_ids),
        "outputs": answers,
        "depths": list(depths),
        "actual_depths": built.actual_depths,
        "needle_positions": [offset + p for p in built.positions],
        "needles": needles,
        "query": query,
    }
