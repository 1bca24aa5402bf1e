"""BlockMover: the one object an engine holds to move KV blocks between host and device.

Built once from the per-layer tensors of both sides (or of several KV groups), it derives
where every block lives, resolves the copy route once, and then per step turns lists of
block ids into descriptors (one numpy broadcast over all layers, chunks and ids, into a
pooled pinned buffer), coalesces contiguous runs, and enqueues the copy on its own
transfer stream after what the engine says the copy waits for (by default, the work
already queued on the current stream).
"""
from __future__ import annotations

import warnings
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np

from . import deferred, numa
from .completion import CURRENT_STREAM, CudaCompletion, HostCompletion
from .descriptors import coalesce, first_overlap
from .errors import ConfigurationError, InvalidTransferError
from .errors import BlockIdError, BlockLayoutError, MoverClosedError
from .pinned_pool import DescriptorBuffer, DescriptorPool
from .mover_inputs import (
    Tensors, checked_pair, device_side, groups_share_destinations, pinned_routes, refuse_pageable,
    tensor_list,
)
from .regions import BlockDim, DescriptorTemplate, pair_regions
from .resolver import resolve
from .staging import PageableMemoryWarning, Staged, Stager, storage_spans
from .swapfn import SwapFn
from .thresholds import Calibration
from .types import Direction, DirectionLike, Policy



@dataclass(frozen=True)
class TransferResult:
    """One finished job.

    :ivar bytes: bytes the job moved (block ids x bytes per block over all tensors).
    :ivar seconds: time on the transfer stream between the job's start and end events
        (on a host-only mover: wall time of the synchronous copy).
    :ivar descriptors: descriptors after coalescing, as the copy route received them.
    :ivar error: why the copy call raised, when ``ok`` is False.
    """

    job_id: int
    ok: bool
    bytes: int
    seconds: float
    descriptors: int
    error: Optional[str] = None


@dataclass(frozen=True)
class KVGroup:
    """One KV group of a :meth:`BlockMover.groups` mover: its tensors and block dims.

    Arguments as :class:`BlockMover`'s ``src_tensors``, ``dst_tensors`` and ``block_dim``.
    Each group has its own block ids (its own block pool, block size and layout).
    """

    src_tensors: Tensors
    dst_tensors: Tensors
    block_dim: BlockDim = 0


@dataclass(frozen=True)
class GroupLayout:
    """What one block id moves in one KV group.

    :ivar factor: k where one side's blocks are k of the other side's (ids count the
        smaller block), else 1.
    """

    block_bytes: int
    chunks_per_block: int
    num_src_blocks: int
    num_dst_blocks: int
    factor: int


@dataclass(eq=False)
class _Job:
    job_id: int
    buffer: DescriptorBuffer
    nbytes: int
    descriptors: int
    start: Any
    end: Any
    error: Optional[str] = None
    staged: Optional[Staged] = None
    issued: list = field(default_factory=list)  # work left to other threads (kvswap.deferred)


