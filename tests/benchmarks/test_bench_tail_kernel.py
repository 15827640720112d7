"""benchmarks/bench_tail_kernel.py: a tiny shape end to end where the kernel runs (CUDA, or the CPU interpreter)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import bench_tail_kernel
from hf_offload.kernels.gather import kernels_available

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.triton
def test_tiny_run_checks_the_kernel_and_writes_json(tmp_path):
    out = tmp_path / "tail.json"
    assert bench_tail_kernel.main(["--batch", "2", "--kv-heads", "2", "--group", "3", "--blocks", "24",
                                   "--selected", "5", "--tokens", "8", "--head-dim", "64", "--bits", "2,2", "4,2",
                                   "--blocks-per-program", "4", "16", "--num-warps", "2", "--num-stages", "2",
                                   "--calls", "1", "--reps", "1", "--warmup", "0",
                                   "--out", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert [(r["key_bits"], r["value_bits"]) for r in data["results"]] == [(2, 2), (4, 2)]
    for r in data["results"]:
        assert set(r["kernel"]) == {"dot/4", "dot/16", "dot/16/w2", "dot/16/s2", "dot-ieee/16", "loop/16"}
        for k in r["kernel"].values():  # TF32 products (on CUDA) are close, not exact
            assert k["max_error"] < (2e-2 if k["precision"] == "tf32" else 1e-3)
            assert k["us"] > 0 and k["partials_us"] > 0


@pytest.mark.skipif(kernels_available(DEVICE), reason="checks the message without Triton; Triton runs here")
def test_without_the_kernel_it_says_so():
    assert bench_tail_kernel.main(["--blocks", "8"]) == 2


@pytest.mark.triton
def test_near_blocks_through_an_index_and_the_tensor_core_kernel(tmp_path):
    """``--near``: the bounded estimate's shape (blocks read through an index); on a GPU of compute capability 9.0+
    the tensor-core kernel is timed too, its default first and last."""
    out = tmp_path / "tail.json"
    assert bench_tail_kernel.main(["--batch", "2", "--kv-heads", "2", "--group", "4", "--blocks", "40", "--near", "9",
                                   "--tokens", "16", "--head-dim", "64", "--bits", "4,2", "--blocks-per-program",
                                   "16", "--num-warps", "--num-stages", "--mma-warps", "2", "--mma-blocks-per-warp",
                                   "8", "--mma-stages", "0", "--calls", "1", "--reps", "1", "--warmup", "0",
                                   "--out", str(out)]) == 0  # fmt: skip
    (r,) = json.loads(out.read_text())["results"]
    mma = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    want = {"dot/16", "dot-ieee/16", "loop/16"}
    if mma:
        want |= {"mma/16/w4", "mma/16/w2", "mma/8/w4", "mma/16/w4/s0", "mma/16/w4/again"}
    assert set(r["kernel"]) == want
    for k in r["kernel"].values():
        assert k["max_error"] < (5e-2 if k["precision"] in ("tf32", "bf16") else 1e-3)
        assert k["us"] > 0 and k["partials_us"] > 0
