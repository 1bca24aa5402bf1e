"""kvswap backend for the ACME accelerator (an example; the device is simulated).

Registered through the entry point ``acme = "kvswap_acme"`` in the group
``kvswap.backends``. It implements three of kvswap's hooks:

* ``kvswap_detect_platform`` -- announce the ``acme`` platform for ``acme`` / ``acme:0``;
* ``kvswap_register_copy_impls`` -- offer ``acme.copy`` on that platform;
* ``kvswap_register_calibrations`` -- defaults the resolver ranks routes by until the
  device is calibrated.

Each implementation lives in a module named for it (``acme.copy`` in :mod:`.copy`), the
simulated runtime in :mod:`.dma`. It does not implement ``kvswap_host_address_translator``:
ACME has no kernel routes, and its DMA engine takes host addresses as they are.
"""
from __future__ import annotations

from typing import Callable, Optional

from kvswap import Calibration, CopyImpl, Curve, DeviceInfo, hookimpl

from .copy import ACME_COPY, PLATFORM

__version__ = "0.1.0"
DEVICES = ("acme", "acme:0")  # the simulator has one device


@hookimpl
def kvswap_detect_platform(device: Optional[str]) -> Optional[DeviceInfo]:
    if device not in DEVICES:
        return None  # not ours: never claim the default device or another platform's
    return DeviceInfo(
        platform=PLATFORM,
        name="ACME Simulated Accelerator",
        identity="acme-sim-1",
        compute_units=1,
        index=0,
        arch="acme1",
        driver_version=__version__,
        link="simulated",
        # Its memory is host memory: tools that allocate buffers for it use torch's CPU.
        details={"torch_type": "cpu"},
    )


@hookimpl
def kvswap_register_copy_impls(platform: str, register: Callable[[CopyImpl], None]) -> None:
    if platform == PLATFORM:
        register(ACME_COPY)


@hookimpl
def kvswap_register_calibrations(device: DeviceInfo, register: Callable[[Calibration], None]) -> None:
    if device.platform != PLATFORM:
        return
    register(Calibration(
        source="kvswap-acme defaults (illustrative numbers, not measured)",
        platform=PLATFORM,
        scope="platform",
        curves=tuple(Curve("acme.copy", d, ((4096, 2.0), (65536, 6.0), (1 << 20, 8.0))) for d in ACME_COPY.directions),
        calibrated=False,
    ))
