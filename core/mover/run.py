"""How a BlockMover job is issued: the one function that calls a copy route.

``submit`` checks a job's ids, orders the transfer stream after ``after`` and then either
calls :func:`run` itself or hands the job to the mover's issuing thread, which calls it
(:mod:`kvswap.mover.issuing`). Whichever thread it runs on, a job takes the same steps.
"""
from __future__ import annotations

from typing import Any

from ..registry.failures import copy_failure
from .plan import Plan


def run(job: Any, plan: Plan) -> None:
    """Issue ``job`` on the transfer stream, with the mover's device current:

    1. *address*: the ids packed where the by-id transfer reads them, or the descriptors
       built (unless ``submit`` built them to check them) and, for pageable host memory,
       pointed at bounce buffers;
    2. *start marker*: the job's time on the stream starts once its addresses are ready;
    3. *call*: the by-id launch or the route's call (a kernel launch, a driver batch call);
    4. *end marker*, recorded after a failed call too: part of a batch may be enqueued.

    What fails stays on the job (``job.error``), and its ids are dropped; what a by-id
    transfer's own code raises is kept as kvswap's error naming its implementation
    (:func:`~kvswap.registry.failures.copy_failure`; the route's call does the same). Only a
    failure of the end marker escapes (an interrupt): on the caller's thread the mover ends
    the job on its next call, on the issuing thread the thread abandons it.
    """
    c = plan.completion
    ids, job.ids = job.ids, None
    if ids is None:  # handed to the thread twice (an interrupted submit's hand-off, redone): issued already
        return
    launch = None
    backend = ""  # the implementation whose own code runs, while a by-id transfer is called
    with c.device_guard():
        try:
            by_ids, name = plan.by_ids(ids)
            if by_ids is not None:
                (sid, did), = ids
                backend = name
                launch = by_ids.pack(sid, did)
                backend = ""
            else:
                if job.buffer is None:
                    job.buffer, job.descriptors = plan.descriptors.build(ids)
                if plan.bounce is not None:
                    job.bounced = plan.bounce.bounce(job.buffer.array, job.descriptors)
            job.start = c.mark()
            if launch is not None:
                go, launch, backend = launch, None, name
                go(c.stream)
                backend = ""
            elif job.descriptors:  # coalesced by build(): the SwapFn need not look for runs again
                arr, m = job.buffer.array, job.descriptors
                plan.fn.call_built(arr[0, :m], arr[1, :m], arr[2, :m], c.stream)
        except BaseException as e:
            if launch is not None:  # packed, never launched
                launch.cancel()
            job.error = copy_failure(e, backend) if backend and isinstance(e, Exception) else e
        end = c.mark()  # an interrupt here escapes (submit's caller), or abandons the job (the thread)
        if job.start is None:  # nothing was enqueued: one marker stands for both
            job.start = end
        job.end = end  # last: from here on, the engine's thread reads the job as issued
    b = job.bounced
    if b is not None and plan.bounce.row == 1 and job.error is None:  # copied out once the stream passed it
        plan.bounce.copy_out(b, lambda: _wait(c, end))


def _wait(c: Any, marker: Any) -> None:
    with c.device_guard():  # the worker thread's current device is the mover's
        c.wait(marker)
