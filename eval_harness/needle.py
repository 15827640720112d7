"""Needle-in-a-haystack prompts of an exact token length (a task generator; no model code).

Haystack source and licence: the haystack is the documentation text of Python standard-library modules (the module
docstrings and the docstrings of the public classes, functions and methods they define), gathered with
:func:`inspect.getdoc` over the fixed, sorted list :data:`HAYSTACK_MODULES`. That text is part of CPython, distributed
under the Python Software Foundation License (PSF-2.0, https://docs.python.org/3/license.html), which permits
redistribution; every machine with Python has it, so no data file is shipped or downloaded. The text is deterministic
for a given Python version (and, for a few modules such as ``os``, platform); :func:`haystack_sha256` identifies it.
Prompts longer than the text (~85K tokens with a Qwen2 tokenizer) repeat it.

Each sample hides one needle sentence, ``"The special magic number for {key} is {value}."``, at a paragraph boundary
of the haystack, at depths spread evenly from 0.05 to 0.95, followed by the question. Every prompt of one call has
exactly ``context_tokens`` tokens (the haystack is trimmed at token level), so a batch of them needs no padding.

Example (needs a tokenizer)::

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained("Qwen/Qwen2.5-0.5B-Instruct")
    samples = make_needle_prompts(tok, context_tokens=8192, n=10, seed=0)
    assert {len(s["input_ids"]) for s in samples} == {8192}
    score(generated_text, samples[0]["answer"])  # True if the 7-digit value appears
"""

from __future__ import annotations

import bisect
import hashlib
import importlib
import inspect
import random
import re
import sys
import warnings

#: Standard-library modules whose documentation forms the haystack (sorted; importing them has no side effects).
HAYSTACK_MODULES: tuple[str, ...] = tuple(
    sorted(
        [
            "argparse", "asyncio", "collections", "collections.abc", "concurrent.futures", "contextlib", "csv",
            "dataclasses", "datetime", "decimal", "difflib", "email", "email.message", "email.parser", "enum",
            "fractions", "functools", "heapq", "http.client", "http.server", "inspect", "io", "ipaddress",
            "itertools", "json", "logging", "logging.handlers", "operator", "os", "pathlib", "pickle", "pprint",
            "queue", "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess", "tarfile",
            "textwrap", "threading", "typing", "unittest", "unittest.mock", "urllib.parse", "urllib.request",
            "uuid", "zipfile",
        ]
    )
)  # fmt: skip

#: Made-up, word-like city names (none occurs in the haystack; checked when the haystack is built).
NEEDLE_KEYS: tuple[str, ...] = (
    "Arvandel", "Brisktown", "Coralmere", "Dunvarrow", "Elmshade", "Fernhollow", "Glimmerford", "Hartwick",
    "Istarun", "Jadeport", "Kelvarra", "Lunemoor", "Mistvale", "Northcairn", "Oakenreach", "Pellaton",
    "Quarrybrook", "Rivenholm", "Saltmere", "Tavistrand", "Ulvenport", "Veldmoor", "Wrenhaven", "Yarrowick",
)  # fmt: skip

NEEDLE_TEMPLATE = "The special magic number for {key} is {value}."
QUESTION_TEMPLATE = (
    "What is the special magic number for {key} mentioned in the text above? Answer with the number only."
)
_SENTINEL = "\u2063HF_OFFLOAD_NEEDLE_CONTENT\u2063"

_haystack_text_cache: str | None = None
_token_cache: dict[int, tuple[object, list[int], list[int]]] = {}


# ------------------------------------------------------------------------------------------------------- haystack
def _doc_sections() -> list[str]:
    sections: list[str] = []
    for modname in HAYSTACK_MODULES:
        module = importlib.import_module(modname)
        doc = inspect.getdoc(module)
        if doc:
            sections.append(f"Module {modname}\n\n{doc}")
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if getattr(obj, "__module__", None) != modname:
                continue  # re-exports are documented where they are defined
            doc = inspect.getdoc(obj)
            if doc:
                sections.append(f"{modname}.{name}\n\n{doc}")
            if inspect.isclass(obj):
                for attr, member in sorted(vars(obj).items()):
                    if attr.startswith("_") or not inspect.isfunction(member) or not member.__doc__:
                        continue
                    sections.append(f"{modname}.{name}.{attr}\n\n{inspect.cleandoc(member.__doc__)}")
    return sections


def haystack_text() -> str:
    """The haystack: standard-library documentation, paragraphs separated by blank lines (cached)."""
    global _haystack_text_cache
    if _haystack_text_cache is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            text = "\n\n".join(_doc_sections())
        text = re.sub(r"[ \t]+\n", "\n", text)  # trailing spaces
        text = re.sub(r"\n{3,}", "\n\n", text).strip() + "\n\n"
        for key in NEEDLE_KEYS:
            if key.lower() in text.lower():
                raise RuntimeError(f"needle key {key!r} occurs in the haystack; pick another name")
        if "special magic number" in text.lower():
            raise RuntimeError("the haystack already mentions a 'special magic number'")
        _haystack_text_cache = text
    return _haystack_text_cache


def haystack_sha256() -> str:
    """SHA-256 of :func:`haystack_text` (identifies the haystack of this Python version)."""
    return hashlib.sha256(haystack_text().encode()).hexdigest()


def haystack_info() -> dict:
    """Source, licence and identity of the haystack, for result metadata."""
    text = haystack_text()
    return {
        "source": "docstrings of Python standard-library modules (inspect.getdoc)",
        "licence": "PSF-2.0 (Python Software Foundation License)",
        "python": sys.version.split()[0],
        "modules": list(HAYSTACK_MODULES),
        "chars": len(text),
        "sha256": haystack_sha256(),
    }


