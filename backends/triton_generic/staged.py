"""``triton.staged``: scattered device chunks through a device staging buffer, whole runs
over the link.

A copy kernel that reads or writes host memory reaches the link's speed but holds its SMs
for the whole transfer; the copy engines leave the SMs alone but slow down on small chunks.
A staged copy does each part where it is fast. On the device, the Triton kernel
(:mod:`.by_ids_jit`, :mod:`.jit`) gathers (device to host) or scatters (host to device)
the scattered chunks to or from a staging buffer in device memory, at memory speed, in a
burst that is short beside the transfer (device memory is tens of times faster than the
link). Over the link, the bound batch route (:attr:`kvswap.BindContext.link`, the copy
engines) moves the slot of each block to its host run: one descriptor per run and block,
and runs of consecutive host blocks merge. A block-major host cache (:func:`kvswap.host_cache`) is one
run per block.

The buffer is two halves used in turn: while one crosses the link on the route's own
streams (:data:`LINK_STREAMS`, which overlap the copy engines' cost per descriptor), the other is gathered or scattered on the caller's; events order each half's reuse.
It is allocated once per binding (a BlockMover's, or a SwapFn's) and bounded by
``Policy.staging_bytes``; a job larger than a half moves in slices.

The Triton backend owns it because what makes it staged is the device-side kernel, which
runs on any Triton GPU platform; the link is whichever batch route the platform registers.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from kvswap.memory.allocation import allocating
from kvswap.registry.impl import BindContext, ByIdsFn, CopyImpl, TransferFn
from kvswap.registry.streams import own_stream
from kvswap.addressing.runs import SLOT_ALIGN, Runs, host_runs
from kvswap.types import DeviceInfo, Direction

from .by_ids import KernelCopyByIds
from .launch import DEFAULT_PLANS, TilePlan, interpreting

NAME = "triton.staged"
# SMs of the device-side gather or scatter. On an H100 (512 blocks of 4-32 KiB chunks), 16 to
# 132 of them kept the route within a few % of the link's ceiling (tests/bench/bench_staged.py);
# bf16 GEMMs beside it lost less with more, but on 132 the transfer ran 1-5% slower than on 32
# and the step was no shorter (docs/design.md, "A third way"; tests/bench/bench_staged_sms.py).
DEVICE_SMS = 32
# Copy-engine streams a half's link is spread over. A batch call costs the copy engine a few
# us per descriptor, one after another: on an H100 and an H200, runs of 256 KiB reached
# 0.65-0.89 of the contiguous copy on one stream, 0.89-0.95 on four (docs/benchmarks.md).
LINK_STREAMS = 4
# Descriptors a stream takes at least: each further batch call costs the caller's thread
# tens of microseconds, which a few descriptors' overlap does not repay.
MIN_LINK_DESCRIPTORS = 8


class Slice(NamedTuple):
    """One slice of a staged job, prepared before any slice is issued: the half it uses,
    its device side (``device(stream)`` enqueues the gather or scatter; ``cancel()`` where
    it never will) and its link, ``(src, dst, sizes)`` per link stream it is spread over."""

    half: int
    device: Any
    links: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]


class Pipeline:
    """The streams and events that order a staged job's slices, issued all at once.

    Each half ``h`` has two events. Device to host: the gather into ``h`` waits ``free[h]``
    (its last link let go of it) and records ``ready[h]``; the link waits ``ready[h]`` and
    records ``free[h]``. Host to device the other way round: the link fills ``h`` after
    ``free[h]`` (its last scatter read it) and records ``ready[h]``; the scatter waits
    ``ready[h]`` and records ``free[h]``. A wait captures the event's last record enqueued
    before it, so :meth:`issue` keeps one side a slice ahead of the other (the device side
    device to host, the link host to device) and enqueues every wait after the record it
    means: slice ``k + 2`` reuses slice ``k``'s half only once ``k`` has let go of it, and
    the host issues everything without waiting for the device.

    :param links: the link streams (the first joins the others after each slice).
    :param event: makes an event (``torch.cuda.Event``).
    """

    def __init__(self, links: tuple, event: Any) -> None:
        self.links = links
        self.ready = (event(), event())
        self.free = (event(), event())
        self.start = event()
        # Per half, an event per further link stream: the first link stream joins them.
        self.joined = tuple(tuple(event() for _ in links[1:]) for _ in range(2))

    def issue(self, slices: list[Slice], to_host: bool, s: Any, link: TransferFn) -> None:
        """Enqueue every slice on the caller's stream ``s`` (the device side) and the link
        streams; ``s`` ends after every slice's link (device to host) or scatter."""
        n = len(slices)
        done = 0  # slices whose device side was enqueued (or cancelled)
        try:
            if to_host:
                self._gather(slices[0], s)
                done = 1
                for k in range(n):
                    if k + 1 < n:  # its half was let go by link k - 1, enqueued before
                        self._gather(slices[k + 1], s)
                        done = k + 2
                    self._link(slices[k], link, self.ready, self.free)
                s.wait_event(self.free[slices[-1].half])
            else:
                self.start.record(s)  # the link reads the host no sooner than the caller's stream asks
                for ls in self.links:
                    ls.wait_event(self.start)
                self._link(slices[0], link, self.free, self.ready)
                for k in range(n):
                    if k + 1 < n:  # its half was let go by scatter k - 1, enqueued before
                        self._link(slices[k + 1], link, self.free, self.ready)
                    self._scatter(slices[k], s)
                    done = k + 1
        finally:
            for sl in slices[done:]:  # never enqueued: what each packed goes back
                sl.device.cancel()

    def _gather(self, sl: Slice, s: Any) -> None:
        s.wait_event(self.free[sl.half])
        sl.device(s)
        self.ready[sl.half].record(s)

    def _scatter(self, sl: Slice, s: Any) -> None:
        s.wait_event(self.ready[sl.half])
        sl.device(s)
        self.free[sl.half].record(s)

    def _link(self, sl: Slice, link: TransferFn, after: tuple, then: tuple) -> None:
        """The slice's link on its streams, each waiting ``after[half]``; the first link
        stream joins the others and records ``then[half]``."""
        h, first = sl.half, self.links[0]
        for (a, b, z), ls in zip(sl.links, self.links):
            ls.wait_event(after[h])
            link(a, b, z, ls)
        for ls, ev in zip(self.links[1:len(sl.links)], self.joined[h]):
            ev.record(ls)
            first.wait_event(ev)
        then[h].record(first)


