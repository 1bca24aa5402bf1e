"""Issue large batch-copy calls from a per-device thread, keeping the caller's stream order.

``cuMemcpyBatchAsync`` holds the calling thread about 0.4 µs per descriptor while the
driver builds its work (2.1 ms at 5,120 descriptors, measured on an H200), and an engine
calls from the thread that launches its model: the next launch waits for the whole call.
kvswap keeps the engine's thread to at most 100 µs + 10 ns per descriptor by handing a
large batch to an *issuer* thread, one per device, while the copy still behaves as if it
had been enqueued on the caller's stream at the moment of the call:

1. On the caller's thread (a few µs, plus one copy of the descriptor arrays):
   record an event on the caller's stream (the work queued before the copy), take the
   next sequence number ``seq``, enqueue ``cuStreamWaitValue32(flag >= seq)`` on the
   caller's stream, and queue the job. Work the caller enqueues afterwards waits for the
   flag, so it sees the copied bytes; a device-to-host copy reads sources only after the
   work recorded by the event.
2. On the issuer thread, in sequence order, on the issuer's own stream:
   ``cuStreamWaitEvent`` (the caller's prior work), the batch call, then
   ``cuStreamWriteValue32(flag, seq)``. The flag is one 32-bit word of pinned,
   device-mapped host memory; the wait compares cyclically (``GEQ``: ``(int32)(flag -
   seq) >= 0``), so sequence numbers may wrap.

One issuer stream executes jobs in order, so the flag only grows and a wait on ``seq``
also covers every earlier job, whichever stream asked for it. A job depends only on work
its caller queued before it, and that work can only wait for earlier sequence numbers:
the streams cannot wait for each other in a cycle.

A driver error on the issuer thread never leaves a stream waiting: the flag is still
written on the issuer stream after the failed call (in order, so earlier jobs keep their
guarantee); should even that enqueue fail, the thread waits for its stream, then writes
the word from the host.
The error is kept on the job (:class:`Ticket`), which a BlockMover collects
(:mod:`kvswap.registry.deferred`) and reports as a failed job once its stream passed it; a
failure nobody reported is raised by the owner's next call (:class:`IssuedCopy`), which
then copies nothing; the call after that works again.

The descriptor arrays are copied on the caller's thread (24 bytes a descriptor, a few ns
each) and held by the job until the issuer's driver call has returned, because the batch
call reads them during the call and the caller may reuse its arrays as soon as it
returns; a caller that keeps them until its stream passed the job (BlockMover, through
``kvswap.registry.deferred.collect(stable=True)``) saves the copy. Events go back to their pool only after ``cuStreamWaitEvent`` captured them.

The issuer is opt-in: ``KVSWAP_CUDA_ISSUER=on`` sends batches from the thresholds of
:data:`ASYNC_MIN` (smaller ones, whose synchronous call fits the budget, stay on the
caller's thread), a number sets the threshold in descriptors, and unset or ``off`` keeps
every call on the caller's thread. The thread needs the GIL only to take a job from the queue and
to enter the driver call (ctypes releases it during the call). Threads stop at exit
after issuing every queued job; a closed issuer makes callers copy synchronously again.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from kvswap.registry import deferred
from kvswap.errors import ConfigurationError, DriverError

from . import driver as drv

# Descriptors from which a call goes to the issuer thread: the synchronous batch call
# costs ~15 µs + 0.42 µs a descriptor (H200, 16 KiB blocks: 42 µs at 64, 446 µs at 1,024),
# so it fits 100 µs + 10 ns a descriptor up to ~200; handing off costs ~10-20 µs.
# The per-copy path (one cuMemcpyAsync, ~2 µs each) leaves the thread sooner.
ASYNC_MIN = {"batch": 128, "per-copy": 16}
ENV = "KVSWAP_CUDA_ISSUER"

CU_EVENT_DISABLE_TIMING = 0x2
CU_STREAM_NON_BLOCKING = 0x1
CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WRITE_VALUE_DEFAULT = 0x0
CU_MEMHOSTALLOC_PORTABLE = 0x1
CU_MEMHOSTALLOC_DEVICEMAP = 0x2
SEQ_MASK = 0xFFFFFFFF

_p, _u32, _u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
_R = drv.CUresult
# (symbol, CUDA version asked for, prototype). The stream memory operations are asked for
# at 12.0, which returns their _v2 forms, usable without a driver module parameter.
PROTOS = {
    "event_create": ("cuEventCreate", 2000, ctypes.CFUNCTYPE(_R, ctypes.POINTER(_p), ctypes.c_uint)),
    "event_record": ("cuEventRecord", 2000, ctypes.CFUNCTYPE(_R, _p, _p)),
    "event_destroy": ("cuEventDestroy", 4000, ctypes.CFUNCTYPE(_R, _p)),
    "stream_create": ("cuStreamCreate", 2000, ctypes.CFUNCTYPE(_R, ctypes.POINTER(_p), ctypes.c_uint)),
    "stream_wait_event": ("cuStreamWaitEvent", 3020, ctypes.CFUNCTYPE(_R, _p, _p, ctypes.c_uint)),
    "stream_synchronize": ("cuStreamSynchronize", 2000, ctypes.CFUNCTYPE(_R, _p)),
    "wait_value32": ("cuStreamWaitValue32", 12000, ctypes.CFUNCTYPE(_R, _p, _u64, _u32, ctypes.c_uint)),
    "write_value32": ("cuStreamWriteValue32", 12000, ctypes.CFUNCTYPE(_R, _p, _u64, _u32, ctypes.c_uint)),
    "host_alloc": ("cuMemHostAlloc", 3020, ctypes.CFUNCTYPE(_R, ctypes.POINTER(_p), ctypes.c_size_t, ctypes.c_uint)),
    "host_device_pointer": ("cuMemHostGetDevicePointer", 3020,
                            ctypes.CFUNCTYPE(_R, ctypes.POINTER(_u64), _p, ctypes.c_uint)),
}


def async_min(path: str, env: Optional[str] = None) -> Optional[int]:
    """The smallest batch issued off the caller's thread on ``path``, or None (issuer off).

    ``env`` is ``KVSWAP_CUDA_ISSUER``'s value: ``on`` for the thresholds of
    :data:`ASYNC_MIN`, a descriptor count, or unset / empty / ``off`` / ``0`` to copy every
    batch on the caller's thread. Off by default: it makes a known driver crash more
    frequent (a fault inside ``cuMemcpyBatchAsync`` on batches that mix many block sizes,
    on the caller's thread too; ``tests/bench/repro_batch_crash.py``).
    """
    env = os.environ.get(ENV, "") if env is None else env
    text = env.strip().lower()
    if text == "on":
        return ASYNC_MIN[path]
    if text in ("", "off", "0", "no", "false"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigurationError(
            f"{ENV}={env!r} must be 'off' or a descriptor count >= 1 (the smallest batch issued "
            f"from the per-device thread)"
        )
    return value


def seq_reached(flag: int, seq: int) -> bool:
    """What ``cuStreamWaitValue32(GEQ)`` waits for: ``(int32)(flag - seq) >= 0``."""
    return ((flag - seq) & SEQ_MASK) < 0x80000000


class StreamOps:
    """The driver calls an issuer makes, bound once from a :class:`~.driver.Driver`."""

    def __init__(self, driver: drv.Driver) -> None:
        self.error = driver.error
        for attr, (symbol, version, proto) in PROTOS.items():
            setattr(self, attr, driver.proc(symbol, version, proto))

    def check(self, call: str, rc: int) -> None:
        if rc:
            raise self.error(call, rc)


@dataclass(eq=False)
class Ticket:
    """One job handed to an issuer: its sequence number, and once ``done`` is set, the
    error its driver calls raised (None: issued)."""

    seq: int
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[BaseException] = None
    reported: bool = False  # the failure already reached a job (kvswap.registry.deferred.failure)


@dataclass(eq=False)
class _Job:
    ticket: Ticket
    event: int
    issue: Callable[[int], None]
    keep: Any  # what the driver call reads: alive until it returned
    on_error: Optional[Callable[[Ticket], None]]


class FlagWord:
    """One 32-bit word of pinned host memory the device can read and write."""

    def __init__(self, ops: StreamOps) -> None:
        host = _p()
        ops.check("cuMemHostAlloc", ops.host_alloc(ctypes.byref(host), 64,
                                                   CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP))
        dev = _u64()
        ops.check("cuMemHostGetDevicePointer", ops.host_device_pointer(ctypes.byref(dev), host, 0))
        self.host = int(host.value)
        self.device = int(dev.value)
        self._word = _u32.from_address(self.host)
        self._word.value = 0

    @property
    def value(self) -> int:
        return int(self._word.value)

    def release_to(self, seq: int) -> None:
        """Write ``seq`` from the host unless the word is already at or past it."""
        if not seq_reached(self.value, seq):
            self._word.value = seq & SEQ_MASK


class Issuer:
    """A thread and a stream of one device that issue queued copy jobs in order.

    :param ops: the driver calls (:class:`StreamOps`).
    :param context: the device's :class:`~.driver.ContextGuard`; the thread makes it current.
    :param name: for the thread's name and messages.
    """

    def __init__(self, ops: StreamOps, context: Optional[drv.ContextGuard], name: str = "cuda") -> None:
        self.ops = ops
        self.name = name
        self._context = context
        self._lock = threading.Lock()
        self._queue: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()
        self._events: deque[int] = deque()
        self._seq = 0
        self._thread: Optional[threading.Thread] = None
        self.closed = False
        self.queued = 0  # jobs queued and issued so far (counts; sequence numbers wrap)
        self.issued = 0
        self._idle = threading.Condition()
        pushed = context.enter() if context is not None else False
        try:
            self.flag = FlagWord(ops)
            stream = _p()
            ops.check("cuStreamCreate", ops.stream_create(ctypes.byref(stream), CU_STREAM_NON_BLOCKING))
            self.stream = int(stream.value or 0)
        finally:
            if pushed:
                context.exit()

    @property
    def seq(self) -> int:
        """The sequence number of the latest job queued (0: none yet)."""
        return self._seq

    def submit(self, caller_stream: int, issue: Callable[[int], None], keep: Any = None,
               on_error: Optional[Callable[[Ticket], None]] = None) -> Optional[Ticket]:
        """Queue ``issue(issuer_stream)`` to run as if enqueued on ``caller_stream`` now.

        Call with the device's context current. Returns the job's :class:`Ticket`, or None
        when the issuer is closed (the caller then copies itself). ``keep`` is held until
        ``issue`` has returned; ``on_error(ticket)`` runs on the issuer thread when the
        job's driver calls failed. Raises :class:`DriverError` when the caller's stream
        refuses the event or the wait; nothing is queued then.
        """
        ops = self.ops
        with self._lock:
            if self.closed:
                return None
            event = self._events.popleft() if self._events else self._new_event()
            rc = ops.event_record(event, caller_stream)
            if rc:
                self._events.append(event)
                raise ops.error("cuEventRecord", rc)
            seq = (self._seq + 1) & SEQ_MASK
            rc = ops.wait_value32(caller_stream, self.flag.device, seq, CU_STREAM_WAIT_VALUE_GEQ)
            if rc:
                # The event's record is harmless: nothing waits for it.
                self._events.append(event)
                raise ops.error("cuStreamWaitValue32", rc)
            self._seq = seq
            self.queued += 1
            ticket = Ticket(seq)
            self._queue.put(_Job(ticket, event, issue, keep, on_error))
            if self._thread is None:
                self._start()
        return ticket

    def _new_event(self) -> int:
        ev = _p()
        self.ops.check("cuEventCreate", self.ops.event_create(ctypes.byref(ev), CU_EVENT_DISABLE_TIMING))
        return int(ev.value)

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"kvswap-issuer-{self.name}", daemon=True)
        self._thread.start()
        _live.add(self)

    def _run(self) -> None:
        if self._context is not None:
            try:
                self._context.enter()  # stays current for the thread's life
            except BaseException:
                pass  # each job's first call then reports the context error
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._issue(job)

    def _issue(self, job: _Job) -> None:
        ops, ticket, stream = self.ops, job.ticket, self.stream
        try:
            rc = ops.stream_wait_event(stream, job.event, 0)
            if rc:  # unordered after the caller's prior work: must not copy
                raise ops.error("cuStreamWaitEvent", rc)
            job.issue(stream)
        except BaseException as e:
            ticket.error = e
        self._events.append(job.event)  # captured (or unused): free to record again
        job.keep = None
        if ticket.error is not None:
            _tell(job)  # before the flag: whoever sees the stream pass the job sees the failure
        rc = ops.write_value32(stream, self.flag.device, ticket.seq, CU_STREAM_WRITE_VALUE_DEFAULT)
        if rc:
            # The stream cannot release the waiters: the host does, once the earlier jobs
            # are done (or the stream has failed for good), so they keep their guarantee.
            ops.stream_synchronize(stream)
            self.flag.release_to(ticket.seq)
            if ticket.error is None:
                ticket.error = ops.error("cuStreamWriteValue32", rc)
                _tell(job)
        ticket.done.set()
        with self._idle:
            self.issued += 1
            self._idle.notify_all()

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Issue every queued job, then stop the thread. Idempotent; later submits return None."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            thread = self._thread
            if thread is not None:
                self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        _live.discard(self)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Wait until every job queued so far has been issued (enqueued by the issuer
        thread, not necessarily copied); True if so within ``timeout`` seconds."""
        with self._idle:
            target = self.queued
            return self._idle.wait_for(lambda: self.issued >= target, timeout)


def _tell(job: _Job) -> None:
    if job.on_error is not None:
        try:
            job.on_error(job.ticket)
        except BaseException:  # the owner's bookkeeping must not stop the thread
            pass


_live: "set[Issuer]" = set()
_by_device: dict[tuple[int, int], Issuer] = {}
_by_device_lock = threading.Lock()


def for_device(driver: drv.Driver, device_index: int, context: Optional[drv.ContextGuard]) -> Issuer:
    """The process's issuer for ``device_index`` on ``driver`` (made on first use)."""
    key = (id(driver), int(device_index))
    with _by_device_lock:
        issuer = _by_device.get(key)
        if issuer is None or issuer.closed:
            issuer = _by_device[key] = Issuer(StreamOps(driver), context, name=f"cuda:{device_index}")
        return issuer


def shutdown() -> None:
    """Stop every issuer thread after it issued its queued jobs (runs at exit)."""
    for issuer in list(_live):
        issuer.close()
    with _by_device_lock:
        _by_device.clear()


atexit.register(shutdown)
if hasattr(os, "register_at_fork"):
    # A child has no issuer threads: let it make its own.
    os.register_at_fork(after_in_child=lambda: (_live.clear(), _by_device.clear()))


class IssuedCopy:
    """``cuda.batch``'s callable with large batches issued from the device's issuer thread.

    Wraps a bound :class:`~.batch.BatchCopy`; a batch of at least ``threshold[path]``
    descriptors goes to ``issuer`` (made on first need by ``make_issuer``), smaller ones
    and everything after the issuer closed are copied on the caller's thread as before.
    A job that failed on the issuer thread is raised by the next call, which copies
    nothing; the call after that copies again.
    """

    def __init__(self, inner: Any, make_issuer: Callable[[], Issuer],
                 threshold: Optional[dict[str, Optional[int]]] = None) -> None:
        self.inner = inner
        self._make_issuer = make_issuer
        self._issuer: Optional[Issuer] = None
        self.threshold = {p: async_min(p) for p in ASYNC_MIN} if threshold is None else dict(threshold)
        self._failed: deque[Ticket] = deque()
        self.last_ticket: Optional[Ticket] = None
        self.last_issued: Optional[str] = None  # "caller" or "issuer"
        self.note = inner.note + self._describe()

    def _describe(self) -> str:
        on = {p: n for p, n in self.threshold.items() if n is not None}
        if not on:
            return f"; every call copies on the caller's thread ({ENV}=off)"
        sizes = ", ".join(f"{p} >= {n}" for p, n in on.items())
        return (f"; large batches ({sizes} descriptors) are issued from a per-device thread ordered on the "
                f"caller's stream by an event and a stream wait, so the caller's thread is not held")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @property
    def issuer(self) -> Optional[Issuer]:
        return self._issuer

    def __call__(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any = None) -> None:
        if self._failed:
            self._raise_failed()
        count = len(sizes)
        if count == 0:
            return
        from kvswap.registry.streams import raw_handle

        inner = self.inner
        handle = raw_handle(stream, inner.device_index)
        path = inner.path_for(handle)
        limit = self.threshold.get(path)
        if limit is None or count < limit or not self._offload(src, dst, sizes, handle, path):
            self.last_issued = "caller"
            inner(src, dst, sizes, handle)

    def _offload(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, handle: int, path: str) -> bool:
        inner = self.inner
        issuer = self._issuer
        if issuer is None:
            issuer = self._issuer = self._make_issuer()
        if issuer.closed:
            return False
        if deferred.arrays_stable():  # the caller keeps them until its stream passed the job
            desc = (src, dst, sizes)
        else:  # the caller may reuse its arrays at once: the job copies them (~3 ns each)
            desc = np.empty((3, len(sizes)), dtype=np.int64)
            desc[0], desc[1], desc[2] = src, dst, sizes
        copy = inner._copy_batch if path == "batch" else inner._copy_each

        def issue(issuer_stream: int) -> None:
            copy(desc[0], desc[1], desc[2], issuer_stream)

        context = getattr(inner, "_context", None)
        pushed = context.enter() if context is not None else False
        try:
            ticket = issuer.submit(handle, issue, keep=desc, on_error=self._failed.append)
        finally:
            if pushed:
                context.exit()
        if ticket is None:
            return False
        deferred.report(ticket)  # a BlockMover job learns of a failure when it completes
        inner.last_path = path
        self.last_ticket, self.last_issued = ticket, "issuer"
        return True

    def _raise_failed(self) -> None:
        tickets = [t for t in self._failed if not t.reported]  # not yet reported as a failed job
        self._failed.clear()
        if not tickets:
            return
        first = tickets[0]
        more = f" (and {len(tickets) - 1} later one(s))" if len(tickets) > 1 else ""
        raise DeferredDriverError(first, more)


class DeferredDriverError(DriverError):
    """A batch issued from the issuer thread failed; raised by the owner's next call,
    which then copies nothing. ``ticket`` is the failed job, ``cause`` its error."""

    def __init__(self, ticket: Ticket, more: str = "") -> None:
        cause = ticket.error
        code = getattr(cause, "code", -1)
        super().__init__(
            getattr(cause, "call", type(cause).__name__), code, getattr(cause, "name", None),
            f"an earlier batch (issuer job {ticket.seq}){more} was not copied: {cause}; this call copied nothing",
            getattr(cause, "index", None),
        )
        self.ticket = ticket
        self.__cause__ = cause


def issued(inner: Any, driver: drv.Driver) -> Any:
    """``inner`` (a bound BatchCopy) with large batches issued off the caller's thread,
    or ``inner`` itself where ``KVSWAP_CUDA_ISSUER=off``."""
    threshold = {p: async_min(p) for p in ASYNC_MIN}
    if all(v is None for v in threshold.values()):
        return inner
    context = getattr(inner, "_context", None)
    return IssuedCopy(inner, lambda: for_device(driver, inner.device_index, context), threshold)
