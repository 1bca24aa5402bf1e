"""Calibrations the CUDA backend ships for GPUs it has numbers for, and for the rest.

A measured profile of the device (``kvswap calibrate``) overrides all of these. Curves name
``cuda.batch`` (this backend) and ``triton.kernel`` (the Triton backend), in GB/s (1e9 B/s).
"""
from __future__ import annotations

from kvswap.registry.thresholds import Calibration, Curve
from kvswap.types import DeviceInfo, Direction

KiB = 1024
H2D, D2H = Direction.H2D, Direction.D2H
BATCH, KERNEL = "cuda.batch", "triton.kernel"

# --- NVIDIA H200, PCIe Gen5 x16 -------------------------------------------------------
# Measured on an H200 (driver 580.159.04 / CUDA 13.0, torch 2.11+cu130, triton 3.6),
# N=10000 scattered blocks in >= 1 GiB pools, CUDA events, each transfer timed from an
# idle stream (docs/benchmarks.md has the commands). Batch copy: h2d in ANY source order,
# d2h in STREAM order; `kvswap calibrate` reproduces them (h2d 4 KiB 3.1, 16 KiB 6.2,
# 24 KiB 6.4, 32 KiB 31.9). Timed back to back instead, the batch call looks 1.4-6x faster
# at small blocks, because the previous copy hides its host work: an engine's one
# transfer per step does not.
H200_SOURCE = (
    "cuda defaults: NVIDIA H200 on PCIe Gen5 x16, measured "
    "(driver 580.159.04 / CUDA 13.0; N=10000 scattered blocks; docs/benchmarks.md)"
)
_H200_BATCH = {
    H2D: ((4, 4.1), (8, 5.4), (16, 6.6), (24, 6.4), (32, 36.3), (64, 44.5), (128, 48.8)),
    D2H: ((4, 9.6), (8, 17.5), (16, 23.5), (32, 34.5), (64, 42.5)),
}
# triton.kernel (multi-block tiles) at 2, 4 and 8 SMs.
_H200_KERNEL = {
    (H2D, 2): ((4, 36.9), (8, 37.7), (16, 46.2), (32, 49.9), (64, 50.8), (128, 51.0)),
    (H2D, 4): ((4, 49.9), (8, 50.6), (16, 51.0), (32, 51.2), (64, 51.4), (128, 51.4)),
    (H2D, 8): ((4, 49.8), (8, 50.7), (16, 51.1), (32, 51.2), (64, 51.3), (128, 51.4)),
    (D2H, 2): ((4, 44.0), (8, 48.3), (16, 52.2), (32, 52.3), (64, 52.5), (128, 52.6)),
    (D2H, 4): ((4, 51.1), (8, 52.0), (16, 52.2), (32, 52.4), (64, 52.5), (128, 52.6)),
    (D2H, 8): ((4, 51.4), (8, 52.0), (16, 52.3), (32, 52.5), (64, 52.6), (128, 52.7)),
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
    # The kernel is within 3% of its best on 4 SMs in both directions (table above).
    kernel_sms={H2D: 4, D2H: 4},
    # A kernel launch costs more host time than one batch call
    # (tests/bench/bench_swapfn_overhead.py), so short batches stay on the copy engine;
    # `kvswap calibrate` fits this per block size (16-1024 on the same machine).
    kernel_min_batch={H2D: 64, D2H: 64},
    # Compute throughput lost while a BlockMover job runs beside bf16 GEMMs started together
    # with it (H200, calibration/step_interference.py): the kernel on 4 SMs 29% (h2d) and
    # 62% (d2h), the batch route 20% (h2d, 16 KiB blocks) and under 1% (d2h). One figure per
    # kind; a calibrated profile's slowdown_by_sms replaces it.
    slowdown={BATCH: 0.01, KERNEL: 0.60},
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
        for d in (H2D, D2H)
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
    "(shape of the H200's batch cliff, kernel discounted)"
)
UNKNOWN = Calibration(
    source=UNKNOWN_SOURCE,
    platform="cuda",
    scope="platform",
    curves=tuple(
        c
        for d in (H2D, D2H)
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
