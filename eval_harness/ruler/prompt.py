"""Token-level prompt assembly shared by the RULER generators.

A prompt is ``head + before + context + after + tail + answer_prefix`` in the model's own tokens:

* ``head`` / ``tail``: the chat template around the user message (with the generation prompt), or, without a chat
  template, the special tokens the tokenizer adds in front of a text (e.g. BOS) and nothing after;
* ``before`` / ``after``: the task's text around the context (instructions, question);
* ``answer_prefix``: the start of the answer, as RULER appends it after the model's template (its leading space is
  dropped after a chat template, where the assistant turn starts on a new line).

Haystack contexts (NIAH, variable tracking) are built from *units* (haystack lines or sentences, each tokenized on its
own with its separator) and *signals* (needles, variable assignments) inserted between units at requested depths; the
haystack is cut at token level so that the prompt has exactly the requested number of tokens (the last unit may be
cut short). List contexts (common / frequent words) are tokenized whole and sized by a search over their word count.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_SENTINEL = "\u2063RULER_USER_CONTENT\u2063"
_frames: dict[tuple[int, bool], tuple[weakref.ref, object]] = {}


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (``[]`` for an empty text)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of several texts in one call, without special tokens."""
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]


@dataclass(frozen=True)
class ChatFrame:
    """Token ids before and after the user message.

    Attributes:
        head: chat template up to the user content, or the tokenizer's leading special tokens.
        tail: chat template after the user content, up to and including the generation prompt (empty without chat).
        chat: whether a chat template was used.
    """

    head: tuple[int, ...]
    tail: tuple[int, ...]
    chat: bool


def chat_frame(tokenizer, chat: bool) -> ChatFrame:
    """The :class:`ChatFrame` of ``tokenizer`` (cached per tokenizer).

    Args:
        tokenizer: a transformers tokenizer.
        chat: use the tokenizer's chat template; raises ``ValueError`` if it has none.
    """
    key = (id(tokenizer), bool(chat))
    hit = _frames.get(key)
    if hit is not None and hit[0]() is tokenizer:
        return hit[1]
    if chat:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the tokenizer has no chat template; build plain prompts with chat=False (recipe key `chat: false`)"
            )
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        )
        if rendered.count(_SENTINEL) != 1:
            raise ValueError("the chat template did not render the user content exactly once; use chat=False")
        head, tail = rendered.split(_SENTINEL)
        frame = ChatFrame(tuple(encode(tokenizer, head)), tuple(encode(tokenizer, tail)), True)
    else:
        probe = "probe"
        plain = encode(tokenizer, probe)
        full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
        lead: list[int] = []
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                lead = full[:i]
                break
        frame = ChatFrame(tuple(lead), (), False)  # trailing special tokens (an EOS) would end the prompt: dropped
    try:
        _frames[key] = (weakref.ref(tokenizer), frame)
    except TypeError:  # not weak-referenceable: do not cache
        pass
    return frame


def answer_prefix_text(answer_prefix: str, frame: ChatFrame) -> str:
    """RULER's answer prefix as it follows this frame (leading whitespace dropped after a chat template)."""
    return answer_prefix.lstrip() if frame.chat else answer_prefix


def compose(frame: ChatFrame, before: list[int], context: list[int], after: list[int], answer: list[int]) -> list[int]:
    """``head + before + context + after + tail + answer`` as one list."""
    return [*frame.head, *before, *context, *after, *frame.tail, *answer]


# ------------------------------------------------------------------------------------------------- haystack assembly
@dataclass
class Assembly:
    """A context built from haystack units and signals.

    Attributes:
        ids: the context's token ids (exactly the requested number of haystack tokens plus the signals).
        positions: token offset of each signal in ``ids``, in the order the signals were given.
        actual_depths: where each signal went, as a fraction of the haystack tokens before it.
    """

    ids: list[int]
    positions: list[int]
    actual_depths: list[float]


