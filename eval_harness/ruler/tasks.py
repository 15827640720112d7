"""The RULER task table and the sample builder (Hsieh et al., 2024; task settings from RULER's
``scripts/synthetic.yaml``, tokens to generate from ``scripts/data/synthetic/constants.py``).

Lengths follow RULER: a sample of length ``L`` is a prompt of ``L - max_new_tokens`` tokens (chat template included),
so that prompt and answer fit in ``L`` tokens. NIAH and variable-tracking prompts have exactly that many tokens;
``cwe`` and ``fwe`` prompts are the longest list that fits (a few tokens short at most).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .aggregation import CWE_MAX_NEW_TOKENS, FWE_MAX_NEW_TOKENS, make_cwe_sample, make_fwe_sample
from .niah import MAX_NEW_TOKENS as NIAH_MAX_NEW_TOKENS
from .niah import NiahConfig, make_niah_sample
from .vt import MAX_NEW_TOKENS as VT_MAX_NEW_TOKENS
from .vt import make_vt_sample


@dataclass(frozen=True)
class RulerTask:
    """One RULER task.

    Attributes:
        name: RULER's task name (``niah_single_1``, ``vt``, ...).
        family: RULER's task family (``niah``, ``variable_tracking``, ``common_words_extraction``,
            ``freq_words_extraction``).
        max_new_tokens: tokens to generate (RULER's ``tokens_to_generate``).
        metric: ``string_match_all`` (every family built here; RULER uses ``string_match_part`` for ``qa``).
        haystack: ``noise``, ``essay``, ``needle`` or ``None`` (list tasks).
        niah: the NIAH settings, for NIAH tasks.
    """

    name: str
    family: str
    max_new_tokens: int
    metric: str = "string_match_all"
    haystack: str | None = None
    niah: NiahConfig | None = field(default=None, repr=False)


def _niah(name: str, cfg: NiahConfig) -> RulerTask:
    return RulerTask(name, "niah", NIAH_MAX_NEW_TOKENS, haystack=cfg.haystack, niah=cfg)


TASKS: dict[str, RulerTask] = {
    t.name: t
    for t in [
        _niah("niah_single_1", NiahConfig("noise", "words", "numbers")),
        _niah("niah_single_2", NiahConfig("essay", "words", "numbers")),
        _niah("niah_single_3", NiahConfig("essay", "words", "uuids")),
        _niah("niah_multikey_1", NiahConfig("essay", "words", "numbers", num_keys=4)),
        _niah("niah_multikey_2", NiahConfig("needle", "words", "numbers")),
        _niah("niah_multikey_3", NiahConfig("needle", "uuids", "uuids")),
        _niah("niah_multivalue", NiahConfig("essay", "words", "numbers", num_values=4)),
        _niah("niah_multiquery", NiahConfig("essay", "words", "numbers", num_queries=4)),
        RulerTask("vt", "variable_tracking", VT_MAX_NEW_TOKENS, haystack="noise"),
        RulerTask("cwe", "common_words_extraction", CWE_MAX_NEW_TOKENS),
        RulerTask("fwe", "freq_words_extraction", FWE_MAX_NEW_TOKENS),
    ]
}

#: RULER tasks that are not built here, with the reason.
NOT_BUILT: dict[str, str] = {
    "qa_1": (
        "RULER's qa_1 pads SQuAD (v2.0 dev set) question-answering paragraphs with distractor paragraphs from the same "
        "set; that data set is neither shipped with this project nor available offline here, so the task is left out "
        "(metric when built: string_match_part, 32 new tokens)."
    ),
    "qa_2": (
        "RULER's qa_2 pads HotpotQA (dev distractor set) paragraphs with distractor paragraphs from the same set; that "
        "data set is neither shipped with this project nor available offline here, so the task is left out (metric "
        "when built: string_match_part, 32 new tokens)."
    ),
}

ALL_TASK_NAMES: tuple[str, ...] = (*TASKS, *NOT_BUILT)


def get_task(name: str) -> RulerTask:
    """The :class:`RulerTask` called ``name``; a clear error for unknown or left-out tasks."""
    if name in TASKS:
        return TASKS[name]
    if name in NOT_BUILT:
        raise ValueError(f"RULER task {name!r} is not built: {NOT_BUILT[name]} Built tasks: {', '.join(TASKS)}.")
    raise ValueError(f"unknown RULER task {name!r}; choose from {', '.join(TASKS)}")


def _builder(task: RulerTask) -> Callable:
    """``build(tokenizer, prompt_tokens, length, rng, chat, depths) -> sample`` for one task."""
    if task.family == "niah":
        return lambda tok, prompt, length, rng, chat, d: make_niah_sample(tok, task.niah, prompt, rng, chat, d)
    if task.family == "variable_tracking":
        return lambda tok, prompt, length, rng, chat, d: make_vt_sample(tok, prompt, rng, chat, depths=d)
    if task.family == "common_words_extraction":
        return lambda tok, prompt, length, rng, chat, d: make_cwe_sample(tok, prompt, length, rng, chat)
    return lambda tok, prompt, length, rng, chat, d: make_fwe_sample(tok, prompt, rng, chat)


def make_ruler_samples(
    tokenizer,
    task: str,
    length: int,
    n: int,
    seed: int = 0,
    chat: bool = True,
    depths: Sequence[Sequence[float]] | None = None,
) -> list[dict]:
    """Build ``n`` samples of one RULER task at one context length, in the model's own tokens.

    Args:
        tokenizer: the model's tokenizer (a transformers tokenizer; its chat template is used when ``chat``).
        task: a name from :data:`TASKS`.
        length: context length ``L`` in tokens: each prompt has ``L - max_new_tokens`` tokens.
        n: number of samples.
        seed: seeds the samples; sample ``i`` draws from ``random.Random(f"ruler:{task}:{seed}:{i}")``, so keys,
            values and depths of a sample are the same at every length.
        chat: wrap each prompt in the tokenizer's chat template (with the generation prompt).
        depths: optional per-sample depths (``depths[i]`` lists one depth in ``[0, 1]`` per needle of sample ``i``;
            for ``vt``, per assignment of the queried chain). Not used by ``cwe`` / ``fwe``.

    Returns:
        One dict per sample: ``id``, ``task``, ``length``, ``seed``, ``index``, ``input_ids``, ``prompt_tokens``,
        ``target_prompt_tokens``, ``outputs`` (reference strings), ``max_new_tokens``, ``metric``, and per task
        ``depths`` / ``actual_depths`` / ``needle_positions`` (NIAH, vt) or list sizes (cwe, fwe).
    """
    spec = get_task(task)
    if isinstance(length, bool) or not isinstance(length, int) or length <= spec.max_new_tokens:
        raise ValueError(
            f"length must be an integer above {spec.max_new_tokens} (the task's new tokens); got {length!r}"
        )
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if depths is not None and len(depths) != n:
        raise ValueError(f"depths must hold one list per sample ({n}); got {len(depths)}")
    if depths is not None and spec.family not in ("niah", "variable_tracking"):
        raise ValueError(f"{task} has no needles; depths apply to NIAH tasks and vt only")
    prompt_tokens = length - spec.max_new_tokens
    build = _builder(spec)
    samples = []
    for i in range(n):
        rng = random.Random(f"ruler:{task}:{seed}:{i}")
        sample = build(tokenizer, prompt_tokens, length, rng, chat, None if depths is None else depths[i])
        sample.update(
            {
                "id": f"{seed}-{i}",
                "task": task,
                "length": length,
                "seed": seed,
                "index": i,
                "prompt_tokens": len(sample["input_ids"]),
                "target_prompt_tokens": prompt_tokens,
                "max_new_tokens": spec.max_new_tokens,
                "metric": spec.metric,
            }
        )
        samples.append(sample)
    return samples
