"""Compute kernels. Each fused kernel has a pure-torch reference beside it, used on CPU and in tests."""

from .attention_ref import OnlineSoftmax

__all__ = ["OnlineSoftmax"]
