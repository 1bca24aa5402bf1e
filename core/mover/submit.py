"""A BlockMover job from ``submit`` to the transfer stream: check the ids, order after
``after``, and launch here or hand the job to the issuing thread."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..errors import MoverClosedError
from ..registry import deferred
from ..resolution.swapfn import SwapFn
from .completion import CURRENT_STREAM
from .descriptors import stage_ids
from .inputs import checked_groups, checked_pair
from .issuing import IssuingThread
from .jobs import Job, complete, issue_with, wait_from_worker
from .serial import serialized
from .within import check_within

# A launch in submit holds the engine's thread 50-100 us longer than a handoff to the
# issuing thread (measured cold, beside queued GEMMs, on an H100); submit's budget of
# 100 us + 10 ns per descriptor covers that from about this many descriptors on.
LAUNCH_HERE_MIN_DESCRIPTORS = 8192
# The error of a job whose submit an interrupt cut short after it may have enqueued a copy.
INTERRUPTED = "KeyboardInterrupt: submit was interrupted; the job may have copied some of its blocks"


class Submit:
    """``submit`` and the paths a job takes from it (part of :class:`~kvswap.BlockMover`)."""

    @serialized
    def submit(self, src_block_ids: Any, dst_block_ids: Any, *, after: Any = CURRENT_STREAM,
               within: Optional[float] = None) -> int:
        """Copy block ``src_block_ids[i]`` to block ``dst_block_ids[i]`` in every tensor pair.

        Ids are lists, numpy arrays or CPU tensors of integers; a :meth:`groups` mover
        takes a sequence of them per side, one per group. Everything is checked before
        anything is enqueued; the copy runs on the mover's transfer stream, built and
        issued by the mover's issuing thread where it has one (the ids are copied: the
        caller may reuse its arrays at once).

        :param after: what the copy waits for, captured when ``submit`` is called. Left
            out: the work already queued on the current stream (right for an offload of KV
            the step just wrote). ``None``: nothing (a prefix load into free blocks starts
            while the step computes). A ``torch.cuda.Stream``: the work queued on it so
            far. A ``torch.cuda.Event``: its last record. A mover between host tensors
            copies at once and takes only the default or None.
        :param within: seconds the copy has beside the engine's compute before anything
            waits for it (the rest of the step, say, for a load the next step reads, or a
            step or more for an offload). The job takes the route predicted to end the step
            soonest (from the calibration's speed, host cost and compute slowdown): where it
            would run on a kernel, a route that uses no SMs and finishes in time; on a mover
            that can stage, the staged route, the kernel or the batch route (see
            ``explain()``). None (the default): the mover's route, as built. Used for movers of one KV group with
            one chunk size whose route is not forced; for a job handed to the issuing
            thread, that thread decides.
        :return: the job id :meth:`poll` and :meth:`wait` refer to.
        :raises BlockIdError: ids out of range or negative, unequal in number, not
            integers, or a destination id repeated.
        :raises ConfigurationError: ``after`` is none of the above, or ``within`` is not a
            number of seconds >= 0.
        :raises MoverClosedError: after :meth:`close`.
        """
        if self._closed:
            raise MoverClosedError("submit() after close(): this BlockMover no longer moves blocks")
        ids = self._checked_ids(src_block_ids, dst_block_ids)
        q = self._inflight
        if q and q[-1].job_id >= self._next_id:
            self._settle()
        c = self._completion
        if after is not CURRENT_STREAM:  # the default needs no check
            c.check_after(after)
        if within is not None:
            check_within(within)
        if q and complete(q[0], c):
            self._reap()
        if not self._threaded:
            return self._submit_here(ids, after, None if within is None else self._within(len(ids[0][0]), within))
        # The route for ``within`` is decided here only for a job that may be launched here;
        # otherwise the issuing thread decides it, off the engine's thread.
        quiet = None
        by_ids = None if self._desc.ids_steps is None else self._desc.by_ids(ids)
        if by_ids is not None and self._launches_here(by_ids, len(ids[0][0])):
            if within is not None:
                quiet, within = self._within(len(ids[0][0]), within), None
            if quiet is None:
                return self._launch_here(by_ids, ids, after)
        if len(ids) == 1:
            (sid, did), = ids
            nbytes = len(sid) * self._templates[0].block_bytes
            ids = [(sid.copy(), did.copy())]
        else:
            nbytes = sum(len(s) * t.block_bytes for (s, _), t in zip(ids, self._templates))
            ids = [(s.copy(), d.copy()) for s, d in ids]
        # No device guard here: torch records events and waits on streams under the
        # stream's own device, and entering one costs the engine's thread ~10 us cold.
        c.order_after(after)
        start = c.mark()
        job = Job(self._next_id, nbytes, start, ids=ids, fn=quiet, within=within, thread=True)
        q.append(job)  # the job exists from here on; _settle hands it over (again, after an interrupt)
        self._settle()
        return job.job_id

    def _settle(self) -> None:
        """Finish the hand-off of the newest job where ``submit`` did not (an interrupt cut
        it short; ``submit`` itself ends with this for a job for the issuing thread). Each
        step may run twice: the thread issues a job it is given twice once."""
        q = self._inflight
        if not q or q[-1].job_id < self._next_id:
            return
        job = q[-1]
        if job.thread:
            self._last_handed = job
            if job.ids is not None and job.end is None:  # not yet taken by the thread
                (self._issuer or self._start_issuer()).put(job)
        elif job.end is None:  # cut short on this thread: whatever it enqueued ends before this marker
            job.error = job.error or INTERRUPTED
            job.end = self._completion.mark()
        self._next_id = job.job_id + 1

    def _submit_here(self, ids: list, after: Any, fn: Optional[SwapFn] = None) -> int:
        """Build, order and issue the job on the caller's thread (on ``fn`` where given)."""
        c = self._completion
        by_ids = self._desc.by_ids(ids) if fn is None and self._desc.ids_steps is not None else None
        buf, m = self._desc.build(ids) if by_ids is None else self._desc.ids_buffer(ids)
        staged = None
        try:
            if self._stager is not None:
                staged = self._stager.stage(buf.array, m)
        except BaseException:
            self.pool.release(buf)
            raise
        error = None
        n = len(ids[0][0])
        launch = None
        nbytes = sum(len(s) * t.block_bytes for (s, _), t in zip(ids, self._templates))
        with c.device_guard():
            try:
                # Ids are staged, as descriptors are built, before the start marker.
                launch = None if by_ids is None else stage_ids(by_ids, buf.array[0, :n], buf.array[1, :n])
                c.order_after(after)
                start = c.mark()
            except BaseException:
                if launch is not None:
                    launch.cancel()
                self.pool.release(buf)
                if staged is not None:
                    self._stager.release(staged)
                raise
            # The job exists from here on: cut short, _settle ends it. The buffer is its
            # until the end marker (backends may keep its arrays).
            job = Job(self._next_id, nbytes, start, None, buf, m, staged=staged)
            self._inflight.append(job)
            try:
                with deferred.collect(stable=True) as job.issued:
                    if launch is not None:
                        try:
                            launch(c.stream)
                        except Exception as e:
                            raise self._desc.failed(e, ids)
                    elif m:  # coalesced by build(): the SwapFn need not look for runs again
                        arr = buf.array
                        (fn or self._fn).call_built(arr[0, :m], arr[1, :m], arr[2, :m], c.stream)
            except BaseException as e:
                # Part of the batch may be enqueued: the buffers stay with a failed job
                # until the end marker shows the stream is past it.
                error = e
                job.error = f"{type(e).__name__}: {e}"
            end = c.mark()
        if staged is not None and self._stager.row == 1 and error is None:
            self._stager.copy_out(staged, lambda: wait_from_worker(c, end))
        job.end = end
        self._next_id = job.job_id + 1
        if error is not None:
            raise error
        return job.job_id

    def _launches_here(self, by_ids: Any, n: int) -> bool:
        """A by-id call of ``n`` ids that is only a launch, for a job large enough that
        submit's budget covers it, with no earlier job left on the issuing thread (the
        stream must see jobs in submission order)."""
        last = self._last_handed
        if last is not None and last.end is None:
            return False
        if n * self._templates[0].count < LAUNCH_HERE_MIN_DESCRIPTORS:
            return False
        launch_only = getattr(by_ids, "launch_only", None)
        return callable(launch_only) and bool(launch_only(n))

    def _launch_here(self, by_ids: Any, ids: list, after: Any) -> int:
        """Launch a job whose route derives addresses from the ids, on the caller's thread:
        the ids go into the launcher's pinned staging and one kernel is enqueued, host work
        that does not grow with the layers. Only when the issuing thread holds no earlier
        job, so the stream still sees jobs in submission order."""
        c = self._completion
        (sid, did), = ids
        launch = stage_ids(by_ids, sid, did)  # the ids are copied here, before the start marker
        try:
            c.order_after(after)
            start = c.mark()
        except BaseException:
            launch.cancel()
            raise
        t = self._templates[0]
        job = Job(self._next_id, len(sid) * t.block_bytes, start, descriptors=len(sid) * t.count)
        self._inflight.append(job)  # cut short from here on, _settle ends it
        error: Optional[BaseException] = None
        try:
            launch(c.stream)
        except BaseException as e:
            # A launch may have been enqueued: the job ends at the end marker.
            error = self._desc.failed(e, ids) if isinstance(e, Exception) else e
            job.error = f"{type(error).__name__}: {error}"
        job.end = c.mark()
        self._next_id = job.job_id + 1
        if error is not None:
            raise error
        return job.job_id

    def _start_issuer(self) -> IssuingThread:
        c = self._completion
        self._issuer = IssuingThread(issue_with(self._desc, self._fn, c, self._within),
                                     name=f"kvswap-{self.direction}-mover", prepare=c.bind_thread)
        return self._issuer

    def _checked_ids(self, src_block_ids: Any, dst_block_ids: Any) -> list[tuple[np.ndarray, np.ndarray]]:
        if not self._grouped:
            return [checked_pair(self._templates[0], src_block_ids, dst_block_ids, "")]
        return checked_groups(self._templates, src_block_ids, dst_block_ids)
