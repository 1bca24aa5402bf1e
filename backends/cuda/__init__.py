"""kvswap backend ``cuda``: batch copies through the CUDA driver, the CUDA device
description, and thresholds for the NVIDIA GPUs kvswap has numbers for.

Registered through the ``kvswap.backends`` entry point like any vendor's plugin. Importing
it loads no library and initialises no GPU: libcuda is opened on first use, and a machine
without it sees ``cuda.batch`` as unavailable, with the reason.
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional

from kvswap import hookimpl
from kvswap.errors import DriverError, KvSwapWarning
from kvswap.registry.impl import CopyImpl
from kvswap.registry.thresholds import Calibration
from kvswap.types import DeviceInfo

__all__ = [
    "kvswap_create_stream",
    "kvswap_detect_platform",
    "kvswap_register_calibrations",
    "kvswap_register_copy_impls",
]


@hookimpl
def kvswap_register_copy_impls(platform: str, register: Callable[[CopyImpl], None]) -> None:
    if platform == "cuda":
        from .batch import CUDA_BATCH

        register(CUDA_BATCH)


@hookimpl
def kvswap_register_calibrations(device: DeviceInfo, register: Callable[[Calibration], None]) -> None:
    from .defaults import calibrations_for

    for cal in calibrations_for(device):
        register(cal)


@hookimpl
def kvswap_detect_platform(device: Optional[str]) -> Optional[DeviceInfo]:
    from .device import describe

    return describe(device)


@hookimpl
def kvswap_create_stream(platform: str, device_index: int) -> Optional[int]:
    if platform != "cuda":
        return None
    from . import driver

    if driver.unavailable_reason() is not None:
        return None
    try:
        return driver.get().create_stream(device_index)
    except DriverError as e:  # the plugin's copy routes stay; kvswap falls back to torch's streams
        warnings.warn(f"cuda: kvswap could not create a stream of its own on device {device_index}: {e}",
                      KvSwapWarning, stacklevel=2)
        return None
