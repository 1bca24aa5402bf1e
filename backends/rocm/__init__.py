"""kvswap backend for AMD GPUs (ROCm / HIP), registered as the ``rocm`` plugin.

It offers:

* ``rocm.batch`` — copies through the HIP copy engines: ``hipMemcpyBatchAsync`` in chunks
  of at most 8 192 descriptors on ROCm >= 7.1 (``numAttrs = 0`` before 7.13, one attribute
  from 7.13 on: source order ANY only when the source is host memory), ``hipMemcpyAsync``
  per descriptor on older runtimes. The bound function's ``.note`` (shown by
  ``explain()``) says which path was taken and why. HIP errors raise
  :class:`kvswap.DriverError` with ``hipGetErrorName`` / ``hipGetErrorString`` text.
* a host-address translator for kernel routes (``kvswap_host_address_translator``), built
  on ``hipHostGetDevicePointer``; :mod:`kvswap.backends.rocm.translate` documents the
  seam for vendors whose devices address host memory differently from the CPU.
* a ``DeviceInfo`` for ROCm devices (name, gfx architecture, CU count, HIP runtime
  version, identity key) and defaults for uncalibrated devices that prefer the batch
  route; ``explain()`` then says the device is not calibrated and to run
  ``kvswap calibrate``.

The HIP runtime (``libamdhip64``) is opened on first use, never at import; without it
``rocm.batch`` is unavailable and says why. Nothing here has run on an AMD GPU yet: the
logic is tested on the CPU against a recording stand-in for the HIP library, and
``tests/test_rocm_gpu.py`` holds the tests for an AMD machine.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from kvswap import hookimpl

from .plugin import RocmBackend

__all__ = ["BACKEND", "RocmBackend"]

# The process's ROCm plugin; it loads nothing until a hook needs the runtime.
BACKEND = RocmBackend()


@hookimpl
def kvswap_register_copy_impls(platform: str, register: Callable[..., None]) -> None:
    BACKEND.kvswap_register_copy_impls(platform=platform, register=register)


@hookimpl
def kvswap_register_calibrations(device: Any, register: Callable[..., None]) -> None:
    BACKEND.kvswap_register_calibrations(device=device, register=register)


@hookimpl
def kvswap_detect_platform(device: Optional[str]) -> Any:
    return BACKEND.kvswap_detect_platform(device=device)


@hookimpl
def kvswap_host_address_translator(device: Any) -> Any:
    return BACKEND.kvswap_host_address_translator(device=device)
