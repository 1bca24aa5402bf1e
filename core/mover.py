"""BlockMover: the one object an engine holds to move KV blocks between host and device.

Built once from the per-layer tensors of both sides, it derives where every block lives,
resolves the copy route once, and then per step turns two lists of block ids into
descriptors (one numpy broadcast over all layers, chunks and ids, into a pooled pinned
buffer), coalesces contiguous runs, and enqueues the copy on its own transfer stream after
the work already queued on the compute stream.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np

from .completion import CudaCompletion, HostCompletion
from .descriptors import as_int64, coalesce
from .errors import ConfigurationError, InvalidTransferError
from .errors import BlockIdError, BlockLayoutError, MoverClosedError, TensorPlacementError, UnpinnedMemoryError
from .pinned_pool import DescriptorBuffer, DescriptorPool
from .regions import BlockDim, DescriptorTemplate, pair_regions
from .resolver import resolve
from .swapfn import SwapFn
from .types import Direction, DirectionLike, Policy

Tensors = Union[Any, Sequence[Any]]


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


@dataclass(eq=False)
class _Job:
    job_id: int
    buffer: DescriptorBuffer
    nbytes: int
    descriptors: int
    start: Any
    end: Any
    error: Optional[str] = None


class BlockMover:
    """Copy blocks from ``src_tensors[k]`` to ``dst_tensors[k]`` for every k, by block id.

    :param src_tensors: a tensor or a sequence of tensors (one per layer, or per K/V).
    :param dst_tensors: as many tensors; each may differ from its source in shape and
        block count, but a block must be the same chunks of the same sizes on both sides.
    :param direction: ``"h2d"`` (sources on the host), ``"d2h"`` (destinations on the
        host) or ``"d2d"`` (both sides on one device). The device side may also be host
        memory: the host reference then copies.
    :param block_dim: the dimension that indexes blocks, or a ``(src, dst)`` pair;
        vLLM's FlashAttention layout ``(2, num_blocks, ...)`` is ``block_dim=1``.
    :param policy: passed to :func:`kvswap.resolve` (SM budget, forced route).
    :param stream: the transfer stream on a GPU (default: a new one).
    :raises BlockLayoutError: blocks that are not contiguous chunks, or chunks that differ.
    :raises TensorPlacementError: tensors on the wrong device for ``direction``.
    :raises UnpinnedMemoryError: pageable host tensors for a route that needs pinned ones.

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
    ) -> None:
        self.direction = Direction.parse(direction)
        src, dst = _tensor_list(src_tensors, "src_tensors"), _tensor_list(dst_tensors, "dst_tensors")
        if len(src) != len(dst):
            raise BlockLayoutError(
                f"src_tensors has {len(src)} tensor(s) but dst_tensors has {len(dst)}; pass one destination per source"
            )
        device = _device_side(src, dst, self.direction)
        self._template: DescriptorTemplate = pair_regions(src, dst, block_dim)
        self._fn: SwapFn = resolve(
            self.direction,
            device="cpu" if device.type == "cpu" else str(device),
            block_bytes=list(self._template.chunk_sizes),
            policy=policy,
        )
        pinned_for = _pinned_routes(self._fn, on_device=device.type != "cpu")
        if pinned_for:
            _require_pinned(src if self.direction.src_is_host else dst, self.direction, pinned_for)
        if device.type == "cpu":
            if stream is not None:
                raise ConfigurationError(f"stream={stream!r}: a mover between host tensors has no stream")
            self._completion: Any = HostCompletion()
        else:
            self._completion = CudaCompletion(device.index or 0, stream)
        self.pool = DescriptorPool(pinned=device.type != "cpu")
        self._tensors: Optional[tuple[list, list]] = (src, dst)  # the memory the addresses point into
        self._inflight: deque[_Job] = deque()
        self._results: deque[TransferResult] = deque()
        self._next_id = 1
        self._closed = False

    # -- what it resolved ----------------------------------------------------------------
    @property
    def swap_fn(self) -> SwapFn:
        """The copy function resolved at construction."""
        return self._fn

    def explain(self) -> str:
        """Why this route was chosen (the resolver's decision trace)."""
        return self._fn.explain()

    @property
    def stream(self) -> Any:
        """The transfer stream jobs are enqueued on (None for a host-only mover)."""
        return self._completion.stream

    @property
    def block_bytes(self) -> int:
        """Bytes moved per block id, over every tensor pair."""
        return self._template.block_bytes

    @property
    def chunks_per_block(self) -> int:
        """Descriptors per block id before coalescing, over every tensor pair."""
        return self._template.count

    @property
    def num_src_blocks(self) -> int:
        return self._template.src_blocks

    @property
    def num_dst_blocks(self) -> int:
        return self._template.dst_blocks

    @property
    def in_flight(self) -> int:
        """Jobs whose completion has not been observed yet (each holds a descriptor buffer)."""
        return len(self._inflight)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- per step ------------------------------------------------------------------------
    def submit(self, src_block_ids: Any, dst_block_ids: Any) -> int:
        """Copy block ``src_block_ids[i]`` to block ``dst_block_ids[i]`` in every tensor pair.

        Ids are lists, numpy arrays or CPU tensors of integers. Everything is checked
        before anything is enqueued; the copy starts after the work already queued on the
        current (compute) stream and runs on the mover's transfer stream.

        :return: the job id :meth:`poll` and :meth:`wait` refer to.
        :raises BlockIdError: ids out of range or negative, unequal in number, not
            integers, or a destination id repeated.
        :raises MoverClosedError: after :meth:`close`.
        """
        if self._closed:
            raise MoverClosedError("submit() after close(): this BlockMover no longer moves blocks")
        sid, did = self._checked_ids(src_block_ids, dst_block_ids)
        self._reap()
        buf, m = self._build(sid, did)
        arr, c = buf.array, self._completion
        error = None
        with c.device_guard():
            c.order_after_compute()
            start = c.mark()
            try:
                if m:
                    self._fn(arr[0, :m], arr[1, :m], arr[2, :m], stream=c.stream)
            except BaseException as e:
                # Part of the batch may be enqueued: the buffer stays with a failed job
                # until the end marker shows the stream is past it.
                error = e
            end = c.mark()
        job_id = self._next_id
        self._next_id += 1
        self._inflight.append(_Job(job_id, buf, len(sid) * self._template.block_bytes, m, start, end,
                                   None if error is None else f"{type(error).__name__}: {error}"))
        if error is not None:
            raise error
        return job_id

    def descriptors(self, src_block_ids: Any, dst_block_ids: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The descriptors ``submit`` would enqueue for these ids, after coalescing, as
        copies ``(src addresses, dst addresses, sizes)``; nothing is copied. Same checks
        as :meth:`submit`."""
        if self._closed:
            raise MoverClosedError("descriptors() after close()")
        sid, did = self._checked_ids(src_block_ids, dst_block_ids)
        buf, m = self._build(sid, did)
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
            self._completion.wait(q[k].end)
            self._reap()

    def close(self) -> None:
        """Wait for every job, then refuse further submits. Results stay available to
        :meth:`poll`. Idempotent; also what leaving a ``with`` block does."""
        if self._closed:
            return
        self.wait()
        self._closed = True
        self.pool.clear()
        self._tensors = None

    def __enter__(self) -> BlockMover:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        # The device may still read descriptors or tensors of jobs nobody waited for.
        try:
            if not self._closed and self._inflight:
                self._completion.wait(self._inflight[-1].end)
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._inflight)} in flight"
        return (f"<kvswap.BlockMover {self.direction} {self._template.count} chunk(s)/block, "
                f"{self.block_bytes} B/block, {', '.join(self._fn.impls)}; {state}>")

    # -- internals -----------------------------------------------------------------------
    def _checked_ids(self, src_block_ids: Any, dst_block_ids: Any) -> tuple[np.ndarray, np.ndarray]:
        t = self._template
        sid = _ids(src_block_ids, "src_block_ids")
        did = _ids(dst_block_ids, "dst_block_ids")
        if len(sid) != len(did):
            raise BlockIdError(
                f"src_block_ids has {len(sid)} ids but dst_block_ids has {len(did)}; they pair up one to one"
            )
        if len(sid):
            _in_range(sid, "src_block_ids", t.src_blocks, "source")
            _in_range(did, "dst_block_ids", t.dst_blocks, "destination")
            if len(did) > 1:
                s = np.sort(did)
                rep = s[1:] == s[:-1]
                if rep.any():
                    v = s[1:][rep][0]
                    i, j = np.flatnonzero(did == v)[:2]
                    raise BlockIdError(
                        f"dst_block_ids[{i}] and dst_block_ids[{j}] are both {int(v)}: a destination block "
                        f"may be written once per job"
                    )
        return sid, did

    def _build(self, sid: np.ndarray, did: np.ndarray) -> tuple[DescriptorBuffer, int]:
        buf = self.pool.acquire(len(sid) * self._template.count)
        arr = buf.array
        m = self._template.fill(sid, did, arr)
        s, d, z = arr[0, :m], arr[1, :m], arr[2, :m]
        cs, cd, cz = coalesce(s, d, z)
        if cz is not z:  # merged: the shorter arrays go back into the pinned buffer
            m = len(cz)
            arr[0, :m], arr[1, :m], arr[2, :m] = cs, cd, cz
        return buf, m

    def _reap(self) -> None:
        """Hand back the buffers of completed jobs; jobs complete in order on one stream."""
        q, c = self._inflight, self._completion
        while q and c.done(q[0].end):
            job = q.popleft()
            seconds = c.seconds(job.start, job.end)
            c.recycle(job.start, job.end)
            self.pool.release(job.buffer)
            self._results.append(TransferResult(
                job.job_id, job.error is None, job.nbytes if job.error is None else 0,
                seconds, job.descriptors, job.error,
            ))


def _tensor_list(tensors: Tensors, what: str) -> list:
    import torch

    items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not items:
        raise BlockLayoutError(f"{what} is empty; pass at least one tensor")
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise BlockLayoutError(f"{what}[{i}] is a {type(t).__name__}, not a torch.Tensor")
    return items


def _device_side(src: list, dst: list, direction: Direction) -> Any:
    """The device of the non-host side(s); checks that the host side is on the host."""
    if direction is Direction.D2D:
        host, dev, host_name, dev_name, role = [], src + dst, "", "src_tensors and dst", ""
    else:
        host, dev = (src, dst) if direction.src_is_host else (dst, src)
        host_name, dev_name = ("src", "dst") if direction.src_is_host else ("dst", "src")
        role = "sources" if direction.src_is_host else "destinations"
    for i, t in enumerate(host):
        if t.device.type != "cpu":
            raise TensorPlacementError(
                f"{host_name}_tensors[{i}] is on {t.device}, but for direction {direction!s} the {role} "
                f"must be host (CPU) tensors"
            )
    devices = {t.device for t in dev}
    if len(devices) > 1:
        raise TensorPlacementError(
            f"{dev_name}_tensors are on {sorted(map(str, devices))}; a mover serves one device"
        )
    device = devices.pop()
    if device.type == "meta":
        raise TensorPlacementError(f"{dev_name}_tensors are meta tensors, which hold no memory")
    if device.type not in ("cpu", "cuda"):
        raise TensorPlacementError(
            f"{dev_name}_tensors are on {device}; BlockMover drives streams through torch.cuda (CUDA or ROCm)"
        )
    return device


def _pinned_routes(fn: SwapFn, on_device: bool) -> list[str]:
    """The routes that may copy and need page-locked host memory.

    Every route's implementation and small-batch implementation count; so do the
    fallbacks (they take the descriptors a route's constraints refuse) when a device
    reads the host memory, since a kernel on pageable memory faults the device. A mover
    between host tensors has no device access, and on a CPU no memory can be pinned: there
    a fallback that declares the need (Triton's interpreter) does not impose it.
    """
    names = set()
    for r in fn.plan.routes:
        names.update(n for n in (r.impl, r.small_batch_impl) if n)
        if on_device:
            names.update(r.fallbacks)
    need = {c.name for c in fn.plan.candidates if c.constraints.get("requires_pinned")}
    return sorted(names & need)


def _require_pinned(host: list, direction: Direction, routes: list[str]) -> None:
    name = "src" if direction.src_is_host else "dst"
    for i, t in enumerate(host):
        if not t.is_pinned():
            raise UnpinnedMemoryError(
                f"{name}_tensors[{i}] is pageable host memory, but the route(s) {', '.join(routes)} need "
                f"pinned (page-locked) memory; allocate it with pin_memory=True"
            )


def _ids(ids: Any, what: str) -> np.ndarray:
    try:
        return as_int64(ids, what)
    except InvalidTransferError as e:
        raise BlockIdError(str(e)) from None


def _in_range(ids: np.ndarray, what: str, limit: int, side: str) -> None:
    if ids.min() < 0 or ids.max() >= limit:
        i = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise BlockIdError(
            f"{what}[{i}]={int(ids[i])} is out of range: the {side} tensors hold {limit} blocks (0..{limit - 1})"
        )
