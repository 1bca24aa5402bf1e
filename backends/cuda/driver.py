"""The CUDA driver (libcuda) through ctypes: loading, entry points by ABI version, errors.

Nothing here runs at import. :func:`get` loads the library on first use and caches the
result, or the reason it cannot be used (:class:`DriverUnavailable`), so an impl's
availability check can say why not instead of failing an import.

Entry points are resolved with ``cuGetProcAddress`` at an explicit CUDA version, because
header macros pick ABI variants at compile time and ctypes has no headers: asking for
``cuMemcpyBatchAsync`` at 12080 returns the 9-argument CUDA 12.8 form (with ``failIdx``)
on 12.8+ and on 13 drivers, although CUDA 13 headers map the name to the 8-argument
``cuMemcpyBatchAsync_v2`` (CUDA driver API, ``cuGetProcAddress`` and the batch call's
``_v2`` form).
"""
from __future__ import annotations

import ctypes
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvswap.errors import DriverError, KvSwapError

CUresult = ctypes.c_int
LIBRARY_NAMES = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")

# Values from cuda.h (12.8+); the CPU tests check the struct layout against the header's.
ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
ORDER_DURING_API_CALL = 2
ORDER_ANY = 3  # CU_MEMCPY_SRC_ACCESS_ORDER_ANY
PROC_LEGACY_STREAM = 1  # CU_GET_PROC_ADDRESS_LEGACY_STREAM: never the per-thread (_ptsz) variants
PROC_STATUS = {0: "found", 1: "symbol not found", 2: "version not sufficient"}
# The NULL stream and CU_STREAM_LEGACY ((CUstream)0x1) both mean the legacy default stream,
# which cuMemcpyBatchAsync rejects; CU_STREAM_PER_THREAD (0x2) is a real stream to it.
LEGACY_STREAMS = frozenset({0, 1})
SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1
BATCH_MIN_VERSION = 12080
CUDA_ERROR_NOT_INITIALIZED = 3


