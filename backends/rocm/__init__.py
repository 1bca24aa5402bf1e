"""kvswap backend for AMD GPUs (ROCm / HIP), registered as the ``rocm`` plugin.

Its hooks, and where each part lives:

* ``rocm.batch`` (:mod:`.batch`) — copies through the HIP copy engines:
  ``hipMemcpyBatchAsync`` in chunks on ROCm >= 7.1, ``hipMemcpyAsync`` per descriptor on
  older runtimes. The bound function's ``.note`` (shown by ``explain()``) says which path
  was taken and why. HIP errors raise :class:`kvswap.DriverError` with
  ``hipGetErrorName`` / ``hipGetErrorString`` text.
* a host-address translator for kernel routes (:mod:`.translate`), built on
  ``hipHostGetDevicePointer``; its docstring documents the seam for vendors whose devices
  address host memory differently from the CPU.
* a ``DeviceInfo`` for ROCm devices (:mod:`.device`: name, gfx architecture, CU count,
  HIP runtime version, identity key) and defaults for uncalibrated devices
  (:mod:`.defaults`); ``explain()`` then says the device is not calibrated and to run
  ``kvswap calibrate``.

The HIP runtime (``libamdhip64``, :mod:`.hip`) is opened on first use, never at import;
without it ``rocm.batch`` is unavailable and says why. Nothing here has run on an AMD GPU
yet: the logic is tested on the CPU against a recording stand-in for the HIP library, and
``tests/test_rocm_gpu.py`` holds the tests for an AMD machine.
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
    "kvswap_host_address_translator",
    "kvswap_register_calibrations",
    "kvswap_register_copy_impls",
]

PLATFORM = "rocm"


@hookimpl
def kvswap_register_copy_impls(platform: str, register: Callable[[CopyImpl], None]) -> None:
    if platform == PLATFORM:
        from .batch import ROCM_BATCH

        register(ROCM_BATCH)


@hookimpl
def kvswap_register_calibrations(device: DeviceInfo, register: Callable[[Calibration], None]) -> None:
    if device.platform == PLATFORM:
        from .defaults import calibration_for

        register(calibration_for(device))


@hookimpl
def kvswap_detect_platform(device: Optional[str]) -> Optional[DeviceInfo]:
    from . import hip
    from .device import detect

    return detect(device, hip.get)


@hookimpl
def kvswap_host_address_translator(device: DeviceInfo) -> Optional[Callable[..., object]]:
    from .translate import translator_for

    return translator_for(device)


@hookimpl
def kvswap_create_stream(platform: str, device_index: int) -> Optional[int]:
    if platform != "rocm":
        return None
    from . import hip

    try:
        api = hip.get()
    except hip.HipUnavailable:
        return None  # no runtime: kvswap says so where it matters, at the copy routes
    if not api.has("hipStreamCreateWithFlags"):
        return None
    try:
        return api.create_stream(device_index)
    except DriverError as e:  # the plugin's copy routes stay; kvswap falls back to torch's streams
        warnings.warn(f"rocm: kvswap could not create a stream of its own on device {device_index}: {e}",
                      KvSwapWarning, stacklevel=2)
        return None
