"""Where KV bytes live: the host block pool, the device slot pool and the disk tier (:mod:`.disk`)."""

from .device import DeviceSlotPool
from .host import DeviceAdmission, HostBlockPool, HostMemoryBudget

__all__ = ["DeviceAdmission", "DeviceSlotPool", "HostBlockPool", "HostMemoryBudget"]