class MemLocation(ctypes.Structure):
    """``CUmemLocation``: ``{CUmemLocationType type; int id;}`` (enums are 4-byte ints)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes_v1``: 24 bytes, fields at offsets 0, 4, 12, 20."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


_p = ctypes.c_void_p
_sz = ctypes.c_size_t
# Prototypes by the CUDA version they are asked for. Array arguments are c_void_p so the
# hot path passes numpy's raw ``.ctypes.data`` addresses as plain ints.
BATCH_PROTOTYPES = {
    12080: ctypes.CFUNCTYPE(CUresult, _p, _p, _p, _sz, _p, _p, _sz, _p, _p),  # ..., failIdx, stream
    13000: ctypes.CFUNCTYPE(CUresult, _p, _p, _p, _sz, _p, _p, _sz, _p),  # ..., stream
}
MEMCPY_ASYNC = ctypes.CFUNCTYPE(CUresult, ctypes.c_uint64, ctypes.c_uint64, _sz, _p)
_OUT_PTR = ctypes.CFUNCTYPE(CUresult, ctypes.POINTER(_p))
_PUSH = ctypes.CFUNCTYPE(CUresult, _p)
_DEVICE_GET = ctypes.CFUNCTYPE(CUresult, ctypes.POINTER(ctypes.c_int), ctypes.c_int)
_RETAIN = ctypes.CFUNCTYPE(CUresult, ctypes.POINTER(_p), ctypes.c_int)
_STREAM_CREATE = ctypes.CFUNCTYPE(CUresult, ctypes.POINTER(_p), ctypes.c_uint)
CU_STREAM_NON_BLOCKING = 0x1
_BUS_ID = ctypes.CFUNCTYPE(CUresult, ctypes.c_char_p, ctypes.c_int, ctypes.c_int)


class DriverUnavailable(KvSwapError, RuntimeError):
    """libcuda cannot be used in this process; the message is the reason."""


def version_text(version: int) -> str:
    """``13000`` -> ``"13.0"`` (CUDA encodes versions as 1000 * major + 10 * minor)."""
    return f"{version // 1000}.{(version % 1000) // 10}"


@dataclass(frozen=True)
class BatchAbi:
    """The ``cuMemcpyBatchAsync`` entry point found, and the ABI it was asked for."""

    requested: int
    address: int

    @property
    def has_fail_idx(self) -> bool:
        return self.requested < 13000

    @property
    def label(self) -> str:
        extra = "reports failIdx" if self.has_fail_idx else "no failIdx"
        return f"CUDA {version_text(self.requested)} ABI, {extra}"


Lookup = Callable[[str, int], "tuple[int, int]"]


def choose_batch_abi(driver_version: int, lookup: Lookup) -> tuple[Optional[BatchAbi], str]:
    """Find ``cuMemcpyBatchAsync``; return ``(abi, description)`` or ``(None, why not)``.

    :param driver_version: what ``cuDriverGetVersion`` reports (``12080``, ``13000``).
    :param lookup: ``lookup(symbol, cuda_version) -> (address or 0, status)``, i.e.
        ``cuGetProcAddress``; it may raise :class:`KvSwapError`.

    The 12.8 ABI is asked for first: it exists on 12.8+ and 13 drivers and reports the
    failing descriptor. The 13.0 form is the fallback should a driver drop the old one.
    Versions above the driver's are never asked for (``cuGetProcAddress`` rejects them).
    """
    if driver_version < BATCH_MIN_VERSION:
        return None, (
            f"driver supports CUDA {version_text(driver_version)}; "
            f"cuMemcpyBatchAsync needs {version_text(BATCH_MIN_VERSION)}"
        )
    misses = []
    for requested in sorted(BATCH_PROTOTYPES):
        if requested > driver_version:
            continue
        try:
            address, status = lookup("cuMemcpyBatchAsync", requested)
        except KvSwapError as e:
            misses.append(f"{version_text(requested)}: {e}")
            continue
        if address:
            abi = BatchAbi(requested, int(address))
            return abi, f"cuMemcpyBatchAsync, {abi.label}"
        misses.append(f"{version_text(requested)}: {PROC_STATUS.get(status, f'status {status}')}")
    return None, "cuGetProcAddress found no cuMemcpyBatchAsync (" + "; ".join(misses) + ")"


def fail_index(raw: int, count: int) -> Optional[int]:
    """The descriptor index the driver blamed, or None (``SIZE_MAX``: no single copy)."""
    return int(raw) if 0 <= raw < count else None


def make_error(call: str, code: int, describe: Callable[[int], tuple[Optional[str], Optional[str]]],
               index: Optional[int] = None) -> DriverError:
    """A :class:`kvswap.DriverError` for ``code``, named by ``describe(code) -> (name, text)``."""
    try:
        name, text = describe(code)
    except Exception:  # naming an error must never hide it
        name, text = None, None
    return DriverError(call, int(code), name, text, index)


class ContextGuard:
    """Makes one CUDA context current around a call, only when it is not already.

    torch makes the primary context current in threads that used CUDA through it; a
    thread that did not (or one on another device) would otherwise get
    ``CUDA_ERROR_INVALID_CONTEXT``. Pushing and popping leaves torch's notion of the
    current device untouched.
    """

    def __init__(self, context: int, get_current: Any, push: Any, pop: Any, error: Callable[..., DriverError]) -> None:
        self.context = context
        self._get, self._push, self._pop, self._error = get_current, push, pop, error

    def enter(self) -> bool:
        current = _p()
        rc = self._get(ctypes.byref(current))
        if rc:
            raise self._error("cuCtxGetCurrent", rc)
        if current.value == self.context:
            return False
        rc = self._push(self.context)
        if rc:
            raise self._error("cuCtxPushCurrent", rc)
        return True

    def exit(self) -> None:
        popped = _p()
        rc = self._pop(ctypes.byref(popped))
        if rc:
            raise self._error("cuCtxPopCurrent", rc)


class Driver:
    """A loaded libcuda: versioned entry points, error names, context and device queries."""

    def __init__(self, lib: Any, path: str) -> None:
        self.lib = lib
        self.path = path
        self._procs: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()
        self._initialised = False
        self._batch: Optional[tuple[Optional[BatchAbi], str]] = None
        try:
            get_version = lib.cuDriverGetVersion
        except AttributeError as e:
            raise DriverUnavailable(f"{path} has no cuDriverGetVersion: not a CUDA driver") from e
        for name in ("cuGetErrorName", "cuGetErrorString"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = CUresult, [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        get_version.restype, get_version.argtypes = CUresult, [ctypes.POINTER(ctypes.c_int)]
        version = ctypes.c_int(0)
        rc = get_version(ctypes.byref(version))
        if rc:
            raise DriverUnavailable(f"cuDriverGetVersion failed: {self.error('cuDriverGetVersion', rc)}")
        self.version = int(version.value)
        # cuGetProcAddress_v2 (CUDA 12.0+) reports a status; the 11.3 form does not.
        self._gpa = getattr(lib, "cuGetProcAddress_v2", None)
        self._gpa_status = self._gpa is not None
        if self._gpa is None:
            self._gpa = getattr(lib, "cuGetProcAddress", None)
        if self._gpa is None:
            raise DriverUnavailable(
                f"driver supports CUDA {version_text(self.version)}; kvswap needs cuGetProcAddress (CUDA 11.3+)"
            )
        self._gpa.restype = CUresult
        args = [ctypes.c_char_p, ctypes.POINTER(_p), ctypes.c_int, ctypes.c_uint64]
        self._gpa.argtypes = args + [ctypes.POINTER(ctypes.c_int)] if self._gpa_status else args

    # -- errors ------------------------------------------------------------------------
    def describe(self, code: int) -> tuple[Optional[str], Optional[str]]:
        """``(cuGetErrorName, cuGetErrorString)`` for ``code``; None where unknown."""
        out = []
        for name in ("cuGetErrorName", "cuGetErrorString"):
            fn, text = getattr(self.lib, name, None), ctypes.c_char_p()
            ok = fn is not None and fn(int(code), ctypes.byref(text)) == 0 and text.value
            out.append(text.value.decode(errors="replace") if ok else None)
        return out[0], out[1]

    def error(self, call: str, code: int, index: Optional[int] = None) -> DriverError:
        return make_error(call, code, self.describe, index)

    def check(self, call: str, code: int) -> None:
        if code:
            raise self.error(call, code)

    # -- entry points --------------------------------------------------------------------
    def lookup(self, symbol: str, version: int) -> tuple[int, int]:
        """``cuGetProcAddress(symbol, version, LEGACY_STREAM)`` -> ``(address or 0, status)``."""
        pfn, status = _p(), ctypes.c_int(0)
        args = [symbol.encode(), ctypes.byref(pfn), int(version), PROC_LEGACY_STREAM]
        rc = self._gpa(*args, ctypes.byref(status)) if self._gpa_status else self._gpa(*args)
        if rc == CUDA_ERROR_NOT_INITIALIZED and not self._initialised:
            self.init()  # a driver that wants cuInit before entry-point queries
            rc = self._gpa(*args, ctypes.byref(status)) if self._gpa_status else self._gpa(*args)
        if rc:
            raise self.error(f"cuGetProcAddress({symbol!r}, {version})", rc)
        if not pfn.value and not self._gpa_status:
            status.value = 1
        return int(pfn.value or 0), int(status.value)

    def proc(self, symbol: str, version: int, prototype: Any) -> Any:
        """The entry point as a ctypes function of ``prototype``; raise if it is missing."""
        key = (symbol, version)
        with self._lock:
            fn = self._procs.get(key)
            if fn is None:
                address, status = self.lookup(symbol, version)
                if not address:
                    raise DriverUnavailable(
                        f"driver (CUDA {version_text(self.version)}) has no {symbol} "
                        f"for CUDA {version_text(version)}: {PROC_STATUS.get(status, status)}"
                    )
                fn = self._procs[key] = prototype(address)
        return fn

    def batch_abi(self) -> tuple[Optional[BatchAbi], str]:
        """:func:`choose_batch_abi` on this driver, cached."""
        if self._batch is None:
            self._batch = choose_batch_abi(self.version, self.lookup)
        return self._batch

    def batch_function(self, abi: BatchAbi) -> Any:
        return BATCH_PROTOTYPES[abi.requested](abi.address)

    def memcpy_async(self) -> Any:
        return self.proc("cuMemcpyAsync", 4000, MEMCPY_ASYNC)

    # -- devices and contexts -----------------------------------------------------------
    def init(self) -> None:
        """``cuInit(0)`` once (torch has usually done it already; it is idempotent)."""
        if not self._initialised:
            fn = self.lib.cuInit  # exported under its own name by every driver
            fn.restype, fn.argtypes = CUresult, [ctypes.c_uint]
            self.check("cuInit", fn(0))
            self._initialised = True

    def device(self, ordinal: int) -> int:
        self.init()
        dev = ctypes.c_int(0)
        self.check("cuDeviceGet", self.proc("cuDeviceGet", 2000, _DEVICE_GET)(ctypes.byref(dev), int(ordinal)))
        return int(dev.value)

    def context_guard(self, ordinal: int) -> ContextGuard:
        """A guard for ``ordinal``'s primary context (the one torch uses), retained once."""
        ctx = _p()
        retain = self.proc("cuDevicePrimaryCtxRetain", 7000, _RETAIN)
        self.check("cuDevicePrimaryCtxRetain", retain(ctypes.byref(ctx), self.device(ordinal)))
        return ContextGuard(
            int(ctx.value),
            self.proc("cuCtxGetCurrent", 4000, _OUT_PTR),
            self.proc("cuCtxPushCurrent", 4000, _PUSH),
            self.proc("cuCtxPopCurrent", 4000, _OUT_PTR),
            self.error,
        )

    def create_stream(self, ordinal: int) -> int:
        """A new stream in ``ordinal``'s primary context, non-blocking with respect to the
        legacy default stream; its handle."""
        guard = self.context_guard(ordinal)
        pushed = guard.enter()
        try:
            handle = _p()
            create = self.proc("cuStreamCreate", 2000, _STREAM_CREATE)
            self.check("cuStreamCreate", create(ctypes.byref(handle), CU_STREAM_NON_BLOCKING))
        finally:
            if pushed:
                guard.exit()
        return int(handle.value)

    def pci_bus_id(self, ordinal: int) -> str:
        buf = ctypes.create_string_buffer(64)
        fn = self.proc("cuDeviceGetPCIBusId", 4010, _BUS_ID)
        self.check("cuDeviceGetPCIBusId", fn(buf, len(buf), self.device(ordinal)))
        return buf.value.decode()


