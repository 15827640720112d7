"""Where KV bytes live: the host block pool and the device slot pool (a disk tier comes later)."""

from .device import DeviceSlotPool
from .host import DeviceAdmission, HostBlockPool, HostMemoryBudget

__all__ = ["DeviceAdmission", "DeviceSlotPool", "HostBlockPool", "HostMemoryBudget"]
