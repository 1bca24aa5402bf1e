"""BlockMover: the one object an engine holds to move KV blocks between host and device.

Built once from the per-layer tensors of both sides (or of several KV groups), it derives
where every block lives, resolves the copy route once, and then per step turns lists of
block ids into descriptors (one numpy broadcast over all layers, chunks and ids, into a
pooled pinned buffer), coalesces contiguous runs, and enqueues the copy on its own
transfer stream after what the engine says the copy waits for (by default, the work
already queued on the current stream). On a device, the work that grows with layers x
blocks and the copy route's call run on the mover's issuing thread (:mod:`kvswap.mover.issuing`).
"""
from __future__ import annotations

import functools
import threading
import warnings
from collections import deque
from typing import Any, Optional, Sequence, Union

import numpy as np

from ..registry import deferred
from ..memory import numa
from . import process
from ..memory.allocation import allocating
from .completion import CURRENT_STREAM, CudaCompletion, HostCompletion
from ..errors import ConfigurationError, ForkedProcessError, InvalidTransferError, MoverClosedError
from .issuing import IssuingThread
from ..memory.pinned_pool import DescriptorPool
from .descriptors import JobDescriptors, by_ids_steps, enqueue, stage_ids
from .jobs import Job, complete, issue_with, result, wait_from_worker
from .inputs import (
    checked_groups, checked_pair, device_side, group_specs, group_templates, groups_share_destinations,
    paired_sides, stager_for,
)
from .types import GroupLayout, KVGroup, Tensors, TransferResult
from .staged import staged_steps
from .within import QuietChoice, check_within
from ..addressing.regions import BlockDim, DescriptorTemplate
from ..resolution.resolver import resolve
from ..memory.staging import Stager
from ..resolution.swapfn import SwapFn
from ..registry.thresholds import Calibration
from ..types import Direction, DirectionLike, Policy

# A launch in submit holds the engine's thread 50-100 us longer than a handoff to the
# issuing thread (measured cold, beside queued GEMMs, on an H100); submit's budget of
# 100 us + 10 ns per descriptor covers that from about this many descriptors on.
LAUNCH_HERE_MIN_DESCRIPTORS = 8192
# The error of a job whose submit an interrupt cut short after it may have enqueued a copy.
INTERRUPTED = "KeyboardInterrupt: submit was interrupted; the job may have copied some of its blocks"

__all__ = ["BlockMover", "GroupLayout", "KVGroup", "TransferResult"]


def _keep_route(n: int, within: float) -> None:
    """``within``'s choice where the mover's route is already the quiet one: keep it."""
    return None


def _serialized(method: Any) -> Any:
    """One call at a time on a mover, from any thread, in the process that built it."""
    @functools.wraps(method)
    def call(self: BlockMover, *args: Any, **kwargs: Any) -> Any:
        if self._pid != process.pid:
            raise _forked(self)
        with self._lock:
            return method(self, *args, **kwargs)
    return call