def load(names: tuple[str, ...]) -> Driver:
    """Load the first of ``names`` that opens as a CUDA driver; raise DriverUnavailable."""
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        raise DriverUnavailable("kvswap's CUDA backend needs a 64-bit process")
    failures = []
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            failures.append(str(e) or name)
            continue
        return Driver(lib, name)
    also = f" (also tried {', '.join(names[1:])})" if len(names) > 1 else ""
    first = failures[0] if failures else "no library names to try"
    raise DriverUnavailable(f"libcuda cannot be loaded, no NVIDIA driver here? {first}{also}")


_lock = threading.Lock()
_loaded: Optional[Driver] = None
_failure: Optional[DriverUnavailable] = None


def get() -> Driver:
    """The process's driver, loaded once; the first failure is remembered and re-raised."""
    global _loaded, _failure
    with _lock:
        if _loaded is None and _failure is None:
            try:
                _loaded = load(LIBRARY_NAMES)
            except DriverUnavailable as e:
                _failure = e
        if _failure is not None:
            raise DriverUnavailable(str(_failure))
        return _loaded


def unavailable_reason() -> Optional[str]:
    """None when libcuda is usable, else why not."""
    try:
        get()
    except DriverUnavailable as e:
        return str(e)
    return None


def reset() -> None:
    """Forget the loaded driver or its failure (tests)."""
    global _loaded, _failure
    with _lock:
        _loaded = _failure = None
