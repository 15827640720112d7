"""benchmarks/fused_norms_accuracy.py on a small random Llama: both budgets run, the kernel ran in every norm call of
the fused runs, and at the full budget the tokens equal those of transformers' norms. Needs Triton (on the CPU: its
interpreter, ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import fused_norms_accuracy
from hf_offload.kernels.gather import kernels_available

pytestmark = pytest.mark.skipif(not kernels_available(torch.device("cpu")),
                                reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)")  # fmt: skip


def test_random_model_both_budgets(tmp_path):
    out = tmp_path / "acc.json"
    argv = ["--model", "random", "--context", "96", "--prompts", "1", "--steps", "4", "--budgets", "0", "64",
            "--out", str(out)]  # fmt: skip
    assert fused_norms_accuracy.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["exact"] for r in rows] == [True, False]
    assert rows[1]["budget_tokens"] == 64 and rows[0]["budget_tokens"] >= 96 + 4
    for r in rows:
        assert r["kernel_calls"] == 2 * 2 * 4  # two norms in each of two layers, the prefill and three decode steps
        assert r["max_abs_logit_diff"] >= 0 and r["max_rel_logit_diff"] >= 0
    assert rows[0]["same_tokens"] and "dense_same_tokens" in rows[0] and "dense_same_tokens" not in rows[1]
