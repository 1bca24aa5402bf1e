"""The HIP runtime through ctypes: the few calls kvswap makes, bound lazily and checked.

Nothing here loads a library at import time. :func:`get` loads the runtime on first use
and caches it, or the reason it cannot be used; :func:`load_hip` finds ``libamdhip64``
(preferring the copy this process already has mapped, so kvswap and torch share one
runtime) and returns a :class:`HipApi`. Tests build a :class:`HipApi` around a stand-in
object whose attributes are named like the C symbols (:meth:`HipApi.from_object`) and
hand its loader to :func:`reset`, so every call still goes through the same ctypes
prototypes as the real library.

Signatures and constants are those of the public HIP headers (``hip_runtime_api.h``,
``driver_types.h``); the batch call is the 9-argument form with ``failIdx``.
"""
from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from ctypes import POINTER, c_int, c_size_t, c_uint, c_void_p
from dataclasses import dataclass
from typing import Any, Callable, Optional

from kvswap.errors import DriverError

HIP_SUCCESS = 0
MEMCPY_HOST_TO_DEVICE = 1  # hipMemcpyKind
MEMCPY_DEVICE_TO_HOST = 2
MEMCPY_DEVICE_TO_DEVICE = 3
SRC_ACCESS_ORDER_STREAM = 1  # hipMemcpySrcAccessOrder
SRC_ACCESS_ORDER_ANY = 3
POINTER_ATTRIBUTE_RANGE_START_ADDR = 11  # hipPointer_attribute
SIZE_MAX = ctypes.c_size_t(-1).value

LIBRARY_NAMES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")


