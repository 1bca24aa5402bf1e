"""The host reference backend (``host.reference``): copies between host addresses.

It is what ``resolve()`` returns on a machine without an accelerator, and the oracle the
other backends' tests compare against, so it is deliberately plain: every destination
range is checked against every other before the first byte moves, then each descriptor is
one ``memmove``. It is a built-in plugin, registered by core like any other.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

import numpy as np

from . import hookimpl
from .descriptors import first_overlap
from .errors import InvalidTransferError
from .impl import BindContext, CopyImpl
from .thresholds import Calibration
from .types import DeviceInfo, Direction

NAME = "host.reference"


def host_copy(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any = None) -> None:
    """Copy ``sizes[i]`` bytes from address ``src[i]`` to ``dst[i]`` for every i.

    Raises :class:`InvalidTransferError`, before copying anything, when two destination
    ranges overlap (the result would depend on the order of the copies).
    """
    clash = first_overlap(dst, sizes)
    if clash is not None:
        i, j = clash
        raise InvalidTransferError(f"destination ranges of descriptors {i} and {j} overlap")
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