def _haystack_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """Haystack token ids and the token offsets where a paragraph starts (0 included), cached per tokenizer.

    Paragraphs are tokenized separately (each with its trailing blank line), so every paragraph start is a token
    boundary where a needle can be inserted without splitting a word.
    """
    hit = _token_cache.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1], hit[2]
    paragraphs = [p + "\n\n" for p in haystack_text().split("\n\n") if p.strip()]
    encoded = tokenizer(paragraphs, add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    starts: list[int] = []
    for para in encoded:
        starts.append(len(ids))
        ids.extend(para)
    _token_cache[id(tokenizer)] = (tokenizer, ids, starts)
    return ids, starts


def _haystack_prefix(tokenizer, n_tokens: int) -> tuple[list[int], list[int]]:
    """The first ``n_tokens`` haystack tokens (text repeated as needed) and the paragraph starts among them."""
    ids, starts = _haystack_tokens(tokenizer)
    out: list[int] = []
    out_starts: list[int] = []
    while len(out) < n_tokens:
        base = len(out)
        out_starts.extend(base + s for s in starts if base + s < n_tokens)
        out.extend(ids[: n_tokens - base])
    return out, out_starts


# ------------------------------------------------------------------------------------------------------- template
def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _wrapper_ids(tokenizer, chat: bool) -> tuple[list[int], list[int]]:
    """Token ids before and after the user content: the chat template's, or the tokenizer's special tokens."""
    if chat:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        )
        if rendered.count(_SENTINEL) != 1:
            raise ValueError("the chat template did not render the user content exactly once")
        before, after = rendered.split(_SENTINEL)
        return _encode(tokenizer, before), _encode(tokenizer, after)
    probe = "needle"
    plain = _encode(tokenizer, probe)
    full = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []


# ----------------------------------------------------------------------------------------------------------- tasks
def needle_depths(n: int) -> list[float]:
    """``n`` depths spread evenly from 0.05 to 0.95 (0.5 for a single sample)."""
    if n == 1:
        return [0.5]
    return [0.05 + 0.9 * i / (n - 1) for i in range(n)]


def make_needle_prompts(tokenizer, context_tokens: int, n: int, seed: int, chat: bool = True) -> list[dict]:
    """Build ``n`` needle-in-a-haystack prompts of exactly ``context_tokens`` tokens each.

    Args:
        tokenizer: a transformers tokenizer (its chat template is used when ``chat``).
        context_tokens: length of every prompt in tokens, template and question included.
        n: number of samples; sample ``i`` hides its needle at depth ``0.05 + 0.9 * i / (n - 1)`` of the haystack.
        seed: seeds the keys and values (the same seed gives the same needles at every length).
        chat: wrap the content in the tokenizer's chat template with the generation prompt; if ``False`` (or the
            tokenizer has no template) the content is wrapped in the tokenizer's special tokens and ends with
            ``"\\nAnswer:"``.

    Returns:
        One dict per sample: ``input_ids`` (``list[int]``, length ``context_tokens``), ``answer`` (the 7-digit
        value, ``str``), ``depth`` (target depth in the haystack), ``actual_depth`` (where the needle starts, as a
        fraction of the haystack tokens; needles go to the nearest paragraph start), ``needle_position`` (token
        index of the needle in the prompt), ``key``, ``needle`` and ``question``.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if chat and getattr(tokenizer, "chat_template", None) is None:
        warnings.warn("tokenizer has no chat template; building plain prompts (chat=False)", stacklevel=2)
        chat = False
    before, after = _wrapper_ids(tokenizer, chat)
    rng = random.Random(seed)
    keys = rng.sample(NEEDLE_KEYS, n) if n <= len(NEEDLE_KEYS) else [rng.choice(NEEDLE_KEYS) for _ in range(n)]
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), n)]
    samples = []
    for depth, key, value in zip(needle_depths(n), keys, values):
        needle = NEEDLE_TEMPLATE.format(key=key, value=value)
        question = QUESTION_TEMPLATE.format(key=key)
        needle_ids = _encode(tokenizer, needle + "\n\n")
        question_ids = _encode(tokenizer, "\n\n" + question + ("" if chat else "\nAnswer:"))
        hay_len = context_tokens - len(before) - len(needle_ids) - len(question_ids) - len(after)
        if hay_len < 1:
            raise ValueError(
                f"context_tokens={context_tokens} leaves no room for the haystack; the template, needle and question "
                f"alone take {context_tokens - hay_len} tokens"
            )
        hay, starts = _haystack_prefix(tokenizer, hay_len)
        target = depth * hay_len
        j = bisect.bisect_left(starts, target)
        candidates = [starts[k] for k in (j - 1, j) if 0 <= k < len(starts)]
        insert = min(candidates, key=lambda s: (abs(s - target), s))
        input_ids = before + hay[:insert] + needle_ids + hay[insert:] + question_ids + after
        if len(input_ids) != context_tokens:  # cannot happen by construction; guards future edits
            raise AssertionError(f"built {len(input_ids)} tokens instead of {context_tokens}")
        samples.append(
            {
                "input_ids": input_ids,
                "answer": value,
                "depth": depth,
                "actual_depth": insert / hay_len,
                "needle_position": len(before) + insert,
                "key": key,
                "needle": needle,
                "question": question,
            }
        )
    return samples


def score(answer_text: str, expected: str) -> bool:
    """Whether the expected number appears in the generated text (digit groups split by ``,`` or spaces accepted)."""
    if answer_text is None:
        return False
    if expected in answer_text:
        return True
    return expected in re.sub(r"(?<=\d)[,\s](?=\d)", "", answer_text)
