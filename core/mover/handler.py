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

from typing import Any, Optional, Sequence, Union

import numpy as np

from ..addressing.regions import BlockDim, DescriptorTemplate
from ..errors import ConfigurationError, MoverClosedError
from ..registry.thresholds import Calibration
from ..resolution.swapfn import SwapFn
from ..types import DirectionLike, Policy
from .build import Setup
from .inputs import group_specs
from .results import Results
from .serial import serialized
from .submit import Submit
from .types import GroupLayout, KVGroup, Tensors

__all__ = ["BlockMover"]


class BlockMover(Setup, Submit, Results):
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
        self._device_descriptors = device_descriptors  # checked in _setup
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
        mover._device_descriptors = device_descriptors  # checked in _setup
        mover._setup(group_specs(groups), True, direction, policy, stream, dict(calibration=calibration, profiles=profiles),
                     issuing_thread)
        return mover

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

    @serialized
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

    def __enter__(self) -> BlockMover:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._inflight)} in flight"
        shape = "; ".join(f"{t.count} chunk(s)/block, {t.block_bytes} B/block" for t in self._templates)
        return f"<kvswap.BlockMover {self.direction} {shape}, {', '.join(self._fn.impls)}; {state}>"
