"""Calibrations the CUDA backend ships for GPUs it has numbers for, and for the rest.

A measured profile of the device (``kvswap calibrate``) overrides all of these. Curves name
``cuda.batch`` (this backend) and ``triton.kernel`` (the Triton backend), in GB/s (1e9 B/s).
"""
from __future__ import annotations

from kvswap.thresholds import Calibration, Curve
from kvswap.types import DeviceInfo, Direction

KiB = 1024
H2D, D2H = Direction.H2D, Direction.D2H
BATCH, KERNEL = "cuda.batch", "triton.kernel"

# --- NVIDIA H200, PCIe Gen5 x16 -------------------------------------------------------
# Measured on the lent GPU machine (driver 580.159.04 / CUDA 13.0, torch 2.11+cu130,
# triton 3.6): N scattered blocks in 1 GiB pools, median of 10, CUDA events; FACTS.md.
# Batch h2d is the ANY column (what cuda.batch uses for a host source), d2h the STREAM one.
H200_SOURCE = (
    "cuda defaults: NVIDIA H200 on PCIe Gen5 x16, measured on the lent GPU machine "
    "(driver 580.159.04 / CUDA 13.0; FACTS.md, N=10000 scattered blocks, 128 KiB at N=1000)"
)
_H200_BATCH = {
    H2D: ((4, 4.1), (8, 5.4), (16, 6.6), (24, 6.4), (32, 36.3), (64, 44.5), (128, 48.8)),
    D2H: ((4, 9.6), (8, 17.5), (16, 23.5), (32, 34.5), (64, 42.5)),
}
# The 1-block-per-step kernel at 12 and 32 SMs.
_H200_KERNEL = {
    (H2D, 12): ((4, 23.6), (8, 39.0), (16, 44.6), (24, 47.3), (32, 48.4), (64, 50.2), (128, 50.6)),
    (H2D, 32): ((4, 50.2), (8, 50.9), (16, 51.2), (24, 51.3), (32, 51.3), (64, 51.3), (128, 51.0)),
    (D2H, 12): ((4, 50.7), (8, 51.9), (16, 52.3), (32, 52.5), (64, 52.6)),
    (D2H, 32): ((4, 51.4), (8, 52.1), (16, 52.4), (32, 52.5), (64, 52.6)),
    # A kernel copying several whole blocks per step (2-D tile, 8 warps): 4 KiB h2d only.
    # Larger blocks only put more bytes in flight per step, so the 4 KiB rate is held flat.
    (H2D, 2): ((4, 45.0),),
    (H2D, 4): ((4, 50.5),),
}


def _curves(table: dict, impl: str) -> tuple[Curve, ...]:
    out = []
    for key, points in table.items():
        direction, sms = key if isinstance(key, tuple) else (key, None)
        out.append(Curve(impl, direction, tuple((kib * KiB, g) for kib, g in points), num_sms=sms))
    return tuple(out)


H200 = Calibration(
    source=H200_SOURCE,
    platform="cuda",
    scope="family",
    curves=_curves(_H200_BATCH, BATCH) + _curves(_H200_KERNEL, KERNEL),
    # h2d: the tiled kernel is within 10% of the ceiling on 4 SMs; d2h was measured with
    # the 1-block kernel only, which is at 92% of the ceiling on 12.
    kernel_sms={H2D: 4, D2H: 12},
    # Not measured on the H200: the published H100 minimum batch (below), carried over.
    kernel_min_batch={H2D: 16, D2H: 16},
    # Beside a bf16 GEMM: small-block batch DMA cost 2-4% (d2h) to 16-20% (h2d), a copy
    # kernel on 4 SMs 18% (h2d) to 33% (d2h); these are the middles.
    slowdown={BATCH: 0.10, KERNEL: 0.25},
    ceiling_gbps={H2D: 55.5, D2H: 55.4},
    calibrated=True,
)

# --- NVIDIA H100, PCIe Gen5 ---------------------------------------------------------------
# Published with the original Triton fast path: a kernel on 12 SMs below 28 KiB, the batch
# API from 28 KiB, the kernel only for batches of at least 16. Only the thresholds are
# public, so the curves are shaped to cross exactly at 28 KiB; their GB/s are not data.
H100_SOURCE = (
    "cuda defaults: NVIDIA H100 PCIe Gen5 thresholds published with the original Triton fast path "
    "(kernel below 28 KiB on 12 SMs, batches >= 16); curves shaped to cross at 28 KiB, GB/s not measured"
)
H100 = Calibration(
    source=H100_SOURCE,
    platform="cuda",
    scope="family",
    curves=tuple(
        c
        for d in Direction
        for c in (
            Curve(BATCH, d, ((4 * KiB, 4.0), (28 * KiB, 24.0), (64 * KiB, 40.0), (256 * KiB, 48.0))),
            Curve(KERNEL, d, ((4 * KiB, 24.0), (256 * KiB, 24.0)), num_sms=12),
        )
    ),
    kernel_sms={H2D: 12, D2H: 12},
    kernel_min_batch={H2D: 16, D2H: 16},
    calibrated=False,
)

# --- any other NVIDIA GPU -------------------------------------------------------------------
# A guess that says it is one. Every NVIDIA part we know of shows the batch API's
# small-block cliff (H200: 4-24 KiB at 4-7 GB/s h2d), but the link may be narrower and the
# kernel slower than on an H200, so the kernel is assumed to reach 20-24 GB/s on 8 SMs
# (the H200's 1-block kernel on 8 SMs: 15 GB/s at 4 KiB) and the batch API 40 GB/s at
# 256 KiB: the kernel is chosen only well inside the cliff (below ~32 KiB).
UNKNOWN_SOURCE = (
    "cuda defaults: conservative guess for an NVIDIA GPU without measurements "
    "(shape of the H200's batch cliff, kernel discounted; FACTS.md)"
)
UNKNOWN = Calibration(
    source=UNKNOWN_SOURCE,
    platform="cuda",
    scope="platform",
    curves=tuple(
        c
        for d in Direction
        for c in (
            Curve(BATCH, d, ((4 * KiB, 3.5), (16 * KiB, 6.0), (32 * KiB, 22.0), (64 * KiB, 32.0), (256 * KiB, 40.0))),
            Curve(KERNEL, d, ((4 * KiB, 15.0), (16 * KiB, 20.0), (64 * KiB, 24.0), (256 * KiB, 24.0)), num_sms=8),
        )
    ),
    kernel_sms={H2D: 8, D2H: 8},
    kernel_min_batch={H2D: 16, D2H: 16},
    slowdown={BATCH: 0.10, KERNEL: 0.25},
    calibrated=False,
)

# Family calibrations by a word of the device name, most specific first.
FAMILIES = (("H200", H200), ("H100", H100))


def calibrations_for(device: DeviceInfo) -> list[Calibration]:
    """The calibrations that apply to ``device``: its family's, if known, and the default."""
    if device.platform != "cuda":
        return []
    words = set(device.name.upper().replace("-", " ").split())
    family = [cal for word, cal in FAMILIES if word in words]
    return family[:1] + [UNKNOWN]
