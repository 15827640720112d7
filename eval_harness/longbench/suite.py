"""LongBench and LongBench-E as runner suites: prompts per (dataset, token budget), official scoring, length buckets."""

from __future__ import annotations

import random

from ..metrics import longbench_score
from .config import (
    DATA_URL,
    LONGBENCH_E_TASKS,
    LONGBENCH_TASKS,
    MAX_NEW_TOKENS,
    NO_CHAT_TASKS,
    STOP_AT_NEWLINE_TASKS,
)
from .data import load_records
from .prompts import build_prompt

#: LongBench-E length buckets of the release's ``eval.py`` (``length`` = words, or characters for Chinese).
BUCKETS: tuple[tuple[str, int], ...] = (("0-4k", 4000), ("4-8k", 8000), ("8k+", 1 << 62))


def length_bucket(source_length: int) -> str:
    """The LongBench-E bucket of a record's ``length``: ``0-4k`` (< 4000), ``4-8k`` (< 8000) or ``8k+``."""
    for name, upper in BUCKETS:
        if source_length < upper:
            return name
    return BUCKETS[-1][0]


class LongBenchSuite:
    """LongBench (``e=False``) or LongBench-E (``e=True``) for :func:`eval_harness.runner.run_study`.

    The runner's context length is the prompt's token budget (``max_input_tokens``, middle truncation); the
    records keep their own lengths below it.

    Args:
        tokenizer: the model's tokenizer.
        data: folder, zip or URL of the jsonl files (``None``: the release's ``data.zip``).
        e: LongBench-E.
        samples: records per dataset (a seeded random subset, in file order); ``None`` = all.
        seed: seeds the subset.
        chat: use the chat template (except on the datasets the release runs without it).
        use_datasets: read the files through ``datasets`` (``None``: when installed).
    """

    def __init__(self, tokenizer, data=None, e=False, samples=None, seed=0, chat=True, use_datasets=None):
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
            raise ValueError(f"samples must be a positive integer or null (all records); got {samples!r}")
        self.tokenizer = tokenizer
        self.data = data
        self.e = bool(e)
        self.n = samples
        self.seed = seed
        self.chat = chat
        self.use_datasets = use_datasets
        self.name = "longbench_e" if self.e else "longbench"
        self._records: dict[str, list[dict]] = {}

    @property
    def all_tasks(self) -> tuple[str, ...]:
        """The datasets of this benchmark."""
        return LONGBENCH_E_TASKS if self.e else LONGBENCH_TASKS

    def resolve_tasks(self, tasks) -> list[str]:
        """``"all"`` or a list of dataset names, checked against this benchmark."""
        if tasks in (None, "all", ["all"]):
            return list(self.all_tasks)
        out = []
        for t in tasks:
            name = t.removesuffix("_e")
            if name not in self.all_tasks:
                raise ValueError(f"{t!r} is not a {self.name} dataset; choose from {', '.join(self.all_tasks)}")
            out.append(name)
        return out

    def records(self, task: str) -> list[dict]:
        """The chosen records of one dataset (read once)."""
        if task not in self._records:
            records = load_records(self.data, task, e=self.e, use_datasets=self.use_datasets)
            if self.n is not None and self.n < len(records):
                keep = sorted(random.Random(f"longbench:{task}:{self.seed}").sample(range(len(records)), self.n))
                records = [records[i] for i in keep]
            self._records[task] = records
        return self._records[task]

    def sample_ids(self, task: str, length: int) -> list[str]:
        """The ids :meth:`samples` will give."""
        return [str(r["_id"]) for r in self.records(task)]

    def samples(self, task: str, length: int) -> list[dict]:
        """Prompts of one dataset with a budget of ``length`` tokens, in the runner's sample format."""
        out = []
        for record in self.records(task):
            ids, cut = build_prompt(self.tokenizer, task, record, length, chat=self.chat)
            out.append(
                {
                    "id": str(record["_id"]),
                    "input_ids": ids,
                    "outputs": list(record["answers"]),
                    "all_classes": record["all_classes"],
                    "max_new_tokens": MAX_NEW_TOKENS[task],
                    "stop_at_newline": task in STOP_AT_NEWLINE_TASKS,
                    "extra": {
                        "source_length": record["length"],
                        "language": record["language"],
                        "truncated": cut,
                        "chat": self.chat and task not in NO_CHAT_TASKS,
                        # kept with the answer, so the file alone can be scored again (eval_harness/rescore.py)
                        **({"all_classes": list(record["all_classes"])} if record["all_classes"] else {}),
                    },
                }
            )
        return out

    def score(self, task: str, sample: dict, prediction: str) -> float:
        """The release's score of one sample, 0..100 (best over the answers, first-line rule applied)."""
        return 100.0 * longbench_score(task, prediction, sample["outputs"], sample["all_classes"])

    def info(self, tasks: list[str]) -> dict:
        """Metadata for the results header."""
        return {
            "suite": self.name,
            "source": "LongBench (Bai et al., 2023), THUDM/LongBench release: prompts, generation lengths, metrics",
            "data": self.data or DATA_URL,
            "tasks": {
                t: {"max_new_tokens": MAX_NEW_TOKENS[t], "chat": self.chat and t not in NO_CHAT_TASKS} for t in tasks
            },
            "samples": self.n,
            "seed": self.seed,
            "chat": self.chat,
            "not_built": {},
        }
