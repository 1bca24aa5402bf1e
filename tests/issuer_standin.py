"""StandInStreams: :class:`StandInLibcuda` with streams that run later, for CPU tests of
the issuer's ordering. It is NOT the CUDA driver.

Copies, events and stream memory operations are queued per stream and run only when
the test steps the stand-in "GPU" (:meth:`StandInStreams.run`), which executes the head
of every stream whose head can run, as a GPU would: a ``cuStreamWaitValue32`` head runs
once the 32-bit word satisfies the wait, a ``cuStreamWaitEvent`` head once the record
it captured has run. A test can therefore check that work queued on the caller's stream
after a call sees the copied bytes, whichever thread issued the copy and when.
"""
from __future__ import annotations

import ctypes
import threading
import time

import numpy as np

from kvswap.backends.cuda import issuer

from cuda_standin import P_OUT_PTR, P_PTR, StandInLibcuda

_void_p, _size, _u32, _u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_uint64
P_CREATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_void_p), ctypes.c_uint)
P_TWO = ctypes.CFUNCTYPE(ctypes.c_int, _void_p, _void_p)
P_WAIT_EVENT = ctypes.CFUNCTYPE(ctypes.c_int, _void_p, _void_p, ctypes.c_uint)
P_VALUE = ctypes.CFUNCTYPE(ctypes.c_int, _void_p, _u64, _u32, ctypes.c_uint)
P_HOST_ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_void_p), _size, ctypes.c_uint)
P_DEV_PTR = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_u64), _void_p, ctypes.c_uint)
CUDA_ERROR_ILLEGAL_ADDRESS = 700


class _Record:
    """One ``cuEventRecord``: done once the stream ran past it."""

    def __init__(self) -> None:
        self.done = False


