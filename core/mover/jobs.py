"""A BlockMover job from ``submit`` to its result: what the issuing thread does with it
(:mod:`kvswap.mover.issuing`), when it is complete, and what its result says."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..memory.pinned_pool import DescriptorBuffer
from ..memory.staging import Staged
from ..registry import deferred
from ..resolution.swapfn import SwapFn
from .descriptors import JobDescriptors
from .types import TransferResult


@dataclass(eq=False, slots=True)
class Job:
    job_id: int
    nbytes: int
    start: Any
    end: Any = None  # None until issued: the end marker, recorded after the copy call
    buffer: Optional[DescriptorBuffer] = None
    descriptors: int = 0
    error: Optional[str] = None
    staged: Optional[Staged] = None
    issued: Optional[list] = None  # work left to other threads (kvswap.registry.deferred), once issued
    ids: Any = None  # the checked ids, until the issuing thread builds the job
    fn: Any = None  # the SwapFn of the route this job takes instead of the mover's (``within``)
    within: Optional[float] = None  # seconds beside compute, where the issuing thread picks ``fn``
    thread: bool = False  # handed to the issuing thread (else issued on the caller's thread)


def complete(job: Job, c: Any) -> bool:
    """Issued and past its end marker (checked in that order: an event never recorded
    reads as complete)."""
    return job.end is not None and c.done(job.end)


def result(job: Job, c: Any) -> TransferResult:
    """The result of a complete job; its markers go back to ``c``."""
    error = job.error
    late = deferred.failure(job.issued) if job.issued else None
    if late is not None and error is None:  # failed on another thread, after submit
        error = f"{type(late).__name__}: {late}"
    st = job.staged
    if error is None and st is not None and st.finish is not None and st.finish.exception() is not None:
        e = st.finish.exception()
        error = f"{type(e).__name__}: {e}"
    if job.end is job.start:  # no end marker could be recorded
        seconds = 0.0
        c.recycle(job.start)
    else:
        seconds = c.seconds(job.start, job.end)
        c.recycle(job.start, job.end)
    return TransferResult(job.job_id, error is None, job.nbytes if error is None else 0, seconds,
                          job.descriptors, error)


def issue_with(desc: JobDescriptors, fn: SwapFn, c: Any,
               choose: Callable[[int, float], Optional[SwapFn]]) -> Callable[[Job], None]:
    """What the issuing thread does with each job (it holds no reference to the mover):
    pick the route for the job's ``within`` (``choose``), build, call the route with the
    mover's device current, record the end marker, also after a failure (part of a batch
    may be enqueued). Errors stay on the job."""

    def issue(job: Job) -> None:
        if job.ids is None:  # handed over twice (an interrupted submit's hand-off, redone): issued already
            return
        ids, job.ids = job.ids, None
        error = None
        with c.device_guard():
            try:
                if job.fn is None and job.within is not None:
                    job.fn = choose(len(ids[0][0]), job.within)
                by_ids = desc.by_ids(ids) if job.fn is None and desc.ids_steps is not None else None
                buf, m = desc.build(ids) if by_ids is None else desc.ids_buffer(ids)
                job.buffer, job.descriptors = buf, m
                # The buffer is the job's until its end marker (collect(stable=True)).
                arr = buf.array
                with deferred.collect(stable=True) as job.issued:
                    if by_ids is not None:
                        n = len(ids[0][0])
                        try:
                            by_ids(arr[0, :n], arr[1, :n], c.stream)
                        except Exception as e:
                            raise desc.failed(e, ids)
                    elif m:  # coalesced by build(): the SwapFn need not look for runs again
                        (job.fn or fn).call_built(arr[0, :m], arr[1, :m], arr[2, :m], c.stream)
            except BaseException as e:
                error = f"{type(e).__name__}: {e}"
            try:
                end = c.mark()
            except BaseException as e:
                error, end = error or f"{type(e).__name__}: {e}", job.start
        job.error = error
        job.end = end  # last: from here on, the engine's thread reads the job as issued

    return issue


def wait_from_worker(c: Any, marker: Any) -> None:
    with c.device_guard():  # the worker thread's current device is the mover's
        c.wait(marker)
