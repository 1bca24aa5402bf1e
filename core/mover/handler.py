"""BlockMover: the one object an engine holds to move KV blocks between host and device.

Built once from the per-layer tensors of both sides (or of several KV groups), it decides
everything a job does not depend on (its plan, :mod:`kvswap.mover.plan`), and then per job
checks the ids, orders its transfer stream after what the engine says the copy waits for
(by default, the work already queued on the current stream), and issues the job through
one function (:func:`kvswap.mover.run.run`): on its own issuing thread on a device
(:mod:`kvswap.mover.issuing`), or on the caller's.
"""
from __future__ import annotations

import threading
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..addressing.regions import BlockDim, DescriptorTemplate
from ..errors import ConfigurationError, InvalidTransferError, MoverClosedError
from ..registry.thresholds import Calibration
from ..resolution.swapfn import SwapFn
from ..types import Direction, DirectionLike, Policy
from . import process
from .build import build
from .completion import CURRENT_STREAM
from .inputs import checked_groups, checked_pair, group_specs
from .jobs import Jobs
from .plan import Plan
from .run import run
from .serial import forked, serialized
from .types import BlockIds, GroupLayout, KVGroup, Tensors, TransferResult

__all__ = ["BlockMover"]


class BlockMover:
    """Copy blocks from ``src_tensors[k]`` to ``dst_tensors[k]`` for every k, by block id.

    :param src_tensors: a tensor or a sequence of tensors (one per layer, or per K/V).
    :param dst_tensors: as many tensors; each may differ from its source in block count
        and layout: blocks of one dtype and shape pair element by element (a FlashAttention
        device cache with a block-major host cache from :func:`kvswap.host_cache`), a
        ``torch.uint8`` byte pool takes the other side's chunks in order, and one side's
        blocks may be k whole blocks of the other side's (below).
    :param direction: ``"h2d"`` (sources on the host), ``"d2h"`` (destinations on the
        host) or ``"d2d"`` (both sides on one device). The device side may also be host
        memory: the host reference then copies.
    :param block_dim: the dimension that indexes blocks: an int for every tensor, a
        ``(src, dst)`` tuple for every pair, or a list with one entry (an int or a tuple)
        per tensor pair. vLLM's FlashAttention layout ``(2, num_blocks, ...)`` is
        ``block_dim=1``; FlashAttention, FlashInfer ``(num_blocks, 2, ...)`` and MLA
        ``(num_blocks, ...)`` caches in one mover are ``block_dim=[1, 0, 0]``.
    :param policy: passed to :func:`kvswap.resolve` (SM budget, forced route, whether
        pageable host memory is refused).
    :param stream: the transfer stream on a GPU (default: a new one).
    :param device_descriptors: where the route derives addresses on the device from the
        block ids (:attr:`kvswap.CopyImpl.by_ids`: Triton's kernel and staged route), send
        only the ids per submit: the host work no longer grows with layers x blocks, and
        the copy starts sooner (docs/design.md). On by default; False always sends
        descriptors. Several KV groups, blocks of different sizes and pageable host memory
        take descriptors anyway.
    :param issuing_thread: where jobs are built and issued (below). None (the default):
        on a device, on the mover's own thread, but a large by-id job whose call is only
        launches in ``submit`` while the thread holds no earlier job; between host tensors,
        in ``submit``. True: every job on the thread (a mover between host tensors too).
        False: every job on the caller's thread.
    :param calibration: passed to :func:`kvswap.resolve`: decide by this calibration
        instead of looking one up.
    :param profiles: passed to :func:`kvswap.resolve`: False skips measured profiles.
    :raises BlockLayoutError: blocks that are not contiguous chunks, or blocks that do not
        hold the same elements (or bytes) on both sides.
    :raises TensorPlacementError: tensors on the wrong device for ``direction``.
    :raises UnpinnedMemoryError: pageable host tensors with ``Policy(require_pinned=True)``.

    **Blocks of different sizes** (vLLM's ``block_size_factor``, kernel block size below
    the logical block size): one side's blocks may be k whole times the other's, cut
    along one dimension into blocks of the other side's shape (the tokens of a block).
    Ids on both sides then count the smaller block: id ``i`` on the larger side is
    sub-block ``i % k`` of block ``i // k``. Rows may be padded (a block stride larger
    than the block, as in a shared host region). k is derived once, here.

    **Pageable host memory** works, more slowly: host tensors that are not page-locked
    go through kvswap's own pinned bounce buffers (a host memcpy of every byte on top of
    the device copy; for host to device on the thread that submits, so the blocks are
    read when ``submit`` is called, for device to host on a worker thread after the
    device copy), with a :class:`PageableMemoryWarning` once, when the mover is built.
    A job completes only once its bytes are in place.
    ``Policy(require_pinned=True)`` refuses such memory instead.

    **Several KV groups** (hybrid models): :meth:`groups` builds one mover over several
    groups, each with its own tensors and block ids; one ``submit`` moves blocks of every
    group in one transfer with one completion.

    **What holds the engine's thread.** On a device, ``submit`` checks the ids (work that
    grows with the blocks, not the layers) and makes the transfer stream wait for
    ``after``. The mover's issuing thread, one per mover, then takes the job, in order: it
    builds the descriptors (layers x blocks) or packs the ids, records the job's start
    event, calls the copy route (a kernel launch or a driver batch call) with the mover's
    device current, and records the job's end event, also after a failed call. A by-id job
    of 8,192 descriptors or more whose call is only launches is issued the same way in
    ``submit`` itself while the thread holds no earlier job (the stream sees jobs in
    submission order). A job is complete once it was issued and its end event has
    completed. An error on the thread fails that job (:meth:`poll` reports it) and the
    next jobs still run; a job issued in ``submit`` that fails raises there (and fails).

    The GIL: the thread's Python and numpy work waits for the engine's thread to let the
    GIL go. An engine thread that keeps running Python after ``submit`` holds it for up to
    the interpreter's switch interval (``sys.getswitchinterval()``) each time, so a job
    left to the thread may start milliseconds later (ctypes driver calls and numpy's
    larger loops release the GIL once running); a launch in ``submit`` does not wait for
    it. Movers whose groups share destination tensors (the check across groups needs the
    built descriptors before anything is enqueued) and movers with pageable host memory
    issue on the caller's thread.

    **Threads and processes.** Every method may be called from any thread: calls on one
    mover run one at a time (a lock; :meth:`wait` and :meth:`wait_issued` do not hold it
    while they block), so two threads submitting and polling get distinct job ids, each
    result once, and jobs on the stream in the order their ``submit`` calls took the lock.
    A mover belongs to the process that built it: in a child made by ``fork()`` every call
    raises :class:`ForkedProcessError` (``close`` only marks it closed), and a device mover
    cannot be built in a child forked after CUDA was initialised (start such workers with
    the ``spawn`` method); movers between host tensors built in the child work.

    **Interrupts and close.** A ``KeyboardInterrupt`` inside ``submit`` leaves the mover
    consistent: the job was either never created (nothing enqueued, no id used) or it was,
    and the next call on the mover completes its hand-off, or, where it was copying on the
    caller's thread, records its end marker then and reports it failed (some blocks may
    have been copied). No descriptor buffer goes back to the pool before the stream has
    passed its job. :meth:`close` with jobs in flight waits for them; interrupted, it can
    be called again, and a mover collected with jobs in flight waits for them first.
    """

    # Everything a mover holds: what it decided and bound when it was built (its plan), its
    # jobs, the memory its addresses point into (until close), and the state of its calls.
    direction: Direction
    _plan: Plan
    _jobs: Jobs
    _tensors: Optional[list]
    _pid: int
    _lock: threading.RLock
    _closed: bool

    def __init__(
        self,
        src_tensors: Tensors,
        dst_tensors: Tensors,
        direction: DirectionLike,
        *,
        block_dim: BlockDim = 0,
        policy: Optional[Policy] = None,
        stream: Any = None,
        calibration: Optional[Calibration] = None,
        profiles: bool = True,
        device_descriptors: bool = True,
        issuing_thread: Optional[bool] = None,
    ) -> None:
        self._init([KVGroup(src_tensors, dst_tensors, block_dim)], False, direction, policy, stream,
                   dict(calibration=calibration, profiles=profiles), issuing_thread, device_descriptors)

    @classmethod
    def groups(
        cls,
        groups: Sequence[Union[KVGroup, tuple]],
        direction: DirectionLike,
        *,
        policy: Optional[Policy] = None,
        stream: Any = None,
        calibration: Optional[Calibration] = None,
        profiles: bool = True,
        issuing_thread: Optional[bool] = None,
        device_descriptors: bool = True,
    ) -> BlockMover:
        """A mover over several KV groups: one transfer and one completion per step.

        :param groups: a :class:`KVGroup` per group, or a tuple ``(src_tensors,
            dst_tensors)`` or ``(src_tensors, dst_tensors, block_dim)``.
        :param direction, policy, stream, calibration, profiles, issuing_thread,
            device_descriptors: as for :class:`BlockMover` (ids alone go to the device only
            for a mover of one group).

        Its :meth:`submit` and :meth:`descriptors` take one id list per group on each
        side, in the order of ``groups``: ``submit([src_ids_0, src_ids_1],
        [dst_ids_0, dst_ids_1])`` (an empty list moves nothing of that group).
        :attr:`layouts` describes each group. Groups may share tensors (blocks of one
        pool that the groups divide): then destinations are checked across groups per job.

        ::

            mover = kvswap.BlockMover.groups(
                [kvswap.KVGroup(full_attn_gpu, full_attn_cpu, block_dim=1),
                 kvswap.KVGroup(sliding_gpu, sliding_cpu, block_dim=1)], "d2h")
            job = mover.submit([gpu_ids_full, gpu_ids_sliding], [cpu_ids_full, cpu_ids_sliding])
        """
        mover = cls.__new__(cls)
        mover._init(group_specs(groups), True, direction, policy, stream,
                    dict(calibration=calibration, profiles=profiles), issuing_thread, device_descriptors)
        return mover

    def _init(self, specs: list[KVGroup], grouped: bool, direction: DirectionLike, policy: Optional[Policy],
              stream: Any, resolve_kw: dict[str, Any], issuing_thread: Optional[bool],
              device_descriptors: bool) -> None:
        self._closed = True  # until built: __del__ and close() have nothing to wait for
        self._pid, self._lock = process.pid, threading.RLock()
        self.direction = Direction.parse(direction)
        self._plan, self._tensors = build(specs, grouped, self.direction, policy, stream, resolve_kw,
                                          issuing_thread, device_descriptors)
        self._jobs = Jobs(self._plan, f"kvswap-{self.direction}-mover")
        self._closed = False

    # -- a job ----------------------------------------------------------------------------
    @serialized
    def submit(self, src_block_ids: Any, dst_block_ids: Any, *, after: Any = CURRENT_STREAM) -> int:
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
        :return: the job id :meth:`poll` and :meth:`wait` refer to.
        :raises BlockIdError: ids out of range or negative, unequal in number, not
            integers, or a destination id repeated.
        :raises ConfigurationError: ``after`` is none of the above.
        :raises MoverClosedError: after :meth:`close`.
        """
        if self._closed:
            raise MoverClosedError("submit() after close(): this BlockMover no longer moves blocks")
        plan, jobs = self._plan, self._jobs
        ids = self._checked(src_block_ids, dst_block_ids)
        c = plan.completion
        if after is not CURRENT_STREAM:  # the default needs no check
            c.check_after(after)
        jobs.tidy()
        here = not plan.threaded or (plan.here_from is not None and plan.issues_here(ids, jobs.thread_idle()))
        built = plan.descriptors.build(ids) if plan.checks else None  # refuses before anything is enqueued
        if not here:
            ids = [BlockIds(s.copy(), d.copy()) for s, d in ids]  # the caller may reuse its arrays at once
        templates = plan.templates
        nbytes = sum(len(s) * t.block_bytes for (s, _), t in zip(ids, templates))
        try:
            # No device guard here: torch records events and waits on streams under the
            # stream's own device, and entering one costs the engine's thread ~10 us cold.
            c.order_after(after)
        except BaseException:
            if built is not None:
                plan.descriptors.pool.release(built.buffer)
            raise
        # The job exists from here on (cut short, the next call ends it); one for the issuing
        # thread is handed over.
        job = jobs.add(ids, nbytes, len(ids[0].src) * templates[0].count if plan.ids else 0, here)
        if not here:
            return job.job_id
        if built is not None:
            job.buffer, job.descriptors = built
        run(job, plan)
        if job.error is not None and job.end is job.start:  # refused before its call: no job, nothing enqueued
            jobs.drop(job)
            raise job.error
        jobs.settle()
        if job.error is not None:
            raise job.error
        return job.job_id

    def _checked(self, src_block_ids: Any, dst_block_ids: Any) -> list[BlockIds]:
        templates = self._plan.templates
        if not self._plan.grouped:
            return [checked_pair(templates[0], src_block_ids, dst_block_ids, "")]
        return checked_groups(templates, src_block_ids, dst_block_ids)

    @serialized
    def poll(self) -> list[TransferResult]:
        """Results of the jobs that completed since the last poll, in submission order.

        Each job is reported exactly once (jobs :meth:`wait` waited for included).
        """
        jobs = self._jobs
        jobs.reap()
        out = list(jobs.results)
        jobs.results.clear()
        return out

    def wait(self, job_id: Optional[int] = None) -> None:
        """Block until job ``job_id`` (None: every submitted job) has completed.

        :raises InvalidTransferError: ``job_id`` was never returned by this mover's submit.
        """
        job = self._find(job_id)  # the lock is not held while waiting: other threads may submit and poll
        if job is not None:
            self._jobs.wait_issued(job)
            self._plan.completion.wait(job.end)
            b = job.bounced
            if b is not None and b.finish is not None:
                b.finish.exception()  # copied out (or failed: poll reports it)
            with self._lock:
                self._jobs.reap()

    def wait_issued(self, job_id: Optional[int] = None) -> None:
        """Block until job ``job_id`` (None: every submitted job) is enqueued on the
        transfer stream; it may still be copying. After this, work ordered after the
        transfer stream (``stream.wait_stream(mover.stream)``) runs after the job; before
        it, a job left to the issuing thread may not be on the stream yet.

        :raises InvalidTransferError: ``job_id`` was never returned by this mover's submit.
        """
        job = self._find(job_id)
        if job is not None:
            self._jobs.wait_issued(job)

    def _find(self, job_id: Optional[int]) -> Any:
        if self._pid != process.pid:
            raise forked(self)
        with self._lock:
            last = self._jobs.next_id - 1
            if job_id is not None and (isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer))
                                       or not 1 <= job_id <= last):
                raise InvalidTransferError(
                    f"job_id={job_id!r} was not returned by this mover's submit() (ids so far: 1..{last})"
                )
            return self._jobs.find(job_id)

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
            jobs = getattr(self, "_jobs", None)
            if self._closed and (jobs is None or not jobs.inflight):
                return
            self._closed = True
        try:
            self.wait()
        finally:
            self._jobs.stop()
        with self._lock:
            plan = self._plan
            plan.descriptors.pool.clear()
            if plan.bounce is not None:
                plan.bounce.close()
            self._tensors = None

    def __del__(self) -> None:
        if getattr(self, "_pid", None) != process.pid:
            return  # a forked child's copy (or never built): nothing of it is this process's to wait for
        jobs = getattr(self, "_jobs", None)
        if jobs is None:
            return
        # The device may still read descriptors or tensors of jobs nobody waited for (a
        # close() that was interrupted included).
        try:
            if jobs.inflight:
                self.wait()
        except Exception:
            pass
        jobs.stop()

    def __enter__(self) -> BlockMover:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- what it decided ------------------------------------------------------------------
    @property
    def swap_fn(self) -> SwapFn:
        """The copy function resolved at construction."""
        return self._plan.fn

    def explain(self) -> str:
        """Why this route was chosen (the resolver's decision trace), whether the mover
        takes the staged route, and where the host memory sits when it is on another NUMA
        node than the device."""
        return "\n".join([self._plan.fn.explain()] + [f"  note: {n}" for n in self._plan.notes])

    def id_route(self, count: int) -> Optional[str]:
        """The implementation a job of ``count`` block ids takes by id (the addresses derived
        on the device), or None where it takes descriptors."""
        ids = self._plan.ids
        if ids is None or count < 1:
            return None
        fn, name = ids.at(count * self._plan.templates[0].count)
        return None if fn is None else name

    @property
    def stream(self) -> Any:
        """The transfer stream jobs are enqueued on (None for a host-only mover)."""
        return self._plan.completion.stream

    @property
    def layouts(self) -> tuple[GroupLayout, ...]:
        """Per KV group (one for a mover built without :meth:`groups`): what an id moves."""
        return tuple(GroupLayout(t.block_bytes, t.count, t.src_blocks, t.dst_blocks, t.factor)
                     for t in self._plan.templates)

    def _one(self) -> DescriptorTemplate:
        templates = self._plan.templates
        if len(templates) != 1:
            raise ConfigurationError(
                f"this mover moves {len(templates)} KV groups; read each group's numbers from .layouts"
            )
        return templates[0]

    @property
    def block_bytes(self) -> int:
        """Bytes moved per block id, over every tensor pair."""
        return self._one().block_bytes

    @property
    def chunks_per_block(self) -> int:
        """Descriptors per block id before coalescing, over every tensor pair."""
        return self._one().count

    @property
    def num_src_blocks(self) -> int:
        """Ids the source side holds (its blocks, or its sub-blocks where they are larger)."""
        return self._one().src_blocks

    @property
    def num_dst_blocks(self) -> int:
        """Ids the destination side holds (its blocks, or its sub-blocks where they are larger)."""
        return self._one().dst_blocks

    @property
    def block_size_factor(self) -> int:
        """k where one side's blocks are k of the other's (ids count the smaller), else 1."""
        return self._one().factor

    @property
    def bounces_host_memory(self) -> bool:
        """Whether pageable host tensors go through bounce buffers (the slower route)."""
        return self._plan.bounce is not None

    @property
    def issuing_thread(self) -> bool:
        """Whether jobs are built and issued on the mover's own thread (see the class)."""
        return self._plan.threaded

    @property
    def pool(self) -> Any:
        """The mover's pool of descriptor buffers (each job holds one until it completes)."""
        return self._plan.descriptors.pool

    @property
    def in_flight(self) -> int:
        """Jobs whose completion has not been observed yet (each holds a descriptor buffer)."""
        return len(self._jobs.inflight)

    @property
    def closed(self) -> bool:
        return self._closed

    @serialized
    def descriptors(self, src_block_ids: Any, dst_block_ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The descriptors ``submit`` would enqueue for these ids, after coalescing, as
        copies ``(src addresses, dst addresses, sizes)``; nothing is copied. Same checks
        as :meth:`submit`. Host addresses are the tensors', before any bounce buffer."""
        if self._closed:
            raise MoverClosedError("descriptors() after close()")
        pool = self._plan.descriptors.pool
        buf, m = self._plan.descriptors.build(self._checked(src_block_ids, dst_block_ids))
        try:
            return buf.array[0, :m].copy(), buf.array[1, :m].copy(), buf.array[2, :m].copy()
        finally:
            pool.release(buf)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._jobs.inflight)} in flight"
        shape = "; ".join(f"{t.count} chunk(s)/block, {t.block_bytes} B/block" for t in self._plan.templates)
        return f"<kvswap.BlockMover {self.direction} {shape}, {', '.join(self._plan.fn.impls)}; {state}>"
