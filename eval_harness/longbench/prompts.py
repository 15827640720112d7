"""LongBench prompts in the model's tokens, as the release's ``pred.py`` builds them.

1. ``PROMPTS[dataset].format(context=..., input=...)``;
2. if its tokens (the tokenizer's special tokens included) exceed ``max_input_tokens``, keep the first and the last
   ``max_input_tokens // 2`` tokens, decoded without special tokens and joined (middle truncation: instructions and
   question at both ends survive);
3. apply the chat template, except on the few-shot and code datasets (:data:`~.config.NO_CHAT_TASKS`), where the
   text is tokenized as is (with the tokenizer's special tokens). The release uses each model's own chat format;
   here it is the tokenizer's chat template.
"""

from __future__ import annotations

from .config import NO_CHAT_TASKS, PROMPTS


def middle_truncate(tokenizer, text: str, max_input_tokens: int) -> tuple[str, bool]:
    """``text``, or its first and last ``max_input_tokens // 2`` tokens decoded and joined; and whether it was cut."""
    ids = list(tokenizer(text)["input_ids"])
    if len(ids) <= max_input_tokens:
        return text, False
    half = max_input_tokens // 2
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return head + tail, True


def build_prompt(
    tokenizer, task: str, record: dict, max_input_tokens: int, chat: bool = True
) -> tuple[list[int], bool]:
    """Token ids of one LongBench prompt and whether the middle was cut.

    Args:
        tokenizer: the model's tokenizer.
        task: dataset name without ``_e``.
        record: a LongBench record (``context`` and ``input`` are used).
        max_input_tokens: token budget of the prompt before the chat template (the release's ``model2maxlen``).
        chat: use the chat template on the datasets that take it; ``False`` builds plain prompts everywhere.
    """
    if task not in PROMPTS:
        raise ValueError(f"unknown LongBench dataset {task!r}; choose from {', '.join(PROMPTS)}")
    if isinstance(max_input_tokens, bool) or not isinstance(max_input_tokens, int) or max_input_tokens < 2:
        raise ValueError(f"max_input_tokens must be an integer of at least 2; got {max_input_tokens!r}")
    text = PROMPTS[task].format(context=record["context"], input=record["input"])
    text, cut = middle_truncate(tokenizer, text, max_input_tokens)
    if chat and task not in NO_CHAT_TASKS:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; set `chat: false` in the recipe for plain prompts")
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"]), cut
    return list(tokenizer(text)["input_ids"]), cut
