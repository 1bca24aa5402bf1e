"""Host addresses a kernel may dereference on ROCm: the seam for platform backends.

The seam, for vendors
---------------------
A kernel route (``triton.kernel``) loads from and stores to host memory directly. On some
platforms the address a kernel must use for a pinned host buffer differs from the address
the CPU uses. kvswap asks each platform backend for a translator through the hook
``kvswap_host_address_translator(device)``:

* return ``None`` when host and device share addresses (CUDA with unified addressing:
  the core then uses the identity);
* otherwise return a callable ``translate(addresses, sizes=None) -> addresses`` taking and
  returning 1-D int64 arrays of equal length, where ``sizes``, when given, lets it check
  that each ``[address, address + size)`` lies inside one mapped allocation;
* raise :class:`kvswap.InvalidTransferError` for an address the device cannot reach; the
  kernel route calls the translator before it launches, so nothing has moved yet.

The resolver calls the hook once per ``resolve()`` and hands the callable to every kernel
factory as ``BindContext.translate_host``; a kernel route applies it, per transfer, to
the host-side addresses only (sources for h2d, destinations for d2h).

ROCm
----
Memory registered with ``hipHostRegister`` can have a device address different from its
host address; ``hipHostMalloc`` memory (torch's pinned allocator) is mapped at the same
address. The HIP runtime maps each allocation as one contiguous range, so within an
allocation ``device = host + delta``. Per call, the translator sorts the addresses once,
then for each allocation touched asks the runtime three questions about its first
address: where the allocation starts (``hipPointerGetAttribute`` with
``HIP_POINTER_ATTRIBUTE_RANGE_START_ADDR``), how large it is (``hipMemPtrGetInfo``: a
``size_t``, where the range-size attribute is 32 bits on some runtimes) and the device
address of its start (``hipHostGetDevicePointer``); every address in that allocation is
then mapped with one vectorised add. Runtime calls grow with the number of allocations
touched, not with the number of descriptors.

Nothing is cached between calls: a cache cannot see ``hipHostUnregister``, and a stale
mapping would let a kernel write where no one expects. The queries run with the resolved
device current (``hipHostGetDevicePointer`` answers for the current device).
"""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import numpy as np

from kvswap.addressing.descriptors import as_int64
from kvswap.errors import InvalidTransferError
from kvswap.types import DeviceInfo

from . import hip as runtime
from .hip import POINTER_ATTRIBUTE_RANGE_START_ADDR, HipApi, HipUnavailable

_HINT = "pin it with torch's pin_memory() (hipHostMalloc) or register it with hipHostRegister"


class Refuse:
    """The translator for a ROCm device whose runtime cannot map addresses: it refuses
    every call, so a kernel route fails before launching instead of guessing."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __call__(self, addresses: Any, sizes: Any = None) -> np.ndarray:
        raise InvalidTransferError(f"cannot map host addresses for a kernel on ROCm: {self.reason}")


def translator_for(device: DeviceInfo) -> Optional[Any]:
    """What the hook ``kvswap_host_address_translator`` answers for ``device``: None off
    ROCm, a :class:`HostAddressTranslator`, or a :class:`Refuse` without a runtime."""
    if device.platform != "rocm":
        return None
    try:
        return HostAddressTranslator(runtime.get(), device.index or 0)
    except HipUnavailable as e:
        return Refuse(str(e))


class HostAddressTranslator:
    """``translate(addresses, sizes=None)``: host addresses to device addresses on ROCm."""

    def __init__(self, hip: HipApi, device_index: int) -> None:
        self._hip = hip
        self._index = device_index
        self._range_start = hip.fn("hipPointerGetAttribute")
        self._size_of = hip.fn("hipMemPtrGetInfo")
        self._device_pointer = hip.fn("hipHostGetDevicePointer")

    def __repr__(self) -> str:
        return f"<kvswap ROCm host-address translator for device {self._index} ({self._hip.origin})>"

    @contextmanager
    def _on_device(self) -> Iterator[None]:
        current = self._hip.get_device()
        if current == self._index:
            yield
            return
        self._hip.set_device(self._index)
        try:
            yield
        finally:
            self._hip.set_device(current)

    def _unreachable(self, addr: int, index: int, call: str, code: int) -> InvalidTransferError:
        name = self._hip.error_name(code) or f"error {code}"
        return InvalidTransferError(
            f"host address 0x{addr:x} (descriptor {index}) is not memory the HIP runtime has "
            f"pinned and mapped for device {self._index} ({call}: {name}); a kernel cannot reach it: {_HINT}"
        )

    def _allocation(self, addr: int, index: int) -> tuple[int, int, int]:
        """``(host start, size, device start)`` of the allocation holding ``addr``."""
        start = ctypes.c_void_p(0)
        code = self._range_start(ctypes.byref(start), POINTER_ATTRIBUTE_RANGE_START_ADDR, addr)
        if code or not start.value:
            raise self._unreachable(addr, index, "hipPointerGetAttribute", code)
        size = ctypes.c_size_t(0)
        code = self._size_of(addr, ctypes.byref(size))
        if code or not size.value:
            raise self._unreachable(addr, index, "hipMemPtrGetInfo", code)
        dev = ctypes.c_void_p(0)
        code = self._device_pointer(ctypes.byref(dev), start.value, 0)
        if code or not dev.value:
            raise self._unreachable(addr, index, "hipHostGetDevicePointer", code)
        if not start.value <= addr < start.value + size.value:
            raise InvalidTransferError(
                f"host address 0x{addr:x} (descriptor {index}): the HIP runtime reports an allocation "
                f"[0x{start.value:x}, +{size.value}) that does not hold it; refusing to guess its device address"
            )
        return start.value, size.value, dev.value

    def __call__(self, addresses: Any, sizes: Optional[Any] = None) -> np.ndarray:
        addrs = as_int64(addresses, "host addresses")
        out = np.empty_like(addrs)
        if not len(addrs):
            return out
        ends = None
        if sizes is not None:
            ends = addrs + as_int64(sizes, "sizes")
            if len(ends) != len(addrs):
                raise InvalidTransferError(f"{len(addrs)} addresses but {len(ends)} sizes")
        order = np.argsort(addrs, kind="stable")
        ordered = addrs[order]
        if ordered[0] <= 0:
            i = int(order[0])
            raise InvalidTransferError(f"host address {int(addrs[i])} (descriptor {i}) is not a valid address")
        with self._on_device():
            pos = 0
            while pos < len(ordered):
                first = int(order[pos])
                start, size, dev = self._allocation(int(ordered[pos]), first)
                # Sorted, and ordered[pos] >= start: everything below start + size is inside.
                hi = int(np.searchsorted(ordered, start + size, side="left"))
                members = order[pos:hi]
                if ends is not None:
                    over = ends[members] > start + size
                    if over.any():
                        i = int(members[np.argmax(over)])
                        raise InvalidTransferError(
                            f"descriptor {i}: [0x{int(addrs[i]):x}, +{int(ends[i] - addrs[i])}) runs past the end "
                            f"of its pinned allocation [0x{start:x}, +{size}); a kernel cannot reach the rest"
                        )
                out[members] = addrs[members] + (dev - start)
                pos = hi
        return out