def _forked(mover: BlockMover) -> ForkedProcessError:
    return ForkedProcessError(
        f"this BlockMover was built in process {mover._pid}; this is process {process.pid}, forked from it, "
        f"which inherits neither the mover's threads nor its device context; build a new mover here"
    )


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
    :param device_descriptors: where the kernel route can derive addresses on the device
        from the block ids (Triton's ``by_ids``), send only the ids per submit: the host
        work no longer grows with layers x blocks, and the copy starts sooner (on an H100,
        h2d 4 KiB x 10,000 on per-layer tensors reached 0.93 of the contiguous ceiling
        against 0.89 with coalesced descriptors, ``tests/bench/bench_by_ids.py``). On by
        default; False always sends descriptors. Routes without the capability, several
        KV groups, blocks of different sizes and staged memory take descriptors anyway.
    :param issuing_thread: whether jobs are built and issued on the mover's own thread
        (below). None (the default): on a device, yes; between host tensors, no (the copy
        runs in ``submit``). True on a mover between host tensors copies on the thread.
        False keeps everything on the caller's thread.
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
    are staged through kvswap's own pinned buffers (a host memcpy of every byte on top of
    the device copy; for host to device on the thread that submits, so the blocks are
    read when ``submit`` is called, for device to host on a worker thread after the
    device copy), with a :class:`PageableMemoryWarning` once, when the mover is built.
    A job completes only once its bytes are in place.
    ``Policy(require_pinned=True)`` refuses such memory instead.

    **Several KV groups** (hybrid models): :meth:`groups` builds one mover over several
    groups, each with its own tensors and block ids; one ``submit`` moves blocks of every
    group in one transfer with one completion.

    **What holds the engine's thread.** On a device, ``submit`` checks the ids (work that
    grows with the blocks, not the layers), makes the transfer stream wait for ``after``
    and records the job's start event on it. A job whose route derives the addresses from
    the ids (``device_descriptors``) in calls that are only launches is then launched right
    there when it has 8,192 descriptors or more: host work that does not grow with the
    layers (triton.kernel stages the ids in pinned memory and reads them there, or, for a
    long batch on few SMs, uploads them with a second kernel first). Any other job goes to
    the mover's issuing
    thread, and so does a by-id job while an earlier job still waits on that thread (the
    stream sees jobs in submission order). That thread, one per mover, takes jobs in order:
    it builds the descriptors (layers x blocks), calls the copy route (a kernel launch or
    a driver batch call) with the mover's device current, and records the job's end event,
    also after a failed call. A job is complete once it was issued and its end event has
    completed; its ``seconds`` run from the start event, so they include the thread's
    preparation. An error on the thread fails that job (:meth:`poll` reports it) and the
    next jobs still run; a launch in ``submit`` that fails raises there (and fails its job).

    The GIL: the thread's Python and numpy work waits for the engine's thread to let the
    GIL go. An engine thread that keeps running Python after ``submit`` holds it for up to
    the interpreter's switch interval (``sys.getswitchinterval()``, 5 ms by default) each
    time, so a job left to the thread may start milliseconds later (ctypes driver calls and
    numpy's larger loops release the GIL once running); a launch in ``submit`` does not
    wait for it. Movers whose groups share destination tensors (the check across groups
    needs the built descriptors before anything is enqueued) and movers that stage
    pageable memory issue on the caller's thread.

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
        self._device_descriptors = bool(device_descriptors)
        self._setup([KVGroup(src_tensors, dst_tensors, block_dim)], False, direction, policy, stream,
                    dict(calibration=calibration, profiles=profiles), issuing_thread)

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
        mover._device_descriptors = bool(device_descriptors)
        mover._setup(group_specs(groups), True, direction, policy, stream, dict(calibration=calibration, profiles=profiles),
                     issuing_thread)
        return mover

    def _setup(self, specs: list[KVGroup], grouped: bool, direction: DirectionLike,
               policy: Optional[Policy], stream: Any, resolve_kw: dict[str, Any],
               issuing_thread: Optional[bool]) -> None:
        self._closed = True  # until built: __del__ and close() have nothing to wait for
        self._pid, self._lock = process.pid, threading.RLock()
        self._issuer: Optional[IssuingThread] = None
        self._last_handed: Optional[Job] = None  # the last job given to the issuing thread
        if issuing_thread not in (None, True, False):
            raise ConfigurationError(f"issuing_thread={issuing_thread!r} must be None, True or False")
        self._inflight: deque[Job] = deque()
        self.direction = Direction.parse(direction)
        self._grouped = grouped
        sides = paired_sides(specs, grouped)
        all_src = [t for s, _ in sides for t in s]
        all_dst = [t for _, d in sides for t in d]
        device = device_side(all_src, all_dst, self.direction)
        templates = group_templates(sides, [spec.block_dim for spec in specs], grouped)
        self._templates: list[DescriptorTemplate] = templates
        self._per_block = np.array([t.count for t in templates], dtype=np.int64)
        on_device = device.type != "cpu"
        if on_device and process.cuda_forked():
            raise ForkedProcessError(
                f"cannot build a mover on {device}: CUDA was initialised in the parent of this process before it "
                f"forked, and a forked child cannot use it; start workers with multiprocessing's 'spawn' method"
            )
        block_bytes = sorted({c for t in templates for c in t.chunk_sizes})
        self._resolve_args = dict(device="cpu" if not on_device else str(device), block_bytes=block_bytes,
                                  **resolve_kw)
        self._fn: SwapFn = resolve(self.direction, policy=policy, **self._resolve_args)
        # Per job with ``within``: the route that takes no SMs, where it ends the step sooner
        # (on a device bound and predicted now, not on the engine's steps).
        self._within = QuietChoice(self._fn, self.direction, policy or Policy(), self._resolve_args, templates,
                                   block_bytes, on_device)
        host = [] if self.direction is Direction.D2D else (all_src if self.direction.src_is_host else all_dst)
        self._stager: Optional[Stager] = stager_for(host, self._fn, self.direction, policy or Policy(), on_device,
                                                    grouped)
        # Host memory on another NUMA node than the device's crosses the inter-socket link.
        self._numa_note = numa.host_memory_note(host, self._fn.plan.device) if host else None
        if self._numa_note:
            warnings.warn(numa.NumaWarning(self._numa_note), stacklevel=3)
        if not on_device:
            if stream is not None:
                raise ConfigurationError(f"stream={stream!r}: a mover between host tensors has no stream")
            self._completion: Any = HostCompletion()
        else:
            with allocating("a BlockMover's transfer stream", 0, "device"):
                self._completion = CudaCompletion(device.index or 0, stream)
        self.pool = DescriptorPool(pinned=on_device)
        self.pool.release(self.pool.acquire(1))  # its first buffer now: running out is an error here, not in a step
        self._check_across = grouped and groups_share_destinations(sides)
        # With device_descriptors, where the kernel route derives addresses itself (ByIdsFn), a
        # job sends only ids. Its templates are base + id * stride: sub-blocks (a block-size
        # factor) take the descriptor path.
        by_ids_ok = (self._device_descriptors and len(templates) == 1 and self._stager is None
                     and templates[0].factor == 1)
        # On a device, a host side in long runs (block-major) takes a staged route where one serves.
        steps, self._staged_note = None, ""
        if by_ids_ok and on_device:
            steps, self._staged_note = staged_steps(self._fn, templates[0], self.direction, policy or Policy(),
                                                    self._resolve_args)
        if steps is not None:
            self._within = _keep_route  # staged leaves the SMs to the compute already
        elif by_ids_ok:
            steps = by_ids_steps(self._fn, templates[0])
        self._desc = JobDescriptors(templates, self.pool, self._check_across, steps)
        # The check across groups must raise before anything is enqueued, and staging reads
        # or writes the host blocks around the copy: those movers issue in submit.
        threaded = on_device if issuing_thread is None else issuing_thread
        if threaded and (self._check_across or self._stager is not None):
            if issuing_thread:
                raise ConfigurationError(
                    "issuing_thread=True: this mover "
                    + ("stages pageable host memory" if self._stager is not None
                       else "has KV groups that share destination tensors")
                    + ", so it issues on the caller's thread; leave issuing_thread out"
                )
            threaded = False
        self._threaded = threaded
        self._tensors: Optional[list] = sides  # the memory the addresses point into
        self._results: deque[TransferResult] = deque()
        self._next_id = 1
        self._closed = False

    # -- what it resolved ----------------------------------------------------------------
    @property
    def swap_fn(self) -> SwapFn:
        """The copy function resolved at construction."""
        return self._fn

    def explain(self) -> str:
        """Why this route was chosen (the resolver's decision trace), and where the host
        memory sits when it is on another NUMA node than the device."""
        text = self._fn.explain()
        notes = [n for n in (self._staged_note, self._numa_note) if n]
        return "\n".join([text] + [f"  note: {n}" for n in notes])

    @property
    def stream(self) -> Any:
        """The transfer stream jobs are enqueued on (None for a host-only mover)."""
        return self._completion.stream

    @property
    def layouts(self) -> tuple[GroupLayout, ...]:
        """Per KV group (one for a mover built without :meth:`groups`): what an id moves."""
        return tuple(GroupLayout(t.block_bytes, t.count, t.src_blocks, t.dst_blocks, t.factor)
                     for t in self._templates)

    def _one(self) -> DescriptorTemplate:
        if len(self._templates) != 1:
            raise ConfigurationError(
                f"this mover moves {len(self._templates)} KV groups; read each group's numbers from .layouts"
            )
        return self._templates[0]

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
    def stages_host_memory(self) -> bool:
        """Whether pageable host tensors go through staging buffers (the slower route)."""
        return self._stager is not None

    @property
    def issuing_thread(self) -> bool:
        """Whether jobs are built and issued on the mover's own thread (see the class)."""
        return self._threaded

    @property
    def in_flight(self) -> int:
        """Jobs whose completion has not been observed yet (each holds a descriptor buffer)."""
        return len(self._inflight)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def _ids_steps(self) -> Optional[tuple]:
        return self._desc.ids_steps

    @_ids_steps.setter
    def _ids_steps(self, steps: Optional[tuple]) -> None:
        self._desc.ids_steps = steps

    # -- per step ------------------------------------------------------------------------
    @_serialized
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
            step or more for an offload). Where the job would run on a kernel, it takes the
            route that uses no SMs instead when that is predicted to end the step sooner:
            it finishes in time and leaves the compute every SM (predicted from the
            calibration's speed, host cost and compute slowdown by SM count). None (the
            default): the fastest route, as resolved. Used for movers of one KV group with
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
        by_ids = self._desc.by_ids(ids)
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
        by_ids = self._desc.by_ids(ids) if fn is None else None
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
                        launch(c.stream)
                    else:
                        enqueue(fn or self._fn, None, buf.array, n, m, c.stream)
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
        error = None
        try:
            launch(c.stream)
        except BaseException as e:
            error = e  # a launch may have been enqueued: the job ends at the end marker
            job.error = f"{type(e).__name__}: {e}"
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

    @_serialized
    def descriptors(self, src_block_ids: Any, dst_block_ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The descriptors ``submit`` would enqueue for these ids, after coalescing, as
        copies ``(src addresses, dst addresses, sizes)``; nothing is copied. Same checks
        as :meth:`submit`. Host addresses are the tensors', before any staging."""
        if self._closed:
            raise MoverClosedError("descriptors() after close()")
        buf, m = self._desc.build(self._checked_ids(src_block_ids, dst_block_ids))
        try:
            return buf.array[0, :m].copy(), buf.array[1, :m].copy(), buf.array[2, :m].copy()
        finally:
            self.pool.release(buf)

    @_serialized
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
            raise _forked(self)
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
            raise _forked(self)
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

    def __enter__(self) -> BlockMover:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._inflight)} in flight"
        shape = "; ".join(f"{t.count} chunk(s)/block, {t.block_bytes} B/block" for t in self._templates)
        return f"<kvswap.BlockMover {self.direction} {shape}, {', '.join(self._fn.impls)}; {state}>"

    # -- internals -----------------------------------------------------------------------
    def _checked_ids(self, src_block_ids: Any, dst_block_ids: Any) -> list[tuple[np.ndarray, np.ndarray]]:
        if not self._grouped:
            return [checked_pair(self._templates[0], src_block_ids, dst_block_ids, "")]
        return checked_groups(self._templates, src_block_ids, dst_block_ids)

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


