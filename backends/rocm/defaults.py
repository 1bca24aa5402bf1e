"""The calibration kvswap uses on a ROCm device before ``kvswap calibrate`` measures it."""
from __future__ import annotations

from kvswap.thresholds import Calibration, Curve
from kvswap.types import DeviceInfo, Direction

KiB = 1024

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


def calibration_for(device: DeviceInfo) -> Calibration:
    """The defaults for ``device``."""
    return default_calibration()
