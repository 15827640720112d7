"""Where KV bytes live: the host block pool and the device slot pool (a disk tier comes later)."""

from .device import DeviceSlotPool
from .host import HostBlockPool, HostMemoryBudget

__all__ = ["DeviceSlotPool", "HostBlockPool", "HostMemoryBudget"]
