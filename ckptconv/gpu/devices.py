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

from ckptconv.errors import DeviceError
from ckptconv.runtime.extras import require_torch

__all__ = ["DEVICE_SPELLINGS", "DeviceInfo", "pick_device", "visible_devices"]

# What ckptconv.load(device=...) takes, as its errors list them; load_into also takes "model".
DEVICE_SPELLINGS = (
    '"cpu" (or None)',
    '"cuda" (the current GPU)',
    '"cuda:N" (GPU N)',
    '"auto" (the GPU with the most free memory, else the CPU)',
)
MODEL_SPELLING = '"model" (each tensor onto the device of the parameter or buffer it fills)'


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
    """The GPUs this process can use, with their free memory; empty without CUDA.

    Raises:
        MissingDependencyError: torch is not installed.
    """
    require_torch("listing GPUs")
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


def pick_device(device: Any, *, model: bool = False) -> Any:
    """Resolve ``"auto"`` to the visible GPU with the most free memory, or the CPU; check any other device.

    Falling back to the CPU emits a :class:`DeviceFallbackWarning` so the choice is never silent.
    Other devices are returned unchanged once torch parses them and, for a GPU, sees it.

    Args:
        device: see :data:`DEVICE_SPELLINGS` (a ``torch.device`` too).
        model: ``"model"`` is taken too (:func:`ckptconv.load_into`); it is returned unchanged.

    Raises:
        DeviceError: a spelling ckptconv does not take (``"best"``, ``"gpu"``, ``"meta"``), or a GPU this
            process does not have; the message lists the spellings.
    """
    if device is None or (model and device == "model"):
        return device
    if device != "auto":
        return _checked(device, model=model)
    try:
        devices = visible_devices()
    except Exception as error:  # a broken driver must not stop a CPU load
        warnings.warn(f"no usable GPU ({error}); loading on the CPU", DeviceFallbackWarning, stacklevel=3)
        return "cpu"
    if not devices:
        warnings.warn("no usable GPU; loading on the CPU", DeviceFallbackWarning, stacklevel=3)
        return "cpu"
    return max(devices, key=lambda info: info.free_bytes).name


def _spellings(model: bool) -> str:
    spellings = [*DEVICE_SPELLINGS, MODEL_SPELLING] if model else list(DEVICE_SPELLINGS)
    return ", ".join(spellings[:-1]) + " or " + spellings[-1]


def _checked(device: Any, *, model: bool) -> Any:
    """``device`` itself, if torch parses it as the CPU or a GPU it sees; else a DeviceError."""
    require_torch("loading onto a device")
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise DeviceError(f"ckptconv cannot load onto device {device!r}; pass {_spellings(model)}")
    if parsed.type == "cpu":
        return device
    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise DeviceError(
            f'device {device!r} needs a GPU, and this process has none ({build}); pass "cpu", '
            f'or "auto" to use a GPU only where there is one'
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise DeviceError(
            f"device {device!r} does not exist: this process sees {count} GPU{'s' if count != 1 else ''} "
            f'(cuda:0 to cuda:{count - 1}); pass one of them, or "auto"'
        )
    return device
