"""What a ROCm device is (``DeviceInfo``) and the defaults kvswap uses before it is measured."""
from __future__ import annotations

import re
from typing import Callable, Optional

from kvswap.errors import ConfigurationError
from kvswap.thresholds import Calibration, Curve
from kvswap.types import DeviceInfo, Direction, slug

from .hip import HipApi

_SPEC = re.compile(r"^([a-z_]+)(?::(\d+))?$")
KiB = 1024


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
        raise ConfigurationError(f"device={spec!r}: torch sees {count} ROCm device(s), 0..{count - 1}")
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


# Guesses, not measurements: kvswap has not run on an AMD GPU. The batch route is preferred
# until `kvswap calibrate` measures the device because it takes no CUs from compute and
# needs no host-address mapping; the kernel curve is set to half the batch guess at every
# size so an uncalibrated device never picks a kernel. Slowdowns are the lower ends measured
# beside a bf16 GEMM on an H200 (FACTS.md), the only interference numbers we have.
_SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1024 * KiB)
_BATCH_GUESS = (6.0, 12.0, 30.0, 40.0, 45.0)


def default_calibration() -> Calibration:
    batch = tuple(zip(_SIZES, _BATCH_GUESS))
    kernel = tuple((b, g / 2) for b, g in batch)
    curves = []
    for d in Direction:
        curves += [
            Curve("rocm.batch", d, batch),
            Curve("*batch", d, batch),
            Curve("*kernel", d, kernel, num_sms=8),
        ]
    return Calibration(
        source="rocm defaults (kvswap.backends.rocm): guesses that prefer rocm.batch; nothing measured on an AMD GPU",
        platform="rocm",
        scope="platform",
        curves=tuple(curves),
        kernel_sms={"h2d": 8, "d2h": 8},
        kernel_min_batch={"h2d": 64, "d2h": 64},
        slowdown={"batch": 0.08, "kernel": 0.25},
        calibrated=False,
    )
