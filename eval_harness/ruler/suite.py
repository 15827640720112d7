"""RULER as a runner suite: samples per (task, length), scoring, and metadata."""

from __future__ import annotations

from ..metrics import ruler_postprocess, string_match_all_one, string_match_part_one
from .tasks import NOT_BUILT, TASKS, get_task, make_ruler_samples

_EXTRA_KEYS = ("depths", "actual_depths", "needle_positions", "num_words", "vocab_size")


class RulerSuite:
    """RULER tasks for :func:`eval_harness.runner.run_study`.

    Args:
        tokenizer: the model's tokenizer.
        samples: samples per task and length.
        seed: base seed (see :func:`~eval_harness.ruler.tasks.make_ruler_samples`).
        chat: wrap prompts in the tokenizer's chat template.
    """

    name = "ruler"

    def __init__(self, tokenizer, samples: int, seed: int = 0, chat: bool = True):
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"RULER needs a positive number of samples per task and length; got {samples!r}")
        self.tokenizer = tokenizer
        self.n = samples
        self.seed = seed
        self.chat = chat

    def resolve_tasks(self, tasks) -> list[str]:
        """``"all"`` (every built task) or a list of task names, checked."""
        if tasks in (None, "all", ["all"]):
            return list(TASKS)
        return [get_task(t).name for t in tasks]

    def sample_ids(self, task: str, length: int) -> list[str]:
        """The ids :meth:`samples` will give, without building the prompts."""
        return [f"{self.seed}-{i}" for i in range(self.n)]

    def samples(self, task: str, length: int) -> list[dict]:
        """The prompts of one task at one context length, in the runner's sample format."""
        out = []
        for s in make_ruler_samples(self.tokenizer, task, length, self.n, seed=self.seed, chat=self.chat):
            extra = {k: s[k] for k in _EXTRA_KEYS if k in s}
            extra["target_prompt_tokens"] = s["target_prompt_tokens"]
            out.append(
                {
                    "id": s["id"],
                    "input_ids": s["input_ids"],
                    "outputs": s["outputs"],
                    "max_new_tokens": s["max_new_tokens"],
                    "metric": s["metric"],
                    "extra": extra,
                }
            )
        return out

    def score(self, task: str, sample: dict, prediction: str) -> float:
        """RULER's metric of one sample, 0..100 (the published score is the mean over samples)."""
        one = string_match_part_one if sample["metric"] == "string_match_part" else string_match_all_one
        return 100.0 * one(ruler_postprocess(prediction), sample["outputs"])

    def info(self, tasks: list[str]) -> dict:
        """Metadata for the results header: tasks, settings, left-out tasks and the essay haystack's identity."""
        info = {
            "suite": "ruler",
            "source": "RULER (Hsieh et al., 2024), task definitions from NVIDIA/RULER scripts/synthetic.yaml",
            "tasks": {t: {"max_new_tokens": TASKS[t].max_new_tokens, "metric": TASKS[t].metric} for t in tasks},
            "not_built": dict(NOT_BUILT),
            "samples": self.n,
            "seed": self.seed,
            "chat": self.chat,
        }
        if any(TASKS[t].haystack == "essay" for t in tasks):
            from .haystacks import essay_info

            info["essay_haystack"] = essay_info()
        return info
