"""LongBench and LongBench-E (Bai et al., 2023, https://arxiv.org/abs/2308.14508; THUDM/LongBench, MIT licence):
the published jsonl data read from a folder, zip or URL, the release's prompts, generation lengths, middle truncation
and chat-template rule, and its metrics (:mod:`eval_harness.metrics`).

Example::

    from eval_harness.longbench import LongBenchSuite
    suite = LongBenchSuite(tokenizer, data="LongBench/data", e=True, samples=20)
    samples = suite.samples("qasper", 31500)          # prompts cut in the middle to 31,500 tokens
    suite.score("qasper", samples[0], "unanswerable")     # 0..100
"""

from .config import (
    DATA_URL,
    LONGBENCH_E_TASKS,
    LONGBENCH_TASKS,
    MAX_NEW_TOKENS,
    NO_CHAT_TASKS,
    PROMPTS,
    STOP_AT_NEWLINE_TASKS,
)
from .data import load_records
from .prompts import build_prompt, middle_truncate
from .suite import BUCKETS, LongBenchSuite, length_bucket

__all__ = [
    "BUCKETS",
    "DATA_URL",
    "LONGBENCH_E_TASKS",
    "LONGBENCH_TASKS",
    "MAX_NEW_TOKENS",
    "NO_CHAT_TASKS",
    "PROMPTS",
    "STOP_AT_NEWLINE_TASKS",
    "LongBenchSuite",
    "build_prompt",
    "length_bucket",
    "load_records",
    "middle_truncate",
]
