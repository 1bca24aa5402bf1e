"""The calibration kvswap uses on a ROCm device before ``kvswap calibrate`` measures it.

Guesses, not measurements: kvswap has not run on an AMD GPU. The batch route is preferred
until the device is measured, because it takes no CUs from compute and needs no
host-address mapping: a kernel is credited with half the batch route's guess at every
size, so an uncalibrated device never picks one.

What the batch route is credited with depends on the HIP runtime. On ROCm 7.2.x,
``hipMemcpyBatchAsync`` rejects ``numAttrs > 0`` and, with ``numAttrs == 0``, copies
host<->device through an internal loop of one copy per descriptor (ROCm/clr issue 273):
it is a per-copy loop with a batch call's name, and is credited as one. Attributes are
accepted from HIP 7.13 on, which is taken as the first release with a real batch path.
"""
from __future__ import annotations

import re
from typing import Optional

from kvswap.registry.thresholds import Calibration, Curve
from kvswap.types import DeviceInfo, Direction

KiB = 1024
SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1024 * KiB)
# The first HIP runtime whose batch call is taken to batch (ROCm/clr issue 273).
BATCH_FIXED_IN = (7, 13)
# A batch path: the copy engine's small-block cliff, then most of a PCIe Gen5 x16 link.
BATCH_GUESS = (6.0, 12.0, 30.0, 40.0, 45.0)
# A per-copy loop: each descriptor pays a fixed runtime cost before its bytes move. Modelled
# as 3 us a copy plus the bytes at 45 GB/s, i.e. size / (3 us + size / 45 GB/s).
PER_COPY_US, LINK_GBPS = 3.0, 45.0
PER_COPY_GUESS = tuple(round(b / (PER_COPY_US * 1e3 + b / LINK_GBPS), 1) for b in SIZES)
# Compute slowdowns beside a GEMM, guessed from what copies cost a bf16 GEMM on NVIDIA
# parts; `kvswap calibrate --interference` measures them on the device.
SLOWDOWN = {"batch": 0.08, "kernel": 0.25}

SOURCE = "rocm defaults (kvswap.backends.rocm): guesses that prefer rocm.batch; nothing measured on an AMD GPU"
PER_COPY_NOTE = (
    "; HIP {version} runs hipMemcpyBatchAsync as a per-copy loop (ROCm/clr issue 273), "
    "so the batch route is credited as one until HIP {fixed}"
)


def hip_version(text: Optional[str]) -> Optional[tuple[int, int]]:
    """``(major, minor)`` from a HIP version string such as ``"7.2.53211-e6c0f8d"``."""
    m = re.match(r"^\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def batches(version: Optional[tuple[int, int]]) -> bool:
    """Whether ``hipMemcpyBatchAsync`` is taken to batch on HIP ``version`` (unknown: no)."""
    return version is not None and version >= BATCH_FIXED_IN


def calibration_for(device: DeviceInfo) -> Calibration:
    """The defaults for ``device``, by its HIP runtime version."""
    version = hip_version(device.runtime_version)
    guess = BATCH_GUESS if batches(version) else PER_COPY_GUESS
    batch = tuple(zip(SIZES, guess))
    kernel = tuple((b, g / 2) for b, g in batch)
    curves = []
    for d in Direction:
        curves += [
            Curve("rocm.batch", d, batch),
            Curve("*batch", d, batch),
            Curve("*kernel", d, kernel, num_sms=8),
        ]
    source = SOURCE
    if not batches(version):
        shown = "unknown" if version is None else f"{version[0]}.{version[1]}"
        source += PER_COPY_NOTE.format(version=shown, fixed="{}.{}".format(*BATCH_FIXED_IN))
    return Calibration(
        source=source,
        platform="rocm",
        scope="platform",
        curves=tuple(curves),
        kernel_sms={d: 8 for d in Direction},
        kernel_min_batch={d: 64 for d in Direction},
        slowdown=dict(SLOWDOWN),
        calibrated=False,
    )
