"""The host reference backend (``host.reference``): copies between host addresses.

It is what ``resolve()`` returns on a machine without an accelerator, and the oracle the
other backends' tests compare against, so it is deliberately plain: each descriptor is one
``memmove``. Like every implementation it is handed only batches that core has validated
(:func:`kvswap.addressing.descriptors.validate`: no overlapping destinations, no null or overflowing
ranges). It is a built-in plugin, registered by core like any other.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

from .. import hookimpl
from ..types import DeviceInfo, Direction
from .impl import BindContext, CopyImpl
from .thresholds import Calibration

NAME = "host.reference"


def host_copy(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any = None) -> None:
    """Copy ``sizes[i]`` bytes from address ``src[i]`` to ``dst[i]`` for every i, of a
    batch :func:`kvswap.addressing.descriptors.validate` has accepted."""
    memmove = ctypes.memmove
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        memmove(d, s, n)


def _factory(ctx: BindContext) -> Callable[..., None]:
    return host_copy


REFERENCE = CopyImpl(
    name=NAME,
    kind="batch",
    platforms=("cpu",),
    directions=(Direction.H2D, Direction.D2H, Direction.D2D),
    factory=_factory,
    description="host memmove per descriptor; the oracle for every other backend",
)


@hookimpl
def kvswap_register_calibrations(device: DeviceInfo, register: Callable[[Calibration], None]) -> None:
    if device.platform == "cpu":
        register(Calibration(
            source="host reference defaults (one route on a CPU; no bandwidth predicted)",
            platform="cpu",
            calibrated=False,
        ))


@hookimpl
def kvswap_register_copy_impls(platform: str, register: Callable[[CopyImpl], None]) -> None:
    if platform in REFERENCE.platforms:
        register(REFERENCE)
