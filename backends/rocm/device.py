"""What a ROCm device is: its :class:`~kvswap.DeviceInfo`."""
from __future__ import annotations

import re
from typing import Callable, Optional

from kvswap.errors import DeviceNotFoundError
from kvswap.types import DeviceInfo, slug

from .hip import HipApi

_SPEC = re.compile(r"^([a-z_]+)(?::(\d+))?$")


def _index(spec: Optional[str], current: int, count: int) -> Optional[int]:
    """The device index ``spec`` names, or None if it is not a torch ``cuda`` device
    (torch on ROCm calls HIP devices ``cuda``)."""
    if spec is None:
        return current
    m = _SPEC.match(spec)
    if not m or m.group(1) != "cuda":
        return None
    index = current if m.group(2) is None else int(m.group(2))
    if not 0 <= index < count:
        raise DeviceNotFoundError(f"device={spec!r}: torch sees {count} ROCm device(s), 0..{count - 1}")
    return index


def detect(spec: Optional[str], hip: Callable[[], HipApi]) -> Optional[DeviceInfo]:
    """Describe the ROCm device ``spec`` names, or None when torch is not a ROCm build,
    sees no device, or ``spec`` is not a ``cuda`` device.

    The identity key is the product name, the base gfx architecture (feature suffixes
    such as ``:xnack-`` depend on boot settings, not on the device) and the CU count;
    never the bus id, so a profile follows the kind of device, not its slot.
    """
    import torch

    if not getattr(torch.version, "hip", None) or not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if count < 1:
        return None
    index = _index(spec, torch.cuda.current_device(), count)
    if index is None:
        return None
    p = torch.cuda.get_device_properties(index)
    gcn = str(getattr(p, "gcnArchName", "") or "unknown")
    base = gcn.split(":", 1)[0]
    details = {"torch_type": "cuda", "source": "kvswap.backends.rocm", "gcn_arch": gcn,
               "torch_hip": str(torch.version.hip)}
    runtime, driver = str(torch.version.hip), "unknown"
    try:
        api = hip()
        runtime = str(api.runtime_version())
        driver = str(api.driver_version() or "unknown")
        details["hip_library"] = api.origin
    except Exception as e:  # HipUnavailable, DriverError: describe the device even so
        details["hip_error"] = str(e)
    bus = "unknown"
    if getattr(p, "pci_bus_id", None) is not None:
        bus = f"{getattr(p, 'pci_domain_id', 0):04x}:{p.pci_bus_id:02x}:{getattr(p, 'pci_device_id', 0):02x}"
    name = p.name or base
    return DeviceInfo(
        platform="rocm",
        name=name,
        identity=slug(f"rocm-{name}-{base}-{p.multi_processor_count}cu"),
        compute_units=int(p.multi_processor_count),
        index=index,
        arch=gcn,
        driver_version=driver,
        runtime_version=runtime,
        pci_bus_id=bus,
        details=details,
    )
