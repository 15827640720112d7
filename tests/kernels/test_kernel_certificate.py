"""The one-launch record of a decode step's certificate gives the torch code's buffers (``record_step_reference``)
over sequences of steps of every source, with and without the per-sequence buffer, up to float32 rounding of the
sigmoid (its float32 result differs by an ulp between implementations) and float64 rounding of the sums. Runs where
Triton can run: on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch

from hf_offload.cache.stats import LayerStats
from hf_offload.kernels import certificate

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.triton


def _step(g, batch, heads, k, group):
    keep = torch.rand(batch, heads, k, generator=g) > 0.3
    tail = torch.randn(batch, 8, group, generator=g) * 3
    sel = torch.randn(batch, 8, group, generator=g) * 3
    return keep.to(DEVICE), tail.to(DEVICE), sel.to(DEVICE)


@pytest.mark.parametrize("batch,heads,k,group", [(1, 1, 160, 4), (3, 8, 7, 2), (33, 1, 5000, 1)])
@pytest.mark.parametrize("rows", [True, False])
def test_record_step_kernel_matches_the_torch_code(batch, heads, k, group, rows):
    assert certificate.record_step_supported(DEVICE, batch, 8 * group)
    g = torch.Generator().manual_seed(batch * 31 + k)
    kernel, reference = LayerStats(), LayerStats()
    for stats in (kernel, reference):
        stats.prepare_capture(DEVICE, batch if rows else None)
    sources = ["tail", "scores", "exact", None, "tail", "tail", "scores", "exact"]
    for step, source in enumerate(sources):
        keep, tail, sel = _step(g, batch, heads, k, group)
        if source == "tail":
            kernel.record_step(keep, None, source, tail_lse=tail, selection_lse=sel)
            missed = torch.sigmoid(tail - sel).mean(dim=(1, 2), dtype=torch.float64)
        else:
            missed = torch.rand(batch, generator=g, dtype=torch.float64).to(DEVICE) if source == "scores" else None
            kernel.record_step(keep, missed, source)
        reference.record_step_reference(keep, missed, source)
        torch.testing.assert_close(kernel._steps, reference._steps, rtol=1e-6, atol=1e-9, msg=f"step {step}")
        if rows:
            torch.testing.assert_close(kernel._rows, reference._rows, rtol=1e-6, atol=1e-9, msg=f"step {step}")
    summary = kernel.step_summary()
    assert summary["missed_steps"] == 7 and summary["tail_steps"] == 3 and summary["exact_steps"] == 2
    assert summary["kept_steps"] == len(sources) and 0 < summary["missed_max"] < 1
    if rows:
        assert summary["rows_missed_steps"] == [7.0] * batch


def test_record_step_kernel_limits():
    assert not certificate.record_step_supported(DEVICE, certificate.MAX_ELEMENTS + 1, 1)
    assert not certificate.record_step_supported(DEVICE, 1024, 32)
    assert not certificate.record_step_supported(torch.device("meta"), 1, 1)


def test_without_the_kernel_a_step_records_through_the_torch_code(monkeypatch):
    """Where the kernel cannot run (here: forced off), the share comes from the log-sum-exps in torch."""
    monkeypatch.setattr(certificate, "record_step_supported", lambda *args: False)
    g = torch.Generator().manual_seed(3)
    keep, tail, sel = _step(g, 2, 1, 9, 2)
    stats, reference = LayerStats(), LayerStats()
    stats.record_step(keep, None, "tail", tail_lse=tail, selection_lse=sel)
    reference.record_step_reference(keep, torch.sigmoid(tail - sel).mean(dim=(1, 2), dtype=torch.float64), "tail")
    assert torch.equal(stats._steps, reference._steps) and torch.equal(stats._rows, reference._rows)
