"""How a BlockMover's jobs end: ``poll``, ``wait``, ``close``, and the buffers handed back."""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import InvalidTransferError
from . import process
from .jobs import Job, complete, result
from .serial import forked, serialized
from .types import TransferResult


class Results:
    """Completion, results and shutdown (part of :class:`~kvswap.BlockMover`)."""

    @serialized
    def poll(self) -> list[TransferResult]:
        """Results of the jobs that completed since the last poll, in submission order.

        Each job is reported exactly once (jobs :meth:`wait` waited for included).
        """
        self._reap()
        out = list(self._results)
        self._results.clear()
        return out

    def wait(self, job_id: Optional[int] = None) -> None:
        """Block until job ``job_id`` (None: every submitted job) has completed.

        :raises InvalidTransferError: ``job_id`` was never returned by this mover's submit.
        """
        if self._pid != process.pid:
            raise forked(self)
        with self._lock:  # not held while waiting: other threads may submit and poll meanwhile
            job = self._find(job_id)
        if job is not None:
            if job.end is None:
                self._issuer.wait_issued(job)
            self._completion.wait(job.end)
            if job.staged is not None and job.staged.finish is not None:
                job.staged.finish.exception()  # copied out (or failed: poll reports it)
            with self._lock:
                self._reap()

    def wait_issued(self, job_id: Optional[int] = None) -> None:
        """Block until job ``job_id`` (None: every submitted job) is enqueued on the
        transfer stream; it may still be copying. After this, work ordered after the
        transfer stream (``stream.wait_stream(mover.stream)``) runs after the job; before
        it, a job left to the issuing thread may not be on the stream yet.

        :raises InvalidTransferError: ``job_id`` was never returned by this mover's submit.
        """
        if self._pid != process.pid:
            raise forked(self)
        with self._lock:
            job = self._find(job_id)
        if job is not None and job.end is None:
            self._issuer.wait_issued(job)

    def _find(self, job_id: Optional[int]) -> Optional[Job]:
        """The in-flight job ``job_id`` (None: the last one), or None if it has completed."""
        self._settle()
        q = self._inflight
        if job_id is not None:
            if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)) or not 1 <= job_id < self._next_id:
                raise InvalidTransferError(
                    f"job_id={job_id!r} was not returned by this mover's submit() (ids so far: 1..{self._next_id - 1})"
                )
        if not q:
            return None
        k = len(q) - 1 if job_id is None else int(job_id) - q[0].job_id
        return q[k] if k >= 0 else None  # otherwise already complete: in-flight ids are consecutive

    def close(self) -> None:
        """Refuse further submits, wait for every job, then stop the issuing thread.
        Results stay available to :meth:`poll`. Idempotent, and, interrupted while it
        waits, it may be called again; also what leaving a ``with`` block does. In a child
        made by ``fork()`` it only marks the mover closed: the parent's work is not the
        child's to wait for."""
        if self._pid != process.pid:
            self._closed = True
            return
        with self._lock:
            if self._closed and not getattr(self, "_inflight", None):
                return
            self._closed = True
        try:
            self.wait()
        finally:
            if self._issuer is not None:
                self._issuer.stop()
        with self._lock:
            self.pool.clear()
            if self._stager is not None:
                self._stager.close()
            self._tensors = None

    def __del__(self) -> None:
        if getattr(self, "_pid", None) != process.pid:
            return  # a forked child's copy (or never built): nothing of it is this process's to wait for
        # The device may still read descriptors or tensors of jobs nobody waited for (a
        # close() that was interrupted included).
        try:
            if getattr(self, "_inflight", None):
                self.wait()
        except Exception:
            pass
        issuer = getattr(self, "_issuer", None)
        if issuer is not None:
            issuer.stop()


    def _reap(self) -> None:
        """Hand back the buffers of completed jobs; jobs complete in order on one stream."""
        self._settle()
        q, c = self._inflight, self._completion
        while q and complete(q[0], c):
            job = q[0]
            st = job.staged
            if st is not None and st.finish is not None and not st.finish.done():
                break  # the device copy is done, the copy out to pageable memory is not yet
            q.popleft()
            self._results.append(result(job, c))
            if job.buffer is not None:
                self.pool.release(job.buffer)
            if st is not None:
                self._stager.release(st)
