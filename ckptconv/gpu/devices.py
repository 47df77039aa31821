"""Where tensors can go: the GPUs this process sees, and which one to load onto.

torch numbers GPUs logically: ``cuda:0`` is the first device listed in
``CUDA_VISIBLE_DEVICES`` (or the first physical GPU when it is unset). With
``CUDA_VISIBLE_DEVICES=2,3``, ``cuda:0`` is physical GPU 2 and ``cuda:1`` is
physical GPU 3; ``nvidia-smi`` shows physical numbers. :func:`visible_devices`
reports both.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceInfo", "pick_device", "visible_devices"]


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU as this process sees it.

    Attributes:
        name: torch's logical name (``"cuda:0"``).
        physical: the entry of ``CUDA_VISIBLE_DEVICES`` it corresponds to (an index or
            a UUID), or its index when the variable is unset.
        model: the GPU's product name.
        free_bytes: memory free now.
        total_bytes: memory in all.
        pci_bus_id: where it sits, for matching with nvidia-smi (may be empty).
    """

    name: str
    physical: str
    model: str
    free_bytes: int
    total_bytes: int
    pci_bus_id: str = ""


def visible_devices() -> list[DeviceInfo]:
    """The GPUs this process can use, with their free memory; empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    visible = [entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    devices = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        properties: Any = torch.cuda.get_device_properties(index)
        bus = ""
        if hasattr(properties, "pci_bus_id"):
            bus = (
                f"{getattr(properties, 'pci_domain_id', 0):04x}:{properties.pci_bus_id:02x}:"
                f"{getattr(properties, 'pci_device_id', 0):02x}"
            )
        physical = visible[index] if index < len(visible) else str(index)
        devices.append(DeviceInfo(f"cuda:{index}", physical, properties.name, int(free), int(total), bus))
    return devices


class DeviceFallbackWarning(UserWarning):
    """``device="auto"`` found no usable GPU and loads on the CPU."""


def pick_device(device: Any) -> Any:
    """Resolve ``"auto"`` to the visible GPU with the most free memory, or the CPU.

    Anything else is returned unchanged. Falling back to the CPU emits a
    :class:`DeviceFallbackWarning` so the choice is never silent.
    """
    if device != "auto":
        return device
    try:
        devices = visible_devices()
    except Exception as error:  # a broken driver must not stop a CPU load
        warnings.warn(f"no usable GPU ({error}); loading on the CPU", DeviceFallbackWarning, stacklevel=3)
        return "cpu"
    if not devices:
        warnings.warn("no usable GPU; loading on the CPU", DeviceFallbackWarning, stacklevel=3)
        return "cpu"
    return max(devices, key=lambda info: info.free_bytes).name