class StandInStreams(StandInLibcuda):
    """Stand-in libcuda whose stream work runs when the test says (:meth:`run`).

    :param fail_calls: names of entry points (``"cuStreamWriteValue32"``,
        ``"cuStreamWaitEvent"``, ...) that return ``fail_code`` instead of working.
    :param gate: a ``threading.Event`` every ``cuMemcpyBatchAsync`` and ``cuMemcpyAsync``
        waits for before it returns (to hold the issuing thread inside the driver call).
    """

    NAMES = {**StandInLibcuda.NAMES, 700: ("CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access")}

    def __init__(self, fail_calls=(), gate=None, **kw):
        self._local = threading.local()
        super().__init__(**kw)
        self.fail_calls = set(fail_calls)
        self.gate = gate
        self.lock = threading.RLock()
        self.streams: dict[int, list] = {}
        self.events: dict[int, _Record] = {}
        self.threads: dict[str, set] = {}
        self._handles = 0x5000
        self._host_blocks: list = []
        procs = {
            ("cuEventCreate", 2000): P_CREATE(self._event_create),
            ("cuEventRecord", 2000): P_TWO(self._event_record),
            ("cuEventDestroy", 4000): P_PTR(lambda ev: 0),
            ("cuStreamCreate", 2000): P_CREATE(self._stream_create),
            ("cuStreamWaitEvent", 3020): P_WAIT_EVENT(self._wait_event),
            ("cuStreamSynchronize", 2000): P_PTR(lambda s: self._note("cuStreamSynchronize")),
            ("cuStreamWaitValue32", 11070): P_VALUE(self._wait_value),
            ("cuStreamWriteValue32", 11070): P_VALUE(self._write_value),
            ("cuMemHostAlloc", 3020): P_HOST_ALLOC(self._host_alloc),
            ("cuMemHostGetDevicePointer", 3020): P_DEV_PTR(self._dev_ptr),
            ("cuCtxGetCurrent", 4000): P_OUT_PTR(self._get_current),
            ("cuCtxPushCurrent", 4000): P_PTR(self._push),
            ("cuCtxPopCurrent", 4000): P_OUT_PTR(self._pop),
        }
        self._keep.extend(procs.values())
        self.procs.update({k: ctypes.cast(f, _void_p).value for k, f in procs.items()})

    # -- the current context, per thread as in the driver ---------------------------------
    @property
    def current(self):
        return getattr(self._local, "current", 0)

    @current.setter
    def current(self, value):
        self._local.current = value

    @property
    def stack(self):
        if not hasattr(self._local, "stack"):
            self._local.stack = []
        return self._local.stack

    @stack.setter
    def stack(self, value):
        self._local.stack = value

    # -- entry points -----------------------------------------------------------------------
    def _note(self, name):
        self.threads.setdefault(name, set()).add(threading.current_thread().name)
        return self.fail_code if name in self.fail_calls else 0

    def _enqueue(self, stream, op):
        with self.lock:
            self.streams.setdefault(int(stream or 0), []).append(op)

    def _new_handle(self):
        with self.lock:
            self._handles += 0x10
            return self._handles

    def _event_create(self, out, flags):
        h = self._new_handle()
        self.events[h] = None
        out[0] = h
        return self._note("cuEventCreate")

    def _event_record(self, event, stream):
        rc = self._note("cuEventRecord")
        if rc:
            return rc
        rec = _Record()
        with self.lock:
            self.events[int(event)] = rec
            self._enqueue(stream, ("record", rec))
        return 0

    def _stream_create(self, out, flags):
        h = self._new_handle()
        with self.lock:
            self.streams.setdefault(h, [])
        out[0] = h
        self.calls.append(("cuStreamCreate", h, flags))
        return self._note("cuStreamCreate")

    def _wait_event(self, stream, event, flags):
        rc = self._note("cuStreamWaitEvent")
        if rc:
            return rc
        with self.lock:
            rec = self.events.get(int(event))
            if rec is not None:  # the record as of now, like the driver
                self._enqueue(stream, ("wait_event", rec))
        return 0

    def _wait_value(self, stream, addr, value, flags):
        rc = self._note("cuStreamWaitValue32")
        if rc:
            return rc
        self.calls.append(("cuStreamWaitValue32", int(stream or 0), int(value), int(flags)))
        self._enqueue(stream, ("wait_value", int(addr), int(value), int(flags)))
        return 0

    def _write_value(self, stream, addr, value, flags):
        rc = self._note("cuStreamWriteValue32")
        if rc:
            return rc
        self._enqueue(stream, ("write_value", int(addr), int(value)))
        return 0

    def _host_alloc(self, out, size, flags):
        block = (ctypes.c_uint8 * int(size))()
        self._host_blocks.append(block)
        out[0] = ctypes.addressof(block)
        self.calls.append(("cuMemHostAlloc", int(size), int(flags)))
        return self._note("cuMemHostAlloc")

    def _dev_ptr(self, out, host, flags):
        out[0] = int(host)  # unified addressing: the same address
        return self._note("cuMemHostGetDevicePointer")

    def _batch(self, abi, dsts, srcs, sizes, count, attrs, attr_idxs, num_attrs, fail_idx, stream):
        def array(addr):
            return np.ctypeslib.as_array((ctypes.c_int64 * count).from_address(addr)).copy()

        rc = self._note("cuMemcpyBatchAsync")
        if self.gate is not None:
            self.gate.wait(10)
        triples = list(zip(array(dsts).tolist(), array(srcs).tolist(), array(sizes).tolist()))
        self.calls.append(("cuMemcpyBatchAsync", dict(count=count, stream=int(stream or 0), abi=abi,
                                                      thread=threading.current_thread().name,
                                                      context=self.current)))
        if rc or self.fail_at is not None:
            if fail_idx is not None and self.fail_at is not None:
                _size.from_address(fail_idx).value = self.fail_at
            return rc or self.fail_code
        self._enqueue(stream, ("copy", triples))
        return 0

    def _memcpy(self, dst, src, size, stream):
        rc = self._note("cuMemcpyAsync")
        if self.gate is not None:
            self.gate.wait(10)
        self.calls.append(("cuMemcpyAsync", dst, src, size, stream or 0, self.current))
        if rc:
            return rc
        self._enqueue(stream, ("copy", [(int(dst), int(src), int(size))]))
        return 0

    # -- what the test enqueues and runs ------------------------------------------------------
    def later(self, stream, fn):
        """Queue ``fn()`` on ``stream``: work the caller enqueues after a call."""
        self._enqueue(stream, ("host", fn))

    def _ready(self, op):
        kind = op[0]
        if kind == "wait_value":
            word = _u32.from_address(op[1]).value
            return issuer.seq_reached(word, op[2])
        if kind == "wait_event":
            return op[1].done
        return True

    def _execute(self, op):
        kind = op[0]
        if kind == "copy":
            for d, s, n in op[1]:
                ctypes.memmove(d, s, n)
        elif kind == "record":
            op[1].done = True
        elif kind == "write_value":
            _u32.from_address(op[1]).value = op[2]
        elif kind == "host":
            op[1]()

    def step(self):
        """Run every stream's head that can run, repeatedly; True if anything ran."""
        ran = False
        progress = True
        while progress:
            progress = False
            with self.lock:
                heads = [(h, q[0]) for h, q in self.streams.items() if q]
            for handle, op in heads:
                if self._ready(op):
                    with self.lock:
                        self.streams[handle].pop(0)
                    self._execute(op)
                    progress = ran = True
        return ran

    def pending(self):
        with self.lock:
            return {h: [op[0] for op in q] for h, q in self.streams.items() if q}

    def run(self, timeout=5.0):
        """Run the streams until all are empty; raise (a deadlock) if they stall for ``timeout`` s."""
        end = time.monotonic() + timeout
        while True:
            if self.step():
                end = time.monotonic() + timeout
            if not self.pending():
                return
            if time.monotonic() > end:
                raise AssertionError(f"streams stalled (deadlock): {self.pending()}")
            time.sleep(0.0005)
