"""RULER synthetic tasks (Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?", https://arxiv.org/abs/2404.06654; NVIDIA/RULER, Apache-2.0), generated at any context length in the
model's own tokens. Task settings, templates and numbers follow the paper and its repository; the code is this
project's. ``qa_1`` and ``qa_2`` are not built (:data:`NOT_BUILT` says why).

Example (needs a tokenizer)::

    from transformers import AutoTokenizer
    from eval_harness.ruler import make_ruler_samples
    tok = AutoTokenizer.from_pretrained("Qwen/Qwen2.5-Coder-0.5B-Instruct")
    samples = make_ruler_samples(tok, "niah_multikey_1", length=8192, n=10, seed=0)
    samples[0]["outputs"], len(samples[0]["input_ids"])   # (['5482913'], 8064): 8192 - 128 new tokens
"""

from .suite import RulerSuite
from .tasks import ALL_TASK_NAMES, NOT_BUILT, TASKS, RulerTask, get_task, make_ruler_samples

__all__ = ["ALL_TASK_NAMES", "NOT_BUILT", "TASKS", "RulerSuite", "RulerTask", "get_task", "make_ruler_samples"]
