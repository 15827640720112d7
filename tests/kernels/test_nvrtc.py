"""The run-time compiled CUDA kernels' bookkeeping (``hf_offload.kernels.nvrtc``), on any machine: one compile per set
of defines, their values in front of the source, and a failure that warns once and offers the kernel no more."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_offload.kernels.nvrtc import RuntimeKernel


def test_compiles_once_per_set_of_defines(monkeypatch):
    calls = []

    def compile_kernel(source, name):
        calls.append((source, name))
        return object()

    monkeypatch.setattr(torch.cuda, "_compile_kernel", compile_kernel, raising=False)
    kernel = RuntimeKernel("extern \"C\" __global__ void f() {}", "f", "test", "the torch code")
    a = kernel.get(THREADS=64, PER=8)
    assert kernel.get(PER=8, THREADS=64) is a  # the same defines in another order: no second compile
    b = kernel.get(THREADS=128, PER=8)
    assert b is not a and len(calls) == 2
    assert calls[0][0].startswith("#define PER 8\n#define THREADS 64\n") and calls[0][1] == "f"
    assert calls[0][0].endswith("void f() {}")


def test_a_failure_warns_once_and_the_kernel_is_not_offered_again(monkeypatch):
    calls = []

    def broken(source, name):
        calls.append(name)
        raise RuntimeError("nvrtc: no library")

    monkeypatch.setattr(torch.cuda, "_compile_kernel", broken, raising=False)
    kernel = RuntimeKernel("", "g", "slot assignment", "the Triton kernel")
    with pytest.warns(RuntimeWarning, match="slot assignment kernel could not be compiled.*no library.*the Triton"):
        assert kernel.get(THREADS=32) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel.get(THREADS=32) is None and kernel.get(THREADS=64) is None
    assert calls == ["g"] and "RuntimeError" in kernel.failed
    assert not kernel.runs_on(torch.device("cpu"))


def test_runs_only_on_cuda():
    kernel = RuntimeKernel("", "h", "test", "the torch code")
    assert not kernel.runs_on(torch.device("cpu")) and not kernel.runs_on("meta")
