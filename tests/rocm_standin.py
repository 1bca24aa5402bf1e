"""RecordingHipStandIn: a stand-in for the HIP runtime library, for CPU tests only.

It is NOT HIP. It exposes Python callables under the HIP symbol names; the ROCm backend
binds them through the same ctypes prototypes it uses for ``libamdhip64``, so every
argument crosses a real C call boundary. Each call is recorded with its arguments read
back from memory (descriptor arrays, attribute structs), and copies are carried out as
host ``memmove`` so tests can check every byte. "Device" addresses of registered
allocations are whatever the test declares; nothing dereferences them.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import pytest

from kvswap.backends.rocm import hip
from kvswap.backends.rocm.hip import HipApi, MemcpyAttributes

ERRORS = {
    0: ("hipSuccess", "no error"),
    1: ("hipErrorInvalidValue", "invalid argument"),
    101: ("hipErrorInvalidDevice", "invalid device ordinal"),
    999: ("hipErrorUnknown", "unknown error"),
}
SIZE_MAX = ctypes.c_size_t(-1).value


@dataclass
class Allocation:
    host: int
    size: int
    device: int


def _recorded(fn: Callable[..., int]) -> Callable[..., int]:
    """Never let an exception escape into ctypes (it would print and return 0 = success):
    keep it for the test to re-raise, and answer hipErrorUnknown."""

    @functools.wraps(fn)
    def wrapper(self: RecordingHipStandIn, *args: Any) -> int:
        try:
            return fn(self, *args)
        except Exception as e:  # pragma: no cover - only on a broken test
            self.errors.append(e)
            return 999

    return wrapper


@dataclass
class RecordingHipStandIn:
    """Recording stand-in for libamdhip64; see the module docstring.

    :param version: what ``hipRuntimeGetVersion`` reports, as ``(major, minor, patch)``.
    :param missing: HIP symbols this "runtime" does not export.
    :param fail_batch: ``(call number, failIdx, code)``: that ``hipMemcpyBatchAsync`` call
        (0-based) copies nothing and returns ``code`` with ``failIdx`` set.
    :param fail_copy: ``(call number, code)`` for ``hipMemcpyAsync``.
    """

    version: tuple[int, int, int] = (7, 2, 0)
    missing: tuple[str, ...] = ()
    fail_batch: Optional[tuple[int, int, int]] = None
    fail_copy: Optional[tuple[int, int]] = None
    current_device: int = 0
    calls: list[tuple] = field(default_factory=list)
    errors: list[Exception] = field(default_factory=list)
    allocations: list[Allocation] = field(default_factory=list)
    _strings: dict[int, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.missing:
            setattr(self, name, None)  # HipApi.from_object skips symbols that are None

    def api(self) -> HipApi:
        return HipApi.from_object(self, "RecordingHipStandIn")

    def register(self, host: int, size: int, device: int) -> None:
        """Declare host memory as pinned and mapped at ``device`` (test set-up, not HIP)."""
        self.allocations.append(Allocation(host, size, device))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def of(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]

    def _find(self, addr: Optional[int]) -> Optional[Allocation]:
        for a in self.allocations:
            if addr is not None and a.host <= addr < a.host + a.size:
                return a
        return None

    # -- versions, errors, devices --------------------------------------------------------
    @_recorded
    def hipRuntimeGetVersion(self, out: Any) -> int:
        self.calls.append(("hipRuntimeGetVersion",))
        major, minor, patch = self.version
        out[0] = major * 10_000_000 + minor * 100_000 + patch
        return 0

    @_recorded
    def hipDriverGetVersion(self, out: Any) -> int:
        self.calls.append(("hipDriverGetVersion",))
        major, minor, patch = self.version
        out[0] = major * 10_000_000 + minor * 100_000 + patch
        return 0

    def _c_string(self, text: str) -> int:
        buf = ctypes.create_string_buffer(text.encode())
        self._strings[ctypes.addressof(buf)] = buf  # keep alive: the caller reads it later
        return ctypes.addressof(buf)

    def hipGetErrorName(self, code: int) -> int:
        return self._c_string(ERRORS.get(code, ("hipErrorUnknown", ""))[0])

    def hipGetErrorString(self, code: int) -> int:
        return self._c_string(ERRORS.get(code, ("", "unknown error"))[1])

    @_recorded
    def hipGetDevice(self, out: Any) -> int:
        self.calls.append(("hipGetDevice",))
        out[0] = self.current_device
        return 0

    @_recorded
    def hipSetDevice(self, index: int) -> int:
        self.calls.append(("hipSetDevice", index))
        self.current_device = index
        return 0

    @_recorded
    def hipStreamCreateWithFlags(self, out: Any, flags: int) -> int:
        self.calls.append(("hipStreamCreateWithFlags", self.current_device, flags))
        out[0] = 0x5000 + len(self.of("hipStreamCreateWithFlags"))
        return 0

    # -- copies ---------------------------------------------------------------------------
    @_recorded
    def hipMemcpyAsync(self, dst: Optional[int], src: Optional[int], size: int, kind: int, stream: Optional[int]) -> int:
        self.calls.append(("hipMemcpyAsync", dst, src, size, kind, stream or 0))
        if self.fail_copy and self.fail_copy[0] == len(self.of("hipMemcpyAsync")) - 1:
            return self.fail_copy[1]
        ctypes.memmove(dst, src, size)
        return 0

    @_recorded
    def hipMemcpyBatchAsync(self, dsts: int, srcs: int, sizes: int, count: int, attrs: Optional[int],
                            idxs: Optional[int], num_attrs: int, fail: Any, stream: Optional[int]) -> int:
        def read(addr: int) -> np.ndarray:
            return np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(addr)).astype(np.int64)

        d, s, n = read(dsts), read(srcs), read(sizes)
        attr_list = [
            (a.srcAccessOrder, a.srcLocHint.type, a.srcLocHint.id, a.dstLocHint.type, a.dstLocHint.id, a.flags)
            for a in (MemcpyAttributes.from_address(attrs + i * ctypes.sizeof(MemcpyAttributes))
                      for i in range(num_attrs if attrs else 0))
        ]
        idx_list = list((ctypes.c_size_t * num_attrs).from_address(idxs)) if idxs and num_attrs else []
        self.calls.append(("hipMemcpyBatchAsync", {
            "dsts": d, "srcs": s, "sizes": n, "count": count, "attrs": attr_list, "attrs_ptr": attrs,
            "idxs": idx_list, "num_attrs": num_attrs, "fail_ptr": bool(fail), "stream": stream or 0,
        }))
        fail[0] = SIZE_MAX
        if self.fail_batch and self.fail_batch[0] == len(self.of("hipMemcpyBatchAsync")) - 1:
            fail[0] = self.fail_batch[1]
            return self.fail_batch[2]
        for a, b, c in zip(d.tolist(), s.tolist(), n.tolist()):
            ctypes.memmove(a, b, c)
        return 0

    # -- host-address mapping -------------------------------------------------------------
    @_recorded
    def hipPointerGetAttribute(self, data: int, attribute: int, ptr: Optional[int]) -> int:
        self.calls.append(("hipPointerGetAttribute", attribute, ptr))
        found = self._find(ptr)
        if found is None or attribute != 11:
            ctypes.c_void_p.from_address(data).value = None
            return 1
        ctypes.c_void_p.from_address(data).value = found.host
        return 0

    @_recorded
    def hipMemPtrGetInfo(self, ptr: Optional[int], size: Any) -> int:
        self.calls.append(("hipMemPtrGetInfo", ptr))
        found = self._find(ptr)
        if found is None:
            return 1
        size[0] = found.size
        return 0

    @_recorded
    def hipHostGetDevicePointer(self, dev: Any, host: Optional[int], flags: int) -> int:
        self.calls.append(("hipHostGetDevicePointer", host, flags))
        found = self._find(host)
        if found is None or flags != 0:
            return 1
        dev[0] = found.device + (host - found.host)
        return 0


@pytest.fixture(autouse=True)
def fresh_hip():
    """Each test loads the HIP runtime afresh (the process caches it), and leaves the real
    loader in place for the next."""
    hip.reset()
    yield
    hip.reset()
