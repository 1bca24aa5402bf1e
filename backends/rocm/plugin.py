"""The ROCm plugin: its hooks, around a HIP loader that tests can replace."""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import numpy as np

from kvswap import hookimpl
from kvswap.errors import DriverError, InvalidTransferError
from kvswap.impl import BindContext, CopyImpl
from kvswap.thresholds import Calibration
from kvswap.types import DeviceInfo, Direction

from .batch import DEFAULT_CHUNK, chunk_size, choose_path, make_transfer
from .device import default_calibration, detect
from .hip import HipApi, HipUnavailable, load_hip
from .translate import HostAddressTranslator

NAME = "rocm.batch"
PLATFORM = "rocm"


class _Refuse:
    """A translator for a ROCm device whose runtime cannot map addresses: it refuses
    every call, so a kernel route fails before launching instead of guessing."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __call__(self, addresses: Any, sizes: Any = None) -> np.ndarray:
        raise InvalidTransferError(f"cannot map host addresses for a kernel on ROCm: {self.reason}")


class RocmBackend:
    """The hooks of the ``rocm`` plugin.

    :param loader: returns a :class:`HipApi` or raises :class:`HipUnavailable`; called at
        most once, on first use (default: :func:`load_hip`, which opens libamdhip64).
    :param batch_chunk: descriptors per ``hipMemcpyBatchAsync`` call unless
        ``KVSWAP_ROCM_BATCH_CHUNK`` or the bind parameter ``batch_chunk`` says otherwise.
    """

    def __init__(self, loader: Callable[[], HipApi] = load_hip, batch_chunk: int = DEFAULT_CHUNK) -> None:
        self._loader = loader
        self._chunk = batch_chunk
        self._lock = threading.Lock()
        self._hip: Optional[HipApi] = None
        self._error: Optional[str] = None
        self.impl = CopyImpl(
            name=NAME,
            kind="batch",
            platforms=(PLATFORM,),
            directions=(Direction.H2D, Direction.D2H),
            factory=self._factory,
            availability=self._availability,
            description="HIP copy engines: hipMemcpyBatchAsync in chunks (ROCm >= 7.1), else hipMemcpyAsync per block",
        )

    def hip(self) -> HipApi:
        """The HIP runtime, loaded once; raises :class:`HipUnavailable` with the reason."""
        with self._lock:
            if self._hip is None and self._error is None:
                try:
                    self._hip = self._loader()
                except HipUnavailable as e:
                    self._error = str(e)
                except OSError as e:
                    self._error = f"loading the HIP runtime failed: {e}"
            if self._hip is None:
                raise HipUnavailable(self._error)
            return self._hip

    def _availability(self, device: DeviceInfo) -> Optional[str]:
        try:
            self.hip()
        except HipUnavailable as e:
            return str(e)
        return None

    def _factory(self, ctx: BindContext) -> Callable[..., None]:
        hip = self.hip()
        try:
            version = hip.runtime_version()
        except (DriverError, HipUnavailable):
            version = None  # choose_path then takes the per-copy path and says why
        path = choose_path(hip, version, ctx.direction)
        return make_transfer(hip, path, ctx.direction, ctx.device.index or 0, chunk_size(ctx.params, self._chunk))

    # -- hooks --------------------------------------------------------------------------
    @hookimpl
    def kvswap_register_copy_impls(self, platform: str, register: Callable[[CopyImpl], None]) -> None:
        if platform == PLATFORM:
            register(self.impl)

    @hookimpl
    def kvswap_register_calibrations(self, device: DeviceInfo, register: Callable[[Calibration], None]) -> None:
        if device.platform == PLATFORM:
            register(default_calibration())

    @hookimpl
    def kvswap_detect_platform(self, device: Optional[str]) -> Optional[DeviceInfo]:
        return detect(device, self.hip)

    @hookimpl
    def kvswap_host_address_translator(self, device: DeviceInfo) -> Optional[Callable[..., np.ndarray]]:
        if device.platform != PLATFORM:
            return None
        try:
            return HostAddressTranslator(self.hip(), device.index or 0)
        except HipUnavailable as e:
            return _Refuse(str(e))
