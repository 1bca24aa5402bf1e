"""kvswap backend for the ACME accelerator (an example; the device is simulated).

Registered through the entry point ``acme = "kvswap_acme"`` in the group
``kvswap.backends``. It implements three of kvswap's hooks:

* ``kvswap_detect_platform`` -- announce the ``acme`` platform for ``acme`` / ``acme:0``;
* ``kvswap_register_copy_impls`` -- offer ``acme.copy`` on that platform;
* ``kvswap_register_calibrations`` -- defaults the resolver ranks routes by until the
  device is calibrated.

It does not implement ``kvswap_host_address_translator``: ACME has no kernel routes, and
its DMA engine takes host addresses as they are.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from kvswap import (
    BindContext,
    Calibration,
    CopyImpl,
    Curve,
    DeviceInfo,
    Direction,
    DriverError,
    hookimpl,
)

from . import dma

__version__ = "0.1.0"
PLATFORM = "acme"
DEVICES = ("acme", "acme:0")  # the simulator has one device
DISABLE_ENV = "ACME_DMA_DISABLED"


def availability(device: DeviceInfo) -> Optional[str]:
    """None when the DMA engine can be used, else why not (shown by ``kvswap info``)."""
    if os.environ.get(DISABLE_ENV):
        return f"the ACME DMA engine is disabled ({DISABLE_ENV} is set)"
    return None


def bind(ctx: BindContext) -> Callable[..., None]:
    """The factory: called once per resolve; returns the per-transfer callable."""

    def copy(src: Any, dst: Any, sizes: Any, stream: Any) -> None:
        # kvswap has already checked the batch against the constraints declared below, so
        # a refusal here is the runtime's own, and becomes a kvswap DriverError.
        try:
            dma.batch_copy(src, dst, sizes)
        except dma.AcmeError as e:
            raise DriverError("acme.batch_copy", 1, "ACME_ERROR_INVALID_DESCRIPTOR", str(e), e.index) from e

    copy.note = f"simulated DMA engine ({ctx.direction})"  # shown by SwapFn.explain()
    return copy


ACME_COPY = CopyImpl(
    name="acme.copy",
    kind="batch",
    platforms=(PLATFORM,),
    directions=(Direction.H2D, Direction.D2H),
    factory=bind,
    availability=availability,
    alignment=dma.ALIGNMENT,
    min_block_bytes=dma.ALIGNMENT,
    max_block_bytes=dma.MAX_DESCRIPTOR_BYTES,
    description="ACME DMA engine batch copy (simulated in host memory)",
)


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
        curves=tuple(Curve("acme.copy", d, ((4096, 2.0), (65536, 6.0), (1 << 20, 8.0))) for d in Direction),
        calibrated=False,
    ))
