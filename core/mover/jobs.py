"""A BlockMover's jobs from ``submit`` to their results: in flight in submission order (one
transfer stream, so they complete in that order), handed to the issuing thread or issued on
the caller's, then reported once each."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Union

from ..memory.bounce import Bounced
from ..memory.pinned_pool import DescriptorBuffer
from .issuing import IssuingThread
from .plan import Plan
from .run import run
from .types import TransferResult

# The error of a job whose submit an interrupt cut short after it may have enqueued a copy.
INTERRUPTED = "KeyboardInterrupt: submit was interrupted; the job may have copied some of its blocks"


@dataclass(eq=False, slots=True)
class Job:
    job_id: int
    nbytes: int
    descriptors: int  # as the route receives them (after coalescing, once built)
    ids: Any  # the checked ids, until the job is issued
    here: bool  # issued on the caller's thread (else handed to the issuing thread)
    start: Any = None  # the start marker, recorded once the job's addresses are ready
    end: Any = None  # None until issued: the end marker, recorded after the copy call
    buffer: Optional[DescriptorBuffer] = None  # the job's descriptors, until its end marker passed
    bounced: Optional[Bounced] = None
    error: Optional[Union[BaseException, str]] = None


def abandon(job: Job, error: Any, c: Any) -> None:
    """End a job its issue left unended: failed, complete once whatever it enqueued (all
    before its start marker, if it has one) has run."""
    job.error = job.error or error
    if job.start is None:
        job.start = c.unrecorded()
    job.end = job.start


def complete(job: Job, c: Any) -> bool:
    """Issued and past its end marker (checked in that order: an event never recorded
    reads as complete)."""
    return job.end is not None and c.done(job.end)


def result(job: Job, c: Any) -> TransferResult:
    """The result of a complete job; its markers go back to ``c``."""
    e = job.error
    b = job.bounced
    if e is None and b is not None and b.finish is not None:
        e = b.finish.exception()  # the copy out to pageable memory
    if job.end is job.start:  # nothing was enqueued, or no end marker could be recorded
        seconds = 0.0
        c.recycle(job.start)
    else:
        seconds = c.seconds(job.start, job.end)
        c.recycle(job.start, job.end)
    error = None if e is None else e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return TransferResult(job.job_id, error is None, job.nbytes if error is None else 0, seconds,
                          job.descriptors, error)


class Jobs:
    """The jobs of one mover: those in flight, oldest first, the results not yet polled,
    the next job id, and the issuing thread, started on the first job handed to it.

    A job exists from :meth:`add` on; its id is used once :meth:`settle` has run for it,
    which ``submit`` ends with and every later call on the mover repeats (an interrupt may
    have cut the hand-off short: each step may then run twice, and the thread issues a job
    it is given twice once).
    """

    def __init__(self, plan: Plan, name: str) -> None:
        self.plan = plan
        self.name = name
        self.inflight: deque[Job] = deque()
        self.results: deque[TransferResult] = deque()
        self.next_id = 1
        self.thread: Optional[IssuingThread] = None
        self.last_handed: Optional[Job] = None  # the last job given to the issuing thread

    def add(self, ids: list, nbytes: int, descriptors: int, here: bool) -> Job:
        """A new job, in flight from here on; one for the issuing thread is handed over."""
        job = Job(self.next_id, nbytes, descriptors, ids, here)
        self.inflight.append(job)
        if not here:
            self.settle()
        return job

    def drop(self, job: Job) -> None:
        """Forget the newest job, which enqueued nothing (it failed before its call, on the
        caller's thread): its id is not used, what it held goes back."""
        assert self.inflight[-1] is job and job.job_id == self.next_id
        self.inflight.pop()
        self.plan.completion.recycle(job.start)
        if job.buffer is not None:
            self.plan.descriptors.pool.release(job.buffer)
        if job.bounced is not None:
            self.plan.bounce.release(job.bounced)

    def settle(self) -> None:
        """Finish the hand-off of the newest job where ``submit`` did not."""
        q = self.inflight
        if not q or q[-1].job_id < self.next_id:
            return
        job = q[-1]
        if not job.here:
            self.last_handed = job
            if job.ids is not None and job.end is None:  # not yet taken by the thread
                (self.thread or self._start()).put(job)
        elif job.end is None:  # cut short on the caller's thread: whatever it enqueued ends before this marker
            job.error = job.error or INTERRUPTED
            end = self.plan.completion.mark()
            job.start = job.start if job.start is not None else end
            job.end = end
        self.next_id = job.job_id + 1

    def thread_idle(self) -> bool:
        last = self.last_handed
        return last is None or last.end is not None

    def tidy(self) -> None:
        """Settle, and hand back what the oldest job held once it is complete (a cheap check
        first: most submits find nothing to reap)."""
        q = self.inflight
        if q and q[-1].job_id >= self.next_id:
            self.settle()
        if q and complete(q[0], self.plan.completion):
            self.reap()

    def reap(self) -> None:
        """Report the complete jobs and hand back their buffers; jobs complete in order on
        one stream."""
        self.settle()
        q, c, plan = self.inflight, self.plan.completion, self.plan
        while q and complete(q[0], c):
            job = q[0]
            b = job.bounced
            if b is not None and b.finish is not None and not b.finish.done():
                break  # the device copy is done, the copy out to pageable memory is not yet
            q.popleft()
            self.results.append(result(job, c))
            if job.buffer is not None:
                plan.descriptors.pool.release(job.buffer)
            if b is not None:
                plan.bounce.release(b)

    def find(self, job_id: Optional[int]) -> Optional[Job]:
        """The in-flight job ``job_id`` (None: the last one), or None if it has completed;
        ``job_id`` was checked to be one of this mover's."""
        self.settle()
        q = self.inflight
        if not q:
            return None
        k = len(q) - 1 if job_id is None else int(job_id) - q[0].job_id
        return q[k] if k >= 0 else None  # otherwise already complete: in-flight ids are consecutive

    def wait_issued(self, job: Job) -> None:
        if job.end is None:
            self.thread.wait_issued(job)

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()

    def _start(self) -> IssuingThread:
        plan = self.plan  # the thread holds the plan, never the mover: a mover nobody closed is still collected
        self.thread = IssuingThread(lambda job: run(job, plan), lambda job, e: abandon(job, e, plan.completion),
                                    name=self.name, prepare=plan.completion.bind_thread)
        return self.thread