class _Halves:
    """A staging buffer of two halves used in turn, and, on a device, the pipeline that
    orders their reuse. In the interpreter every step runs at once, in order."""

    def __init__(self, nbytes: int, device_index: Optional[int], link_streams: int = 1) -> None:
        import torch

        self.half = max(SLOT_ALIGN, nbytes // 2 // SLOT_ALIGN * SLOT_ALIGN)
        self.device_index = device_index
        where = "cpu" if device_index is None else f"cuda:{device_index}"
        with allocating("the staged route's device staging buffer (Policy.staging_bytes)", 2 * self.half,
                        "host" if device_index is None else "device"):
            self.buffer = torch.empty(2 * self.half, dtype=torch.uint8, device=where)
        self.base = (self.buffer.data_ptr(), self.buffer.data_ptr() + self.half)
        self.turn = 0
        self.streams = max(1, link_streams)  # a slice's link is spread over up to this many streams
        self.pipeline: Optional[Pipeline] = None
        if device_index is not None:
            links = tuple(own_stream(device_index, self) for _ in range(self.streams))
            self.pipeline = Pipeline(links, torch.cuda.Event)

    @property
    def links(self) -> tuple:
        return () if self.pipeline is None else self.pipeline.links

    def take(self, slices: int) -> int:
        """The half the first of ``slices`` slices uses; the next job's starts after them."""
        first = self.turn
        self.turn = (first + slices) % 2
        return first

    def caller(self, stream: Any) -> Any:
        """The caller's stream as a torch stream (None: the current one)."""
        import torch

        if stream is None:
            return torch.cuda.current_stream(self.device_index)
        if isinstance(stream, int) and not isinstance(stream, bool):
            return torch.cuda.ExternalStream(stream, device=self.device_index)
        return stream

    def issue(self, slices: list[Slice], to_host: bool, stream: Any, link: TransferFn) -> None:
        """Issue every slice (see :class:`Pipeline`)."""
        if self.pipeline is not None:
            self.pipeline.issue(slices, to_host, self.caller(stream), link)
            return
        for k, sl in enumerate(slices):
            try:
                if to_host:
                    sl.device(None)
                for a, b, z in sl.links:
                    link(a, b, z, None)
                if not to_host:
                    sl.device(None)
            except BaseException:
                for rest in slices[k + 1:]:
                    rest.device.cancel()
                raise


def _parts(a: np.ndarray, b: np.ndarray, z: np.ndarray, streams: int) -> tuple:
    """A slice's link runs ``a`` to ``b`` (``z`` bytes each) in up to ``streams`` parts of
    equal bytes, at least :data:`MIN_LINK_DESCRIPTORS` each."""
    parts = max(1, min(streams, len(z) // MIN_LINK_DESCRIPTORS))
    if parts == 1:
        return ((a, b, z),)
    ends = np.cumsum(z)
    cuts = [0, *np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, side="right").tolist(), len(z)]
    return tuple((a[lo:hi], b[lo:hi], z[lo:hi]) for lo, hi in zip(cuts, cuts[1:]) if hi > lo)


def _merged(a: np.ndarray, b: np.ndarray, z: np.ndarray, firsts: np.ndarray) -> tuple:
    """The runs of a whole job merged where they follow each other on both sides, never
    across the start of a slice (``firsts``): ``(a, b, z, bounds)``, slice ``k``'s runs in
    ``bounds[k]:bounds[k + 1]``."""
    starts = np.ones(len(z), dtype=bool)
    starts[1:] = (a[:-1] + z[:-1] != a[1:]) | (b[:-1] + z[:-1] != b[1:])
    starts[firsts] = True
    idx = np.flatnonzero(starts)
    bounds = np.append(np.searchsorted(idx, firsts), len(idx))
    if len(idx) == len(z):
        return a, b, z, bounds
    return a[idx], b[idx], np.add.reduceat(z, idx), bounds


class _Eager:
    """A device side called when issued (raw descriptors: the kernel packs them then)."""

    __slots__ = ("call",)

    def __init__(self, call: Any) -> None:
        self.call = call

    def __call__(self, stream: Any) -> Any:
        return self.call(stream)

    def cancel(self) -> None:
        pass


class StagedCopy:
    """The bound ``triton.staged`` transfer: ``fn(src, dst, sizes, stream)`` for raw
    descriptors, and ``fn.by_ids(template)`` for a BlockMover (:class:`kvswap.registry.impl.ByIdsFn`).

    :param kernel: the device-side copy (device to device, on ``kernel.num_sms`` SMs).
    :param link: the batch route that crosses the link.
    :param direction: ``h2d`` or ``d2h``.
    :param staging_bytes: the bound on the staging buffer.
    """

    def __init__(self, kernel: KernelCopyByIds, link: TransferFn, direction: Direction, staging_bytes: int,
                 link_streams: int = LINK_STREAMS) -> None:
        self.kernel, self.link, self.direction = kernel, link, direction
        self.to_host = direction is Direction.D2H
        self.staging_bytes = staging_bytes
        self.link_streams = link_streams
        self._halves: Optional[_Halves] = None
        self.note = (f"device side on {kernel.num_sms} SMs, link on the copy engines ({link_streams} "
                     f"stream(s)), {staging_bytes / 2**20:g} MiB of device staging in two halves")

    @property
    def num_sms(self) -> int:
        """The SMs the device-side gather or scatter runs on."""
        return self.kernel.num_sms

    def halves(self) -> _Halves:
        if self._halves is None:
            self._halves = _Halves(self.staging_bytes, self.kernel.device_index, self.link_streams)
        return self._halves

    def __call__(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any = None) -> None:
        """Copy validated descriptors: each slice's descriptors in host address order, packed
        end to end in a half, so those adjacent on the host cross the link as one. Every
        slice is prepared, then all are issued at once (:class:`Pipeline`)."""
        if not len(sizes):
            return
        halves = self.halves()
        host, dev = (dst, src) if self.to_host else (src, dst)
        host, dev, sizes = _split(host, dev, sizes, halves.half)
        order = np.argsort(host, kind="stable")
        host, dev, sizes = host[order], dev[order], sizes[order]
        ends = np.cumsum(sizes)
        firsts, lo = [], 0
        while lo < len(sizes):  # as many descriptors as fill a half, from lo on
            firsts.append(lo)
            lo = int(np.searchsorted(ends, (ends[lo - 1] if lo else 0) + halves.half, side="right"))
        firsts = np.array(firsts, dtype=np.int64)
        first = halves.take(len(firsts))
        # Each descriptor's place in its slice's half, for every slice at once.
        of = np.repeat(np.arange(len(firsts)), np.diff(np.append(firsts, len(sizes))))
        before = np.where(firsts > 0, ends[firsts - 1], 0)
        staged = np.asarray(halves.base, dtype=np.int64)[(first + of) % 2] + (ends - sizes) - before[of]
        a, b, z, bounds = _merged(staged, host, sizes, firsts) if self.to_host else \
            _merged(host, staged, sizes, firsts)
        streams, kernel, to_host = halves.streams, self.kernel, self.to_host
        slices = []
        for k, lo in enumerate(firsts.tolist()):
            hi = int(firsts[k + 1]) if k + 1 < len(firsts) else len(sizes)
            d, t, n = dev[lo:hi], staged[lo:hi], sizes[lo:hi]
            call = ((lambda s, d=d, t=t, n=n: kernel(d, t, n, s)) if to_host else
                    (lambda s, d=d, t=t, n=n: kernel(t, d, n, s)))
            m0, m1 = bounds[k], bounds[k + 1]
            slices.append(Slice((first + k) % 2, _Eager(call), _parts(a[m0:m1], b[m0:m1], z[m0:m1], streams)))
        halves.issue(slices, to_host, stream, self.link)

    def by_ids(self, template: Any) -> Optional[StagedByIds]:
        """Copy a mover's blocks by id through the staging buffer, or None where the
        template's pieces do not suit the device-side kernel (not 8-byte aligned)."""
        return bind_staged(self, template)


def _split(host: np.ndarray, dev: np.ndarray, sizes: np.ndarray, most: int) -> tuple:
    """Descriptors longer than ``most`` bytes cut into pieces of at most ``most``."""
    if int(sizes.max()) <= most:
        return host, dev, sizes
    parts = -(-sizes // most)
    at = np.repeat(np.arange(len(sizes)), parts)
    k = np.arange(len(at)) - np.repeat(np.cumsum(parts) - parts, parts)
    off = k * most
    return host[at] + off, dev[at] + off, np.minimum(sizes[at] - off, most)


class StagedByIds(ByIdsFn):
    """``fn(src_ids, dst_ids, stream)``: a mover's blocks through the staging buffer, a
    half's worth of blocks (one slot each) per slice, in host block order."""

    def __init__(self, staged: StagedCopy, runs: Runs, kernels: tuple, slots: int) -> None:
        self.staged, self.runs, self.kernels, self.slots = staged, runs, kernels, slots
        self.slot_ids = np.arange(slots, dtype=np.int64)
        self.note = (f"staged: {runs.count} link run(s) of {runs.smallest}+ bytes per block, "
                     f"{slots} block(s) per slice")

    def __call__(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: Any = None) -> None:
        """Copy the blocks: :meth:`pack`, then its launch."""
        self.pack(src_ids, dst_ids)(stream)

    def pack(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> Job:
        """Every slice of a job prepared (its ids packed for its gather or scatter, its link
        runs merged and spread over the link streams); the returned launch issues them all
        at once (:class:`Pipeline`). A BlockMover packs before the job's start marker."""
        st, r, per = self.staged, self.runs, self.slots
        if not len(src_ids):
            return Job(st, [])
        host_ids, dev_ids = (dst_ids, src_ids) if st.to_host else (src_ids, dst_ids)
        order = np.argsort(host_ids, kind="stable")
        host_ids, dev_ids = host_ids[order], dev_ids[order]
        halves = st.halves()
        n = len(host_ids)
        count = -(-n // per)
        first = halves.take(count)
        # Every block's runs, host side and its slot in its slice's half, in host block order.
        i = np.arange(n)
        slot_base = np.asarray(halves.base, dtype=np.int64)[(first + i // per) % 2] + (i % per) * r.slot_bytes
        host = (r.base[None, :] + host_ids[:, None] * r.stride[None, :]).ravel()
        staged = (slot_base[:, None] + r.rel[None, :]).ravel()
        sizes = np.tile(r.size, n)
        firsts = np.arange(0, n, per) * r.count
        a, b, z, bounds = _merged(staged, host, sizes, firsts) if st.to_host else \
            _merged(host, staged, sizes, firsts)
        streams = halves.streams
        job = Job(st, [])
        try:
            for k in range(count):
                h = (first + k) % 2
                dev, slots = dev_ids[k * per:(k + 1) * per], self.slot_ids[:min(per, n - k * per)]
                device = self.kernels[h].pack(dev, slots) if st.to_host else self.kernels[h].pack(slots, dev)
                m0, m1 = bounds[k], bounds[k + 1]
                job.slices.append(Slice(h, device, _parts(a[m0:m1], b[m0:m1], z[m0:m1], streams)))
        except BaseException:
            job.cancel()
            raise
        return job


class Job:
    """A staged job's slices, prepared: ``job(stream)`` issues them all at once;
    ``job.cancel()`` where it never will (what each slice packed goes back)."""

    __slots__ = ("staged", "slices")

    def __init__(self, staged: StagedCopy, slices: list[Slice]) -> None:
        self.staged, self.slices = staged, slices

    def __call__(self, stream: Any = None) -> None:
        slices, self.slices = self.slices, []
        if slices:
            st = self.staged
            st.halves().issue(slices, st.to_host, stream, st.link)

    def cancel(self) -> None:
        slices, self.slices = self.slices, []
        for sl in slices:
            sl.device.cancel()


class _SlotTemplate:
    """The device-side kernel's template: the device pieces against one half's slots."""

    def __init__(self, template: Any, to_host: bool, runs: Runs, base: int) -> None:
        dev_base = np.asarray(template.src_base if to_host else template.dst_base, dtype=np.int64)
        dev_stride = np.asarray(template.src_stride if to_host else template.dst_stride, dtype=np.int64)
        slot_base = base + runs.piece_rel
        slot_stride = np.full_like(slot_base, runs.slot_bytes)
        self.sizes = np.asarray(template.sizes, dtype=np.int64)
        if to_host:
            self.src_base, self.src_stride, self.dst_base, self.dst_stride = dev_base, dev_stride, slot_base, slot_stride
        else:
            self.src_base, self.src_stride, self.dst_base, self.dst_stride = slot_base, slot_stride, dev_base, dev_stride


def bind_staged(staged: StagedCopy, template: Any) -> Optional[StagedByIds]:
    """``staged``'s by-id transfer for ``template``, or None where it does not suit."""
    runs = host_runs(template, host_is_src=not staged.to_host)
    halves = staged.halves()
    slots = halves.half // runs.slot_bytes
    if slots < 1:
        return None  # a block larger than half the staging buffer
    kernels = tuple(staged.kernel.by_ids(_SlotTemplate(template, staged.to_host, runs, b)) for b in halves.base)
    if any(k is None for k in kernels):
        return None
    return StagedByIds(staged, runs, kernels, slots)


def bind(ctx: BindContext) -> StagedCopy:
    """The factory: the device-side kernel on ``num_sms`` SMs (default :data:`DEVICE_SMS`,
    at most the device's) and the link (``ctx.link``)."""
    from .kernel import _device_index

    if ctx.link is None:
        raise ValueError("triton.staged needs a batch route for the link (BindContext.link)")
    sms = int(ctx.params.get("num_sms") or min(DEVICE_SMS, ctx.device.compute_units or DEVICE_SMS))
    kernel = KernelCopyByIds(num_sms=sms, device_index=_device_index(ctx.device),
                             tiles=TilePlan.from_params(ctx.params, DEFAULT_PLANS["d2d"]))
    return StagedCopy(kernel, ctx.link, ctx.direction, int(ctx.params.get("staging_bytes", 64 << 20)),
                      int(ctx.params.get("link_streams") or LINK_STREAMS))


def availability(device: DeviceInfo) -> Optional[str]:
    from .kernel import availability as kernel_availability

    return kernel_availability(device)


def staged_impl() -> CopyImpl:
    """``triton.staged`` as registered now (``cpu`` too while ``TRITON_INTERPRET=1``)."""
    from .kernel import GPU_PLATFORMS

    return CopyImpl(
        name=NAME,
        kind="staged",
        platforms=GPU_PLATFORMS + (("cpu",) if interpreting() else ()),
        directions=(Direction.H2D, Direction.D2H),
        factory=bind,
        availability=availability,
        requires_pinned=True,
        by_ids=True,
        description="Triton gather/scatter through a device staging buffer, whole runs over the link "
                    "on the copy engines",
    )
