"""``triton.staged``: scattered device chunks through a device staging buffer, whole runs
over the link.

A copy kernel that reads or writes host memory reaches the link's speed but holds its SMs
for the whole transfer; the copy engines leave the SMs alone but slow down on small chunks.
A staged copy does each part where it is fast. On the device, the Triton kernel
(:mod:`.by_ids_jit`, :mod:`.jit`) gathers (device to host) or scatters (host to device)
the scattered chunks to or from a staging buffer in device memory, at memory speed, in a
burst that is short beside the transfer (about 3% of it at 2 TB/s against 55 GB/s). Over
the link, the bound batch route (:attr:`kvswap.BindContext.link`, the copy engines) moves
the slot of each block to its host run: one descriptor per run and block, and runs of
consecutive host blocks merge. A block-major host cache (:func:`kvswap.host_cache`) is one
run per block.

The buffer is two halves used in turn: while one crosses the link on the route's own
streams (:data:`LINK_STREAMS`, which overlap the copy engines' cost per descriptor), the other is gathered or scattered on the caller's; events order each half's reuse.
It is allocated once per binding (a BlockMover's, or a SwapFn's) and bounded by
``Policy.staging_bytes``; a job larger than a half moves in slices.

The Triton backend owns it because what makes it staged is the device-side kernel, which
runs on any Triton GPU platform; the link is whichever batch route the platform registers.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from kvswap.registry import deferred
from kvswap.memory.allocation import allocating
from kvswap.addressing.descriptors import merge_runs
from kvswap.registry.impl import BindContext, CopyImpl, TransferFn
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


class _Halves:
    """A staging buffer of two halves and the events that order their reuse.

    Device to host, per slice on half ``h``: the caller's stream waits until the link let
    go of ``h`` (``free``), the kernel gathers into it (``ready``), the link stream waits
    for that and copies it out (``free`` again). Host to device the other way round: the
    link fills ``h`` once the kernel is done with it, the caller's stream scatters it once
    filled. In the interpreter every step runs at once, in order.
    """

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
        if device_index is None:
            self.link_stream = None
            self.links: tuple = (None,) * max(1, link_streams)  # in order, at once
        else:
            self.links = tuple(own_stream(device_index, self) for _ in range(max(1, link_streams)))
            self.link_stream = self.links[0]
            self.ready = (torch.cuda.Event(), torch.cuda.Event())
            self.free = (torch.cuda.Event(), torch.cuda.Event())
            self.start = torch.cuda.Event()
            # Per half, an event per further link stream: the first link stream joins them.
            self.joined = tuple(tuple(torch.cuda.Event() for _ in self.links[1:]) for _ in range(2))

    def caller(self, stream: Any) -> Any:
        """The caller's stream as a torch stream (None: the current one)."""
        if self.link_stream is None:
            return None
        import torch

        if stream is None:
            return torch.cuda.current_stream(self.device_index)
        if isinstance(stream, int) and not isinstance(stream, bool):
            return torch.cuda.ExternalStream(stream, device=self.device_index)
        return stream

    def run(self, slices: Any, to_host: bool, stream: Any) -> None:
        """Run ``slices``: ``(device_op(h, stream), link_op(h, streams, gate))`` pairs for half
        ``h``; ``link_op`` may spread its copies over the link streams it is given, each
        stream it uses waiting for the event ``gate`` first. The
        caller's stream ends after every slice's link (device to host) or scatter."""
        s, link, links = self.caller(stream), self.link_stream, self.links
        if link is None:
            for device_op, link_op in slices:
                h, self.turn = self.turn, self.turn ^ 1
                if to_host:
                    device_op(h, None)
                    link_op(h, links, None)
                else:
                    link_op(h, links, None)
                    device_op(h, None)
            return
        last = None
        if not to_host:  # the link reads the host no sooner than the caller's stream asks
            self.start.record(s)
            for ls in links:
                ls.wait_event(self.start)
        for device_op, link_op in slices:
            h, self.turn = self.turn, self.turn ^ 1
            ready, free = self.ready[h], self.free[h]
            if to_host:
                s.wait_event(free)
                device_op(h, s)
                ready.record(s)
                self._join(h, link_op(h, links, ready))
                free.record(link)
                last = free
            else:
                self._join(h, link_op(h, links, free))
                ready.record(link)
                s.wait_event(ready)
                device_op(h, s)
                free.record(s)
        if last is not None:
            s.wait_event(last)

    def _join(self, h: int, used: int) -> None:
        """The first link stream waits for the ``used - 1`` further ones of half ``h``."""
        for ls, ev in zip(self.links[1:used], self.joined[h]):
            ev.record(ls)
            self.link_stream.wait_event(ev)


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
        end to end in a half, so those adjacent on the host cross the link as one."""
        if not len(sizes):
            return
        halves = self.halves()
        host, dev = (dst, src) if self.to_host else (src, dst)
        host, dev, sizes = _split(host, dev, sizes, halves.half)
        order = np.argsort(host, kind="stable")
        host, dev, sizes = host[order], dev[order], sizes[order]
        ends = np.cumsum(sizes)
        slices, lo = [], 0
        while lo < len(sizes):
            hi = int(np.searchsorted(ends, (ends[lo - 1] if lo else 0) + halves.half, side="right"))
            slices.append(self._raw_slice(halves, host[lo:hi], dev[lo:hi], sizes[lo:hi]))
            lo = hi
        halves.run(slices, self.to_host, stream)

    def _raw_slice(self, halves: _Halves, host: np.ndarray, dev: np.ndarray, sizes: np.ndarray) -> tuple:
        rel = np.cumsum(sizes) - sizes

        def device_op(h: int, s: Any) -> None:
            staged = halves.base[h] + rel
            if self.to_host:
                self.kernel(dev, staged, sizes, s)
            else:
                self.kernel(staged, dev, sizes, s)

        def link_op(h: int, streams: tuple, gate: Any) -> int:
            staged = halves.base[h] + rel
            return self._link(staged, host, sizes, streams, gate)

        return device_op, link_op

    def _link(self, staged: np.ndarray, host: np.ndarray, sizes: np.ndarray, streams: tuple, gate: Any) -> int:
        """Copy the runs over the link, spread over up to ``len(streams)`` streams in parts
        of equal bytes, each stream used waiting for ``gate`` (an event; None: nothing)
        first; returns how many streams were used."""
        a, b, z = merge_runs(staged, host, sizes) if self.to_host else merge_runs(host, staged, sizes)
        return self._issue(a, b, z, streams, gate)

    def _issue(self, a: np.ndarray, b: np.ndarray, z: np.ndarray, streams: tuple, gate: Any) -> int:
        """:meth:`_link` for runs already merged: ``a`` to ``b``, ``z`` bytes each."""
        parts = max(1, min(len(streams), len(z) // MIN_LINK_DESCRIPTORS))
        if parts == 1:
            cuts = [0, len(z)]
        else:
            ends = np.cumsum(z)
            cuts = [0, *np.searchsorted(ends, ends[-1] * np.arange(1, parts) / parts, side="right").tolist(), len(z)]
        used = 0
        # These arrays live for this call only: a link that issues later must copy them
        # (not stable), and whatever it leaves to another thread still reaches the caller's job.
        with deferred.collect(stable=False) as issued:
            for lo, hi, stream in zip(cuts, cuts[1:], streams):
                if hi > lo:
                    if gate is not None:
                        stream.wait_event(gate)
                    self.link(a[lo:hi], b[lo:hi], z[lo:hi], stream)
                    used += 1
        for item in issued:
            deferred.report(item)
        return used

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


class StagedByIds:
    """``fn(src_ids, dst_ids, stream)``: a mover's blocks through the staging buffer, a
    half's worth of blocks (one slot each) per slice, in host block order."""

    def __init__(self, staged: StagedCopy, runs: Runs, kernels: tuple, slots: int) -> None:
        self.staged, self.runs, self.kernels, self.slots = staged, runs, kernels, slots
        self.slot_ids = np.arange(slots, dtype=np.int64)
        # A full slice's runs in the staging half, relative to its base, and their sizes.
        self.slot_rel = (self.slot_ids[:, None] * runs.slot_bytes + runs.rel[None, :]).ravel()
        self.slot_sizes = np.tile(runs.size, slots)
        self.note = (f"staged: {runs.count} link run(s) of {runs.smallest}+ bytes per block, "
                     f"{slots} block(s) per slice")

    def __call__(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: Any = None) -> None:
        if not len(src_ids):
            return
        st = self.staged
        host_ids, dev_ids = (dst_ids, src_ids) if st.to_host else (src_ids, dst_ids)
        order = np.argsort(host_ids, kind="stable")
        host_ids, dev_ids = host_ids[order], dev_ids[order]
        halves = st.halves()
        # Built one at a time as the halves take them: each slice's runs are ready before its
        # gather is launched, so its link is enqueued right behind it.
        slices = (self._slice(halves, host_ids[lo:lo + self.slots], dev_ids[lo:lo + self.slots])
                  for lo in range(0, len(host_ids), self.slots))
        halves.run(slices, st.to_host, stream)

    def _slice(self, halves: _Halves, host_ids: np.ndarray, dev_ids: np.ndarray) -> tuple:
        st, r = self.staged, self.runs
        k = len(host_ids)
        slots = self.slot_ids[:k]
        m = k * r.count
        host = (r.base[None, :] + host_ids[:, None] * r.stride[None, :]).ravel()
        rel, sizes = self.slot_rel[:m], self.slot_sizes[:m]
        # Merged relative to the half's base, which moves every run of the half alike.
        a, b, z = merge_runs(rel, host, sizes) if st.to_host else merge_runs(host, rel, sizes)

        def device_op(h: int, s: Any) -> None:
            if st.to_host:
                self.kernels[h](dev_ids, slots, s)
            else:
                self.kernels[h](slots, dev_ids, s)

        def link_op(h: int, streams: tuple, gate: Any) -> int:
            base = halves.base[h]
            return st._issue(a + base, b, z, streams, gate) if st.to_host else st._issue(a, b + base, z, streams, gate)

        return device_op, link_op


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
        description="Triton gather/scatter through a device staging buffer, whole runs over the link "
                    "on the copy engines",
    )