def assemble(units: Iterator[list[int]], fill_tokens: int, signals: list[tuple[float, list[int]]]) -> Assembly:
    """Fill ``fill_tokens`` haystack tokens from ``units``; insert each signal at the unit boundary nearest its depth.

    Args:
        units: an endless iterator of haystack units (token id lists); the last unit taken is cut at token level so
            the haystack has exactly ``fill_tokens`` tokens.
        fill_tokens: number of haystack tokens (signals not included); at least 1.
        signals: ``(depth, ids)`` pairs, depth in ``[0, 1]`` (0 = before all haystack, 1 = after the last whole
            unit). Signals that land on the same boundary keep their order in this list.

    Returns:
        The :class:`Assembly`.
    """
    if fill_tokens < 1:
        raise ValueError(f"fill_tokens must be at least 1, got {fill_tokens}")
    hay: list[int] = []
    bounds = [0]  # start offsets of whole units, and the end of the last whole unit
    while len(hay) < fill_tokens:
        unit = next(units)
        if not unit:
            raise ValueError("a haystack unit encoded to no tokens")
        room = fill_tokens - len(hay)
        hay.extend(unit[:room])
        if len(unit) <= room:
            bounds.append(len(hay))
    order = sorted(range(len(signals)), key=lambda i: signals[i][0])  # stable: ties keep the given order
    placed: list[tuple[int, int]] = []  # (boundary, signal index), in insertion order
    for i in order:
        depth = signals[i][0]
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depths must lie in [0, 1], got {depth}")
        target = depth * fill_tokens
        placed.append((min(bounds, key=lambda b: (abs(b - target), b)), i))
    placed.sort(key=lambda p: p[0])  # stable
    ids: list[int] = []
    positions = [0] * len(signals)
    actual = [0.0] * len(signals)
    cursor = 0
    for boundary, i in placed:
        ids.extend(hay[cursor:boundary])
        cursor = boundary
        positions[i] = len(ids)
        actual[i] = boundary / fill_tokens
        ids.extend(signals[i][1])
    ids.extend(hay[cursor:])
    return Assembly(ids, positions, actual)


def cycle_units(units: list[list[int]]) -> Iterator[list[int]]:
    """Repeat a fixed list of units forever."""
    if not units:
        raise ValueError("no haystack units")
    while True:
        yield from units


def batched_units(make_texts: Callable[[int], list[str]], tokenizer, batch: int = 256) -> Iterator[list[int]]:
    """Endless units from a text generator, tokenized ``batch`` at a time (``make_texts(batch)`` gives the texts)."""
    while True:
        yield from encode_many(tokenizer, make_texts(batch))


# -------------------------------------------------------------------------------------------------- list contexts
def fit_count(measure: Callable[[int], int], budget: int, lowest: int, guess: int) -> tuple[int, int]:
    """The largest count ``n >= lowest`` whose ``measure(n)`` (a token count, non-decreasing in ``n``) fits ``budget``.

    Args:
        measure: tokens taken by a context of ``n`` items.
        budget: tokens available.
        lowest: the smallest meaningful count.
        guess: a first estimate of the answer.

    Returns:
        ``(n, measure(n))``.

    Raises:
        ValueError: even ``lowest`` items do not fit.
    """
    size_low = measure(lowest)
    if size_low > budget:
        raise ValueError(f"even the smallest context ({lowest} items, {size_low} tokens) exceeds {budget} tokens")
    lo, lo_size = lowest, size_low  # fits
    hi = None  # known not to fit
    n = max(guess, lowest + 1)
    step = max(1, n // 64)
    size = measure(n)
    if size <= budget:  # gallop up from the guess
        while size <= budget:
            lo, lo_size = n, size
            n, step = n + step, step * 2
            size = measure(n)
        hi = n
    else:  # gallop down
        hi = n
        while True:
            n, step = max(lowest, n - step), step * 2
            if n == lowest:
                break
            size = measure(n)
            if size <= budget:
                lo, lo_size = n, size
                break
            hi = n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        size = measure(mid)
        if size <= budget:
            lo, lo_size = mid, size
        else:
            hi = mid
    return lo, lo_size
