"""CUDA kernels compiled at run time (PyTorch's NVRTC wrapper, ``torch.cuda._compile_kernel``), one per set of
``#define`` values, with a fallback that never fails a decode step.

:class:`RuntimeKernel` compiles a kernel's source once per process for each set of compile-time constants and keeps
the result. Where compiling fails (no NVRTC library, an unsupported GPU, a toolkit too old), it warns once per
process, names the fallback that runs instead, and offers the kernel no more; the caller then runs its Triton or
torch code. A failure while a CUDA graph is being captured is not recorded (the capture may be what forbade it).
"""

from __future__ import annotations

import warnings

import torch


class RuntimeKernel:
    """One CUDA kernel compiled at run time for each set of ``#define`` values.

    Args:
        source: the CUDA source; its ``#define`` values come first at compile time.
        name: the ``extern "C" __global__`` function to launch.
        what: what the kernel does, for the warning (e.g. ``"slot assignment"``).
        fallback: what runs where it cannot be compiled, for the warning (e.g. ``"the Triton kernel"``).
        capability: the oldest compute capability it runs on.
    """

    def __init__(self, source: str, name: str, what: str, fallback: str, capability: tuple[int, int] = (8, 0)):
        self.source, self.name, self.what, self.fallback = source, name, what, fallback
        self.capability = capability
        self.compiled: dict[tuple, object] = {}
        self.failed: str | None = None

    def runs_on(self, device: torch.device) -> bool:
        """Whether the kernel may run on ``device``: an NVIDIA GPU of :attr:`capability` or newer, with PyTorch's
        NVRTC wrapper, and no earlier failure to compile."""
        device = torch.device(device)
        if device.type != "cuda" or self.failed is not None:
            return False
        if torch.version.hip is not None or not hasattr(torch.cuda, "_compile_kernel"):
            return False
        return torch.cuda.get_device_capability(device) >= self.capability

    def get(self, **defines: int):
        """The kernel compiled with these ``#define`` values, or ``None`` (with one warning per process) where it
        cannot be compiled."""
        key = tuple(sorted(defines.items()))
        fn = self.compiled.get(key)
        if fn is not None or self.failed is not None:
            return fn
        try:
            header = "".join(f"#define {k} {v}\n" for k, v in key)
            fn = self.compiled[key] = torch.cuda._compile_kernel(header + self.source, self.name)
        except Exception as e:  # reported once; the fallback runs from here on
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():  # the capture may forbid it
                return None
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"hf_offload: the CUDA {self.what} kernel could not be compiled ({self.failed[:300]}); "
                          f"using {self.fallback} instead.", RuntimeWarning, stacklevel=3)  # fmt: skip
        return fn