class MemLocation(ctypes.Structure):
    """``hipMemLocation``: ``{hipMemLocationType type; int id}``; all zero means no hint."""

    _fields_ = [("type", c_int), ("id", c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``hipMemcpyAttributes``: source access order, two location hints, flags (24 bytes)."""

    _fields_ = [
        ("srcAccessOrder", c_uint),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", c_uint),
    ]


# symbol -> (restype, argtypes). Array arguments of the batch call are c_void_p so the
# caller passes numpy buffers by address, without building ctypes arrays per call.
# Strings come back as c_void_p: read with string_at (a c_char_p restype cannot be
# produced by a stand-in callback).
PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {
    "hipRuntimeGetVersion": (c_int, (POINTER(c_int),)),
    "hipDriverGetVersion": (c_int, (POINTER(c_int),)),
    "hipGetErrorName": (c_void_p, (c_int,)),
    "hipGetErrorString": (c_void_p, (c_int,)),
    "hipGetDevice": (c_int, (POINTER(c_int),)),
    "hipSetDevice": (c_int, (c_int,)),
    "hipMemcpyAsync": (c_int, (c_void_p, c_void_p, c_size_t, c_int, c_void_p)),
    "hipMemcpyBatchAsync": (
        c_int,
        (c_void_p, c_void_p, c_void_p, c_size_t, c_void_p, c_void_p, c_size_t, POINTER(c_size_t), c_void_p),
    ),
    "hipHostGetDevicePointer": (c_int, (POINTER(c_void_p), c_void_p, c_uint)),
    "hipPointerGetAttribute": (c_int, (c_void_p, c_int, c_void_p)),
    "hipMemPtrGetInfo": (c_int, (c_void_p, POINTER(c_size_t))),
    "hipStreamCreateWithFlags": (c_int, (POINTER(c_void_p), c_uint)),
}
HIP_STREAM_NON_BLOCKING = 0x1
REQUIRED = ("hipRuntimeGetVersion", "hipMemcpyAsync")


class HipUnavailable(Exception):
    """The HIP runtime cannot be used here; the message is the reason a person reads."""


@dataclass(frozen=True, order=True)
class HipVersion:
    """A HIP runtime version; ``hipRuntimeGetVersion`` encodes it as
    ``major * 10_000_000 + minor * 100_000 + patch``."""

    major: int
    minor: int
    patch: int = 0

    @classmethod
    def from_int(cls, raw: int) -> HipVersion:
        return cls(raw // 10_000_000, (raw // 100_000) % 100, raw % 100_000)

    def at_least(self, major: int, minor: int) -> bool:
        return (self.major, self.minor) >= (major, minor)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


class HipApi:
    """Bound HIP functions, each called through its ctypes prototype.

    :ivar origin: where the functions come from (a library path, or the stand-in's name).
    """

    def __init__(self, functions: dict[str, Any], origin: str, keep: Any = None) -> None:
        self._fn = functions
        self.origin = origin
        self._keep = keep  # the library or stand-in whose code the pointers refer to

    @classmethod
    def from_library(cls, lib: ctypes.CDLL, origin: str) -> HipApi:
        fns = {}
        for name, (restype, argtypes) in PROTOTYPES.items():
            try:
                fns[name] = ctypes.CFUNCTYPE(restype, *argtypes)((name, lib))
            except AttributeError:
                continue  # symbol not exported by this runtime
        return cls(fns, origin, lib)

    @classmethod
    def from_object(cls, obj: Any, origin: str) -> HipApi:
        """Bind the callables ``obj`` has under HIP symbol names (a stand-in for tests)."""
        fns = {}
        for name, (restype, argtypes) in PROTOTYPES.items():
            target = getattr(obj, name, None)
            if target is not None:
                fns[name] = ctypes.CFUNCTYPE(restype, *argtypes)(target)
        return cls(fns, origin, obj)

    def has(self, name: str) -> bool:
        return name in self._fn

    def fn(self, name: str) -> Any:
        """The bound function ``name``; raise :class:`HipUnavailable` if it is not exported."""
        try:
            return self._fn[name]
        except KeyError:
            raise HipUnavailable(f"{self.origin} does not export {name}") from None

    # -- errors ---------------------------------------------------------------------------
    def _string(self, symbol: str, code: int) -> Optional[str]:
        if symbol not in self._fn:
            return None
        ptr = self._fn[symbol](code)
        return ctypes.string_at(ptr).decode(errors="replace") if ptr else None

    def error_name(self, code: int) -> Optional[str]:
        return self._string("hipGetErrorName", code)

    def error_string(self, code: int) -> Optional[str]:
        return self._string("hipGetErrorString", code)

    def error(self, call: str, code: int, index: Optional[int] = None) -> DriverError:
        return DriverError(call, code, self.error_name(code), self.error_string(code), index)

    def check(self, call: str, code: int) -> None:
        if code != HIP_SUCCESS:
            raise self.error(call, code)

    # -- queries --------------------------------------------------------------------------
    def _int_out(self, name: str) -> int:
        out = c_int(0)
        self.check(name, self.fn(name)(ctypes.byref(out)))
        return out.value

    def runtime_version(self) -> HipVersion:
        return HipVersion.from_int(self._int_out("hipRuntimeGetVersion"))

    def driver_version(self) -> Optional[HipVersion]:
        if not self.has("hipDriverGetVersion"):
            return None
        return HipVersion.from_int(self._int_out("hipDriverGetVersion"))

    def get_device(self) -> int:
        return self._int_out("hipGetDevice")

    def set_device(self, index: int) -> None:
        self.check("hipSetDevice", self.fn("hipSetDevice")(index))

    def create_stream(self, index: int) -> int:
        """A new stream on device ``index``, non-blocking with respect to the null stream;
        the calling thread's current device is left as it was."""
        before = self.get_device()
        if before != index:
            self.set_device(index)
        try:
            handle = c_void_p()
            self.check("hipStreamCreateWithFlags",
                       self.fn("hipStreamCreateWithFlags")(ctypes.byref(handle), HIP_STREAM_NON_BLOCKING))
        finally:
            if before != index:
                self.set_device(before)
        return int(handle.value)


def _mapped_library() -> Optional[str]:
    """The path of a libamdhip64 this process has already mapped (torch's), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1]
                if os.path.basename(path).startswith("libamdhip64.so"):
                    return path
    except OSError:
        pass
    return None


def candidate_paths() -> list[str]:
    """Where to look, best first: the copy already mapped, torch's bundled copy, the
    loader's search path, ``$ROCM_PATH/lib`` and ``/opt/rocm/lib``. Loading a second,
    different runtime beside torch's would give two address books for one device."""
    found: list[str] = []
    mapped = _mapped_library()
    if mapped:
        found.append(mapped)
    spec = importlib.util.find_spec("torch")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found += [os.path.join(root, "lib", n) for n in LIBRARY_NAMES]
    found += list(LIBRARY_NAMES)
    for root in dict.fromkeys((os.environ.get("ROCM_PATH") or "/opt/rocm", "/opt/rocm")):
        found += [os.path.join(root, "lib", n) for n in LIBRARY_NAMES]
    return list(dict.fromkeys(found))


def load_hip(paths: Optional[list[str]] = None, opener: Callable[[str], Any] = ctypes.CDLL) -> HipApi:
    """Open the HIP runtime; raise :class:`HipUnavailable` saying what was tried."""
    tried, last = [], ""
    for path in candidate_paths() if paths is None else paths:
        if os.sep in path and not os.path.exists(path):
            continue
        tried.append(path)
        try:
            lib = opener(path)
        except OSError as e:
            last = str(e)
            continue
        api = HipApi.from_library(lib, path)
        missing = [n for n in REQUIRED if not api.has(n)]
        if missing:
            last = f"{path} lacks {', '.join(missing)}"
            continue
        return api
    detail = f"; last error: {last}" if last else ""
    raise HipUnavailable(
        f"HIP runtime (libamdhip64) not found: tried {', '.join(tried) or 'nothing'}{detail}"
    )


# The process's runtime: loaded once, on first use; the first failure is remembered.
_lock = threading.Lock()
_loader: Callable[[], HipApi] = load_hip
_loaded: Optional[HipApi] = None
_failure: Optional[str] = None


def get() -> HipApi:
    """The HIP runtime, loaded once; raises :class:`HipUnavailable` with the reason."""
    global _loaded, _failure
    with _lock:
        if _loaded is None and _failure is None:
            try:
                _loaded = _loader()
            except HipUnavailable as e:
                _failure = str(e)
            except OSError as e:
                _failure = f"loading the HIP runtime failed: {e}"
        if _loaded is None:
            raise HipUnavailable(_failure)
        return _loaded


def unavailable_reason() -> Optional[str]:
    """None when the HIP runtime is usable, else why not."""
    try:
        get()
    except HipUnavailable as e:
        return str(e)
    return None


def reset(loader: Optional[Callable[[], HipApi]] = None) -> None:
    """Forget the loaded runtime or its failure; load with ``loader`` next (default
    :func:`load_hip`). For tests, which hand in a stand-in's loader."""
    global _loader, _loaded, _failure
    with _lock:
        _loader = load_hip if loader is None else loader
        _loaded = _failure = None
