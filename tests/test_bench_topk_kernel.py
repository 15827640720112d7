"""benchmarks/bench_topk_kernel.py: its shapes and what it does without CUDA (the timing itself needs CUDA)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_topk_kernel


def test_shapes_parse_and_bad_ones_say_the_form():
    assert bench_topk_kernel.parse_shape("12x4096:108:432") == (12, 4096, 108, 432)
    assert [bench_topk_kernel.parse_shape(s)[1] for s in bench_topk_kernel.DEFAULT_SHAPES] == [4096] * 2 + [8192] * 2
    for bad in ("12x4096:108", "12-4096:1:2", "ax4096:1:2"):
        with pytest.raises(ValueError, match="BATCHxN:K:RANKED"):
            bench_topk_kernel.parse_shape(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without CUDA")
def test_without_cuda_nothing_is_measured_or_written(tmp_path, capsys):
    out = tmp_path / "topk.json"
    assert bench_topk_kernel.main(["--out", str(out)]) == 1
    assert bench_topk_kernel.NO_CUDA in capsys.readouterr().out and not out.exists()
