"""A per-mover thread that issues jobs in submission order, off the engine's thread.

``BlockMover.submit`` on a device mover does only O(blocks) work on the caller's thread
(id checks, the stream wait for ``after``) and hands the job to this thread, which issues
it (:func:`kvswap.mover.run.run`: its addresses, its markers, the copy route's call). One
thread per mover, one queue, first in first out: the transfer stream sees the jobs' copies
in the order they were submitted.

The thread holds only its queue, a condition and the ``issue`` callable (which must not
reference the mover): a mover nobody closed is still collected, and collecting it stops the
thread. A job is *issued* once ``issue`` returned; ``issue`` never raises (it keeps the
error on the job), and the thread survives anything it does raise. At interpreter exit the
thread issues what is queued, then stops.

The GIL: the thread's Python and numpy work competes with the engine's thread for it;
ctypes driver calls and numpy's larger loops release it.
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Callable, Optional

_STOP = object()
# While waiting for a job to be issued, how often to check that the thread still runs.
_ALIVE_CHECK_S = 0.5


class IssuingThread:
    """Run ``issue(job)`` for every job :meth:`put` on one daemon thread, in order.

    ``issue`` must set ``job.end`` (anything but None) when it is done with the job:
    that is what :meth:`wait_issued` and the owner's completion checks look at.

    :param issue: what to do with each job; must not hold a reference to the owner.
    :param abandon: ``abandon(job, error)`` ends a job ``issue`` left unended (it raised,
        or the thread was gone): fails it and sets ``job.end``.
    :param name: the thread's name.
    :param prepare: called once on the thread before the first job (binding a device
        context, say); what it raises is ignored (the jobs then report the failure).
    """

    def __init__(self, issue: Callable[[Any], None], abandon: Callable[[Any, Any], None],
                 name: str = "kvswap-issuing", prepare: Optional[Callable[[], None]] = None) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._issued = threading.Condition()
        self._abandon = abandon
        self._thread = threading.Thread(target=_run, args=(self._queue, self._issued, issue, abandon, prepare),
                                        name=name, daemon=True)
        self._thread.start()
        # Collected (or the interpreter exits) without stop(): issue what is queued, then end.
        self._finalizer = weakref.finalize(self, _shutdown, self._queue, self._thread)

    def put(self, job: Any) -> None:
        """Queue ``job`` behind every job queued before it."""
        self._queue.put(job)

    def wait_issued(self, job: Any) -> None:
        """Block until ``issue(job)`` has returned. Should the thread be gone first (the
        interpreter is exiting), the job is failed here so no caller waits forever.

        :raises RuntimeError: called on the thread itself (a mover collected there), which
            would wait for itself.
        """
        if job.end is not None:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError("the issuing thread cannot wait for a job it has not issued yet")
        with self._issued:
            while job.end is None:
                if not self._thread.is_alive():
                    self._abandon(job, "RuntimeError: the issuing thread stopped before the job was issued")
                    return
                self._issued.wait(_ALIVE_CHECK_S)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Issue every job queued so far, then end the thread and join it (not when called
        from the thread itself). Idempotent."""
        self._finalizer()


def _run(jobs: queue.SimpleQueue, issued: threading.Condition, issue: Callable[[Any], None],
         abandon: Callable[[Any, Any], None], prepare: Optional[Callable[[], None]]) -> None:
    if prepare is not None:
        try:
            prepare()
        except Exception:
            pass
        prepare = None
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        try:
            issue(job)
        except BaseException as e:  # issue() keeps its errors; this is the last guard
            if job.end is None:
                abandon(job, e)
            del e
        finally:
            if job.end is None:
                abandon(job, "RuntimeError: the job was not issued")
            with issued:
                issued.notify_all()
        del job  # hold no job (nor what it references) while waiting for the next one


def _shutdown(jobs: queue.SimpleQueue, thread: threading.Thread, timeout: Optional[float] = 30.0) -> None:
    jobs.put(_STOP)
    if thread is not threading.current_thread():
        thread.join(timeout)
