"""StandInLibcuda: a stand-in for libcuda, for CPU tests only. It is NOT the CUDA driver.

Its entry points are ctypes callbacks, reached through the same foreign-call machinery
as the real library: ``cuGetProcAddress`` hands out their addresses, the backend calls
them through its own prototypes with raw array pointers. Every call is recorded with its
arguments read back from memory, and copies are host ``memmove``, so a test can check
every byte the backend asked it to move.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvswap.backends.cuda import driver

from fakes import scattered

_void_p, _size = ctypes.c_void_p, ctypes.c_size_t
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_INITIALIZED = 3

P_VERSION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))
P_ERRSTR = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
P_GPA = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(_void_p), ctypes.c_int,
                         ctypes.c_uint64, ctypes.POINTER(ctypes.c_int))
P_BATCH_12080 = ctypes.CFUNCTYPE(ctypes.c_int, _void_p, _void_p, _void_p, _size, _void_p, _void_p, _size, _void_p, _void_p)
P_BATCH_13000 = ctypes.CFUNCTYPE(ctypes.c_int, _void_p, _void_p, _void_p, _size, _void_p, _void_p, _size, _void_p)
P_MEMCPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, _size, _void_p)
P_INT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint)
P_OUT_INT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int)
P_OUT_PTR = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_void_p))
P_OUT_PTR_INT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_void_p), ctypes.c_int)
P_PTR = ctypes.CFUNCTYPE(ctypes.c_int, _void_p)


class StandInLibcuda:
    """Stand-in for libcuda (not the driver): records calls, copies with host memmoves.

    :param version: what ``cuDriverGetVersion`` reports.
    :param batch_abis: the ``cuMemcpyBatchAsync`` ABIs (12080, 13000) it exports.
    :param fail_at: make the copy of this descriptor fail with ``fail_code``.
    :param fail_calls: with ``fail_at``, only these batch calls fail (0-based, counted
        over the stand-in's life); None: every batch call fails.
    """

    NAMES = {1: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
             3: ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
             201: ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context")}
    PRIMARY = 0xC0FFEE0

    def __init__(self, version=13000, batch_abis=(12080, 13000), fail_at=None, fail_code=CUDA_ERROR_INVALID_VALUE,
                 needs_init=False, fail_calls=None):
        self.version, self.fail_at, self.fail_code = version, fail_at, fail_code
        self.fail_calls = fail_calls
        self.initialised = not needs_init
        self.calls: list[tuple] = []
        self.current, self.stack = 0, []
        self._keep: list = []
        self.cuDriverGetVersion = P_VERSION(self._get_version)
        self.cuGetErrorName = P_ERRSTR(lambda code, out: self._errstr(code, out, 0))
        self.cuGetErrorString = P_ERRSTR(lambda code, out: self._errstr(code, out, 1))
        self.cuGetProcAddress_v2 = P_GPA(self._get_proc_address)
        self.cuInit = P_INT(self._init)
        procs = {
            ("cuMemcpyAsync", 4000): P_MEMCPY(self._memcpy),
            ("cuDeviceGet", 2000): P_OUT_INT(self._device_get),
            ("cuDevicePrimaryCtxRetain", 7000): P_OUT_PTR_INT(self._retain),
            ("cuCtxGetCurrent", 4000): P_OUT_PTR(self._get_current),
            ("cuCtxPushCurrent", 4000): P_PTR(self._push),
            ("cuCtxPopCurrent", 4000): P_OUT_PTR(self._pop),
        }
        if 12080 in batch_abis:
            procs[("cuMemcpyBatchAsync", 12080)] = P_BATCH_12080(
                lambda d, s, n, c, a, ai, na, fi, st: self._batch(12080, d, s, n, c, a, ai, na, fi, st))
        if 13000 in batch_abis:
            procs[("cuMemcpyBatchAsync", 13000)] = P_BATCH_13000(
                lambda d, s, n, c, a, ai, na, st: self._batch(13000, d, s, n, c, a, ai, na, None, st))
        self._keep.extend(procs.values())
        self.procs = {k: ctypes.cast(f, _void_p).value for k, f in procs.items()}

    def of(self, name):
        return [c for c in self.calls if c[0] == name]

    def _record(self, *call):
        self.calls.append(call)
        return 0

    def _get_version(self, out):
        out[0] = self.version
        return 0

    def _errstr(self, code, out, which):
        if code not in self.NAMES:
            return CUDA_ERROR_INVALID_VALUE
        text = ctypes.c_char_p(self.NAMES[code][which].encode())
        self._keep.append(text)
        out[0] = text.value
        return 0

    def _get_proc_address(self, symbol, pfn, version, flags, status):
        name = symbol.decode()
        self.calls.append(("cuGetProcAddress", name, version, flags))
        if not self.initialised:
            return CUDA_ERROR_NOT_INITIALIZED
        if version > self.version:
            return CUDA_ERROR_INVALID_VALUE  # as documented: a version above the driver's
        found = [v for (n, v) in self.procs if n == name and v <= version]
        pfn[0] = self.procs[(name, max(found))] if found else None
        status[0] = 0 if found else (2 if any(n == name for n, _ in self.procs) else 1)
        return 0

    def _batch(self, abi, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, stream):
        def array(addr):
            return np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(addr)).copy()

        attr = driver.MemcpyAttributes.from_address(attrs)
        number = len(self.of("cuMemcpyBatchAsync"))
        self.calls.append(("cuMemcpyBatchAsync", dict(
            abi=abi, dst=array(dsts), src=array(srcs), sizes=array(sizes), count=count,
            order=attr.srcAccessOrder, flags=attr.flags, hint_types=(attr.srcLocHint.type, attr.dstLocHint.type),
            attr_idx=_size.from_address(attr_idxs).value, num_attrs=num_attrs,
            fail_idx=fail_idx, stream=stream or 0, context=self.current)))
        if self.fail_at is not None and (self.fail_calls is None or number in self.fail_calls):
            if fail_idx is not None:
                _size.from_address(fail_idx).value = self.fail_at
            return self.fail_code
        for d, s, n in zip(array(dsts).tolist(), array(srcs).tolist(), array(sizes).tolist()):
            ctypes.memmove(d, s, n)
        return 0

    def _memcpy(self, dst, src, size, stream):
        index = len(self.of("cuMemcpyAsync"))
        self.calls.append(("cuMemcpyAsync", dst, src, size, stream or 0, self.current))
        if index == self.fail_at:
            return self.fail_code
        ctypes.memmove(dst, src, size)
        return 0

    def _init(self, flags):
        self.initialised = True
        return self._record("cuInit", flags)

    def _device_get(self, out, ordinal):
        out[0] = ordinal
        return self._record("cuDeviceGet", ordinal)

    def _retain(self, out, dev):
        out[0] = self.PRIMARY + dev
        return self._record("cuDevicePrimaryCtxRetain", dev)

    def _get_current(self, out):
        out[0] = self.current or None
        return 0

    def _push(self, ctx):
        self.stack.append(self.current)
        self.current = ctx
        return self._record("cuCtxPushCurrent", ctx)

    def _pop(self, out):
        out[0] = self.current
        self.current = self.stack.pop()
        return self._record("cuCtxPopCurrent")


def standin_driver(**kw) -> tuple[driver.Driver, StandInLibcuda]:
    lib = StandInLibcuda(**kw)
    return driver.Driver(lib, "stand-in libcuda"), lib


class HostPools:
    """A random source pool, a poisoned destination pool, and scattered blocks between them."""

    def __init__(self, rng, sizes, pool=1 << 20, slot=None):
        sizes = np.asarray(sizes, dtype=np.int64)
        slot = slot or int(sizes.max()) + 64 if len(sizes) else 64
        self.src_pool = rng.integers(0, 256, pool, dtype=np.uint8)
        self.dst_pool = rng.integers(0, 256, pool, dtype=np.uint8)
        self.before = self.dst_pool.copy()
        self.sizes = sizes
        self.src_off = scattered(rng, pool, sizes, slot)
        self.dst_off = scattered(rng, pool, sizes, slot)
        self.src = self.src_off + self.src_pool.ctypes.data
        self.dst = self.dst_off + self.dst_pool.ctypes.data

    def expected(self):
        out = self.before.copy()
        for s, d, n in zip(self.src_off.tolist(), self.dst_off.tolist(), self.sizes.tolist()):
            out[d:d + n] = self.src_pool[s:s + n]
        return out

    def check(self):
        want = self.expected()
        bad = np.flatnonzero(self.dst_pool != want)
        assert not len(bad), f"{len(bad)} wrong bytes, first at offset {bad[0]}"


@pytest.fixture(autouse=True)
def fresh_driver():
    """A fresh driver load and device description for each test (both are cached)."""
    from kvswap.backends.cuda import device, driver

    driver.reset()
    device._describe.cache_clear()
    yield
    driver.reset()
    device._describe.cache_clear()
