"""The contract between kvswap and its backends: one empty function per hook.

Hooks take keyword arguments. Hooks that offer things get a ``register`` callback, so the
core validates, names and ranks what it receives; the order plugins run in never decides
which implementation wins.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .. import hookspec
from ..types import DeviceInfo
from .impl import CopyImpl
from .thresholds import Calibration


@hookspec
def kvswap_register_copy_impls(platform: str, register: Callable[[CopyImpl], None]) -> None:
    """Offer copy implementations for a platform.

    :param platform: the platform being resolved for (``"cuda"``, ``"rocm"``, ``"cpu"``, …).
    :param register: call ``register(CopyImpl(...))`` once per implementation offered.

    Register only implementations that serve ``platform``; say whether one is usable on the
    actual device through its ``availability`` check, not by leaving it out, so that
    ``kvswap info`` can show why not. A plugin that raises here, or registers something
    that is not a valid CopyImpl, is dropped with a warning naming it.
    """


@hookspec
def kvswap_register_calibrations(device: DeviceInfo, register: Callable[[Calibration], None]) -> None:
    """Offer tuned thresholds for a device, such as defaults measured on known GPUs.

    :param device: the device being resolved for.
    :param register: call ``register(Calibration(...))`` for each calibration that applies.

    A measured profile of the device (``kvswap calibrate``) takes precedence over every
    registered calibration; among registered ones the most specific ``scope`` wins. Say in
    ``Calibration.source`` where the numbers were measured.
    """


@hookspec
def kvswap_detect_platform(device: Optional[str]) -> Optional[DeviceInfo]:
    """Describe the device if it belongs to this plugin's platform.

    :param device: the device the caller asked for (``"cuda:1"``, ``"xpu:0"``) or None
        for the default accelerator.
    :return: a :class:`DeviceInfo`, or None when the device is not this plugin's.

    Core recognises ``cpu`` itself and falls back to a plain description through torch for
    CUDA and ROCm; a platform backend returns a fuller one (link, driver, identity key),
    and an out-of-tree platform (XPU, Ascend, …) announces itself here.
    """


@hookspec
def kvswap_host_address_translator(device: DeviceInfo) -> Optional[Callable[[np.ndarray], np.ndarray]]:
    """Give the function that maps pinned host addresses to addresses a kernel may use.

    :param device: the device kernel routes will run on.
    :return: ``translate(addresses) -> addresses`` (int64 arrays of equal length), or None
        when host and device share addresses on this platform.

    Kernel routes call it once per transfer on the host-side addresses. On ROCm, memory
    registered with ``hipHostRegister`` can have a device address that differs from its
    host address; on CUDA with unified addressing the map is the identity. Raise
    :class:`kvswap.InvalidTransferError` for an address the device cannot reach.
    """


@hookspec
def kvswap_create_stream(platform: str, device_index: int) -> Optional[int]:
    """Create a stream on a device for kvswap alone, and give its driver handle.

    :param platform: the platform of the device (``"cuda"``, ``"rocm"``, …).
    :param device_index: the device's index on that platform.
    :return: the new stream's handle (``CUstream``, ``hipStream_t``) as an int, or None when
        this plugin does not serve ``platform``.

    Make it non-blocking with respect to the legacy default stream. kvswap keeps it for
    the life of the process, using it for one mover's or route's copies at a time; it never
    destroys it. Without a plugin that answers, kvswap falls back to torch's stream pool,
    whose streams other code may be handed too.
    """