class BlockMover:
    """Copy blocks from ``src_tensors[k]`` to ``dst_tensors[k]`` for every k, by block id.

    :param src_tensors: a tensor or a sequence of tensors (one per layer, or per K/V).
    :param dst_tensors: as many tensors; each may differ from its source in shape and
        block count, but a block must be the same chunks of the same sizes on both sides,
        or k whole blocks of the other side (below).
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
        work no longer grows with layers x blocks. Against the descriptor kernel it copied
        faster on an H200 and more slowly on an H100 on per-layer layouts
        (``tests/bench/bench_by_ids.py``), so it is off unless asked for.
    :param calibration: passed to :func:`kvswap.resolve`: decide by this calibration
        instead of looking one up.
    :param profiles: passed to :func:`kvswap.resolve`: False skips measured profiles.
    :raises BlockLayoutError: blocks that are not contiguous chunks, or chunks that differ.
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

    Not thread-safe: one engine thread submits and polls.
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
        device_descriptors: bool = False,
    ) -> None:
        self._device_descriptors = bool(device_descriptors)
        self._setup([KVGroup(src_tensors, dst_tensors, block_dim)], False, direction, policy, stream,
                    dict(calibration=calibration, profiles=profiles))

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
    ) -> BlockMover:
        """A mover over several KV groups: one transfer and one completion per step.

        :param groups: a :class:`KVGroup` per group, or a tuple ``(src_tensors,
            dst_tensors)`` or ``(src_tensors, dst_tensors, block_dim)``.
        :param direction, policy, stream, calibration, profiles: as for :class:`BlockMover`.

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
        if isinstance(groups, KVGroup) or not isinstance(groups, Sequence) or not len(groups):
            raise BlockLayoutError(f"groups={groups!r} must be a non-empty list of KVGroup or (src, dst[, block_dim])")
        specs = []
        for g, spec in enumerate(groups):
            if isinstance(spec, KVGroup):
                specs.append(spec)
            elif isinstance(spec, tuple) and len(spec) in (2, 3):
                specs.append(KVGroup(*spec))
            else:
                raise BlockLayoutError(
                    f"groups[{g}] is a {type(spec).__name__}; pass a KVGroup or a tuple (src_tensors, dst_tensors"
                    f"[, block_dim])"
                )
        mover = cls.__new__(cls)
        mover._device_descriptors = False
        mover._setup(specs, True, direction, policy, stream, dict(calibration=calibration, profiles=profiles))
        return mover

    def _setup(self, specs: list[KVGroup], grouped: bool, direction: DirectionLike,
               policy: Optional[Policy], stream: Any, resolve_kw: dict[str, Any]) -> None:
        self._closed = True  # until built: __del__ and close() have nothing to wait for
        self._inflight: deque[_Job] = deque()
        self.direction = Direction.parse(direction)
        self._grouped = grouped
        sides = []
        for g, spec in enumerate(specs):
            where = f"groups[{g}]: " if grouped else ""
            src = tensor_list(spec.src_tensors, "src_tensors", where)
            dst = tensor_list(spec.dst_tensors, "dst_tensors", where)
            if len(src) != len(dst):
                raise BlockLayoutError(
                    f"{where}src_tensors has {len(src)} tensor(s) but dst_tensors has {len(dst)}; "
                    f"pass one destination per source"
                )
            sides.append((src, dst))
        all_src = [t for s, _ in sides for t in s]
        all_dst = [t for _, d in sides for t in d]
        device = device_side(all_src, all_dst, self.direction)
        templates = []
        for g, ((src, dst), spec) in enumerate(zip(sides, specs)):
            try:
                templates.append(pair_regions(src, dst, spec.block_dim))
            except BlockLayoutError as e:
                if not grouped:
                    raise
                raise BlockLayoutError(f"groups[{g}]: {e}") from None
        self._templates: list[DescriptorTemplate] = templates
        self._per_block = np.array([t.count for t in templates], dtype=np.int64)
        on_device = device.type != "cpu"
        self._fn: SwapFn = resolve(
            self.direction,
            device="cpu" if not on_device else str(device),
            block_bytes=sorted({c for t in templates for c in t.chunk_sizes}),
            policy=policy,
            **resolve_kw,
        )
        policy = policy or Policy()
        self._stager: Optional[Stager] = None
        host = [] if self.direction is Direction.D2D else (all_src if self.direction.src_is_host else all_dst)
        pageable = [i for i, t in enumerate(host) if not t.is_pinned()]
        pinned_for = pinned_routes(self._fn, on_device=on_device)
        if pageable and (on_device or pinned_for):
            if policy.require_pinned:
                refuse_pageable(host, pageable, self.direction, pinned_for, grouped)
            self._stager = Stager(storage_spans([host[i] for i in pageable]),
                                  0 if self.direction.src_is_host else 1, pinned=on_device)
            warnings.warn(PageableMemoryWarning(
                f"{len(pageable)} of the {len(host)} host tensor(s) of this {self.direction} mover are pageable: "
                f"their blocks are staged through pinned buffers, a host memcpy of every byte on top of the "
                f"device copy; allocate host KV with pin_memory=True (or kvswap.host_empty) to avoid it"
            ), stacklevel=3)
        # Host memory on another NUMA node than the device's crosses the inter-socket link.
        self._numa_note = numa.host_memory_note(host, self._fn.plan.device) if host else None
        if self._numa_note:
            warnings.warn(numa.NumaWarning(self._numa_note), stacklevel=3)
        if not on_device:
            if stream is not None:
                raise ConfigurationError(f"stream={stream!r}: a mover between host tensors has no stream")
            self._completion: Any = HostCompletion()
        else:
            self._completion = CudaCompletion(device.index or 0, stream)
        self.pool = DescriptorPool(pinned=on_device)
        self._check_across = grouped and groups_share_destinations(sides)
        # With device_descriptors, where the kernel route derives addresses itself (ByIdsFn), a
        # submit sends only ids. Opt-in (its gain over coalesced descriptors differs between
        # GPUs: bench_by_ids.py). Its templates are base + id * stride:
        # sub-blocks (a block-size factor) take the descriptor path.
        by_ids_ok = (self._device_descriptors and len(templates) == 1 and self._stager is None
                     and templates[0].factor == 1)
        self._ids_steps = _by_ids_steps(self._fn, templates[0]) if by_ids_ok else None
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
        return f"{text}\n  note: {self._numa_note}" if self._numa_note else text

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
    def in_flight(self) -> int:
        """Jobs whose completion has not been observed yet (each holds a descriptor buffer)."""
        return len(self._inflight)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- per step ------------------------------------------------------------------------
    def submit(self, src_block_ids: Any, dst_block_ids: Any, *, after: Any = CURRENT_STREAM) -> int:
        """Copy block ``src_block_ids[i]`` to block ``dst_block_ids[i]`` in every tensor pair.

        Ids are lists, numpy arrays or CPU tensors of integers; a :meth:`groups` mover
        takes a sequence of them per side, one per group. Everything is checked before
        anything is enqueued; the copy runs on the mover's transfer stream.

        :param after: what the copy waits for. Left out: the work already queued on the
            current stream (right for an offload of KV the step just wrote). ``None``:
            nothing (a prefix load into free blocks starts while the step computes). A
            ``torch.cuda.Stream``: the work queued on it so far. A ``torch.cuda.Event``:
            its last record. A mover between host tensors copies at once and takes only
            the default or None.
        :return: the job id :meth:`poll` and :meth:`wait` refer to.
        :raises BlockIdError: ids out of range or negative, unequal in number, not
            integers, or a destination id repeated.
        :raises ConfigurationError: ``after`` is none of the above.
        :raises MoverClosedError: after :meth:`close`.
        """
        if self._closed:
            raise MoverClosedError("submit() after close(): this BlockMover no longer moves blocks")
        ids = self._checked_ids(src_block_ids, dst_block_ids)
        c = self._completion
        c.check_after(after)
        self._reap()
        by_ids = self._by_ids(ids)
        buf, m = self._build(ids) if by_ids is None else self._ids_buffer(ids)
        staged = None
        try:
            if self._stager is not None:
                staged = self._stager.stage(buf.array, m)
        except BaseException:
            self.pool.release(buf)
            raise
        arr = buf.array
        error = None
        with c.device_guard():
            c.order_after(after)
            start = c.mark()
            try:
                # The buffer is ours until the end marker: backends may keep its arrays.
                with deferred.collect(stable=True) as issued:
                    if by_ids is not None:
                        n = len(ids[0][0])
                        by_ids(arr[0, :n], arr[1, :n], c.stream)
                    elif m:
                        # Ids and template were checked (_checked_ids, pair_regions): the
                        # batch is validated once, here, not again by the SwapFn.
                        self._fn.call_validated(arr[0, :m], arr[1, :m], arr[2, :m], stream=c.stream)
            except BaseException as e:
                # Part of the batch may be enqueued: the buffers stay with a failed job
                # until the end marker shows the stream is past it.
                error = e
            end = c.mark()
        if staged is not None and self._stager.row == 1 and error is None:
            self._stager.copy_out(staged, lambda: _wait_from_worker(c, end))
        job_id = self._next_id
        self._next_id += 1
        nbytes = sum(len(s) * t.block_bytes for (s, _), t in zip(ids, self._templates))
        self._inflight.append(_Job(job_id, buf, nbytes, m, start, end,
                                   None if error is None else f"{type(error).__name__}: {error}", staged, issued))
        if error is not None:
            raise error
        return job_id

    def descriptors(self, src_block_ids: Any, dst_block_ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The descriptors ``submit`` would enqueue for these ids, after coalescing, as
        copies ``(src addresses, dst addresses, sizes)``; nothing is copied. Same checks
        as :meth:`submit`. Host addresses are the tensors', before any staging."""
        if self._closed:
            raise MoverClosedError("descriptors() after close()")
        buf, m = self._build(self._checked_ids(src_block_ids, dst_block_ids))
        try:
            return buf.array[0, :m].copy(), buf.array[1, :m].copy(), buf.array[2, :m].copy()
        finally:
            self.pool.release(buf)

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
        q = self._inflight
        if job_id is not None:
            if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)) or not 1 <= job_id < self._next_id:
                raise InvalidTransferError(
                    f"job_id={job_id!r} was not returned by this mover's submit() (ids so far: 1..{self._next_id - 1})"
                )
        if not q:
            return
        k = len(q) - 1 if job_id is None else int(job_id) - q[0].job_id
        if k >= 0:  # otherwise already complete: in-flight ids are consecutive
            job = q[k]
            self._completion.wait(job.end)
            if job.staged is not None and job.staged.finish is not None:
                job.staged.finish.exception()  # copied out (or failed: poll reports it)
            self._reap()

    def close(self) -> None:
        """Wait for every job, then refuse further submits. Results stay available to
        :meth:`poll`. Idempotent; also what leaving a ``with`` block does."""
        if self._closed:
            return
        self.wait()
        self._closed = True
        self.pool.clear()
        if self._stager is not None:
            self._stager.close()
        self._tensors = None

    def __enter__(self) -> BlockMover:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # The device may still read descriptors or tensors of jobs nobody waited for.
        try:
            if not self._closed and self._inflight:
                self.wait()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._inflight)} in flight"
        shape = "; ".join(f"{t.count} chunk(s)/block, {t.block_bytes} B/block" for t in self._templates)
        return f"<kvswap.BlockMover {self.direction} {shape}, {', '.join(self._fn.impls)}; {state}>"

    # -- internals -----------------------------------------------------------------------
    def _checked_ids(self, src_block_ids: Any, dst_block_ids: Any) -> list[tuple[np.ndarray, np.ndarray]]:
        if not self._grouped:
            return [checked_pair(self._templates[0], src_block_ids, dst_block_ids, "")]
        n = len(self._templates)
        for what, ids in (("src_block_ids", src_block_ids), ("dst_block_ids", dst_block_ids)):
            if isinstance(ids, (np.ndarray, str, bytes)) or not isinstance(ids, Sequence) or len(ids) != n:
                raise BlockIdError(
                    f"{what} must be a list of {n} id lists, one per KV group, got {type(ids).__name__}"
                    + (f" of {len(ids)}" if isinstance(ids, Sequence) else "")
                )
            for g, x in enumerate(ids):
                if isinstance(x, (int, np.integer)):
                    raise BlockIdError(
                        f"{what}[{g}] is {x!r}, not a list of ids: a mover built by groups() takes one id "
                        f"list per KV group"
                    )
        return [checked_pair(t, s, d, f"[{g}]")
                for g, (t, s, d) in enumerate(zip(self._templates, src_block_ids, dst_block_ids))]

    def _build(self, ids: list[tuple[np.ndarray, np.ndarray]]) -> tuple[DescriptorBuffer, int]:
        counts = [len(s) * t.count for (s, _), t in zip(ids, self._templates)]
        buf = self.pool.acquire(sum(counts))
        arr = buf.array
        m = 0
        for (sid, did), t in zip(ids, self._templates):
            if len(sid):
                m += t.fill(sid, did, arr[:, m:])
        s, d, z = arr[0, :m], arr[1, :m], arr[2, :m]
        if self._check_across and m:
            clash = first_overlap(d, z)
            if clash is not None:
                self.pool.release(buf)
                raise BlockIdError(
                    "two KV groups write the same destination bytes in this job (groups that share tensors "
                    "must use distinct blocks)"
                )
        cs, cd, cz = coalesce(s, d, z)
        if cz is not z:  # merged: the shorter arrays go back into the pinned buffer
            m = len(cz)
            arr[0, :m], arr[1, :m], arr[2, :m] = cs, cd, cz
        return buf, m

    def _by_ids(self, ids: list) -> Any:
        """The by-id transfer a one-group batch of these ids takes whole, or None."""
        steps = self._ids_steps
        if steps is None or not len(ids[0][0]):
            return None
        return steps[1][bisect_right(steps[0], len(ids[0][0]) * self._templates[0].count) - 1]

    def _ids_buffer(self, ids: list) -> tuple[DescriptorBuffer, int]:
        """The ids in a pooled buffer (rows 0 and 1), and the descriptors they stand for."""
        (sid, did), = ids
        n = len(sid)
        buf = self.pool.acquire(n)
        buf.array[0, :n], buf.array[1, :n] = sid, did
        return buf, n * self._templates[0].count

    def _reap(self) -> None:
        """Hand back the buffers of completed jobs; jobs complete in order on one stream."""
        q, c = self._inflight, self._completion
        while q and c.done(q[0].end):
            job = q[0]
            st = job.staged
            if st is not None and st.finish is not None and not st.finish.done():
                break  # the device copy is done, the copy out to pageable memory is not yet
            q.popleft()
            error = job.error
            late = deferred.failure(job.issued) if job.issued else None
            if late is not None and error is None:  # failed on another thread, after submit
                error = f"{type(late).__name__}: {late}"
            if error is None and st is not None and st.finish is not None and st.finish.exception() is not None:
                e = st.finish.exception()
                error = f"{type(e).__name__}: {e}"
            seconds = c.seconds(job.start, job.end)
            c.recycle(job.start, job.end)
            self.pool.release(job.buffer)
            if st is not None:
                self._stager.release(st)
            self._results.append(TransferResult(
                job.job_id, error is None, job.nbytes if error is None else 0,
                seconds, job.descriptors, error,
            ))


def _by_ids_steps(fn: SwapFn, template: DescriptorTemplate) -> Optional[tuple[tuple[int, ...], tuple]]:
    """``(starts, by_ids)``: per step of the route that takes this template's batches whole
    (by descriptor count), the transfer's by-id capability bound to the template (the
    template goes to the device here, once), or None; None where no step offers one."""
    sizes = template.chunk_sizes
    steps = fn.whole_batch_steps(sizes[0], sizes[-1])
    if steps is None:
        return None
    bound: dict[int, Any] = {}
    for f in steps[1]:
        if f is not None and id(f) not in bound:
            try:
                make = getattr(f, "by_ids", None)
                bound[id(f)] = make(template) if callable(make) else None
            except Exception:  # the descriptor path serves instead
                bound[id(f)] = None
    out = tuple(None if f is None else bound[id(f)] for f in steps[1])
    return (steps[0], out) if any(b is not None for b in out) else None


def _wait_from_worker(c: Any, marker: Any) -> None:
    with c.device_guard():  # the worker thread's current device is the mover's
        c.wait(marker)
