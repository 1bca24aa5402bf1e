"""``triton.kernel``'s ``by_ids`` capability: copy blocks by id, addresses made on the device.

A BlockMover's descriptors are ``base[p] + id * stride[p]`` for every piece ``p`` (one
contiguous chunk of one tensor pair) and every id. Building them on the host costs time
proportional to pieces x ids (layers x K/V x blocks) before the kernel can start; here
the template (bases, strides, sizes per piece) is uploaded once, when the capability is
bound, and a transfer sends only its two id arrays: packed into a pinned launch buffer
of the launcher's pool, read by the kernel from there when the batch is short or the
programs many (:data:`HOST_IDS_PROGRAMS`), uploaded first by
:func:`~.by_ids_jit.load_ids_kernel`, launched the same way, otherwise, and always where
the tile plan reads nothing from host memory (``host_tiles`` 0: device to device). One launch of
:func:`~.by_ids_jit.copy_by_ids_kernel` copies pieces x ids.

The caller guarantees what the descriptor path would check per call: the template was
validated once (chunks inside their tensors, destinations that do not overlap), and the
ids are in range with no destination repeated. Templates whose bases, strides or sizes
are not multiples of 8 bytes are declined (:func:`bind_by_ids` returns None): those take
the descriptor path. On platforms where the device reads host memory at other addresses
(ROCm ``hipHostRegister``), the host side's bases are translated once; an allocation is
mapped whole, so ``base + id * stride`` stays inside the mapping.

``triton.kernel`` binds :class:`KernelCopyByIds`, a :class:`KernelCopy` that offers the
capability; Triton and torch load in the methods.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from kvswap.memory.allocation import allocating
from kvswap.registry.impl import ByIdsFn

from .compiled import Variant, direct_parts, hook_is_set
from .launch import KernelCopy, Tile, batch_alignment

FIELDS = ("src_base", "src_stride", "dst_base", "dst_stride", "sizes")
# From this many programs on, the kernel reads the ids from pinned host memory however
# many tiles each program takes: enough programs hide the round trip each tile waits for
# its ids. On an H100 (4 KiB chunks, 512-20,000 rows, GPU time queued) reading them was
# within 3% of uploading them first at 16 and 32 programs, in both directions, while at
# 4 and 8 programs it took up to 1.6 times as long past 16 tiles a program (H200 alike)
# (tests/bench/bench_ids_reads.py). The upload costs a second launch.
HOST_IDS_PROGRAMS = 16


@dataclass(frozen=True)
class IdsLaunch:
    """What one call launched: ``n`` id pairs, ``items`` (pieces x n) rows, ``grid``
    programs, the ``tile``, and where the kernel read the ids: ``"host"`` (pinned
    launch buffer), ``"device"`` (uploaded first) or ``""`` (interpreter, or nothing launched)."""

    n: int
    items: int
    grid: int
    tile: Optional[Tile]
    ids: str = ""


def pack_template(template: Any) -> np.ndarray:
    """``[src_base | src_stride | dst_base | dst_stride | sizes]`` as one int64 array."""
    cols = [np.ascontiguousarray(np.asarray(getattr(template, f)), dtype=np.int64).ravel() for f in FIELDS]
    pieces = len(cols[-1])
    if pieces == 0 or any(len(c) != pieces for c in cols):
        raise ValueError(f"a template needs {', '.join(FIELDS)} of one length >= 1, got {[len(c) for c in cols]}")
    return np.concatenate(cols)


def bind_by_ids(copy: KernelCopy, template: Any) -> Optional[CopyByIds]:
    """``copy``'s by-id transfer for ``template``, or None where the template does not
    suit the kernel (a base, stride or size not a multiple of 8 bytes, or a size < 8)."""
    packed = pack_template(template)
    if batch_alignment(packed) < 8 or int(packed[-len(template.sizes):].min()) < 8:
        return None
    fn = CopyByIds(copy, packed)
    # A template's pieces fix the tile's row width, so one variant serves most batches:
    # compile it now (on a GPU), not on the engine's first transfer.
    fn.prepare()
    return fn


class CopyByIds(ByIdsFn):
    """``fn(src_ids, dst_ids, stream=None) -> IdsLaunch``: copy every piece of block
    ``src_ids[i]`` to block ``dst_ids[i]`` in one launch, on ``copy``'s SMs and device.

    :param copy: the bound kernel (SM budget, tile plan, device, address translation).
    :param packed: the template as :func:`pack_template` lays it out.
    """

    KEEP_LAUNCHES = 256

    def __init__(self, copy: KernelCopy, packed: np.ndarray) -> None:
        self.copy = copy
        self.pieces = len(packed) // len(FIELDS)
        p = self.pieces
        packed = packed.copy()
        for lo, fn in ((0, copy._translate_src), (2 * p, copy._translate_dst)):
            if fn is not None:  # the host side's bases, as the device reads them
                packed[lo:lo + p] = np.asarray(fn(packed[lo:lo + p]), dtype=np.int64)
        self.packed = packed
        self.block_bytes = int(packed[4 * p:].sum())
        sizes = packed[4 * p:]
        # Every piece one size: the kernel's loop bound, given (no reduction per tile).
        self.each = int(sizes[0]) >> 3 if (sizes == sizes[0]).all() else 0
        self.uniform = self.each > 0
        self.align = batch_alignment(packed)
        self._launches: dict[int, IdsLaunch] = {}
        self._variants: dict[tuple, Variant] = {}
        self._runtime: Any = None
        self._last_stream: Optional[tuple] = None  # (stream given, torch stream, raw handle)
        self.last_launch: Optional[IdsLaunch] = None
        if copy.device_index is None:
            self._tmpl: Any = None
            self._tmpl_ptr = 0
            self._cuda: Any = None
        else:
            import torch

            self._cuda = torch.cuda
            with allocating("a by-id kernel's block template", packed.nbytes, "device"):
                self._tmpl = torch.from_numpy(packed).to(f"cuda:{copy.device_index}")  # uploaded once
            self._tmpl_ptr = self._tmpl.data_ptr()
        self.note = (f"addresses derived on the device from {p} piece(s) (base, stride, size) uploaded once; "
                     f"a transfer sends only its block ids")

    def _plan(self, n: int) -> IdsLaunch:
        launch = self._launches.get(n)
        if launch is None:
            c = self.copy
            items = n * self.pieces
            tile = c.tiles.pick(items, n * self.block_bytes, c.num_sms, self.align)
            work = -(-items // tile.jobs) * tile.splits
            grid = min(c.num_sms, work)
            # host_tiles 0: always uploaded (a copy that does not cross the link waits on each read).
            host = c.tiles.host_tiles > 0 and (work <= grid * c.tiles.host_tiles or grid >= HOST_IDS_PROGRAMS)
            where = "" if c._pool is None else "host" if host else "device"
            launch = IdsLaunch(n, items, grid, tile, where)
            if len(self._launches) >= self.KEEP_LAUNCHES:
                self._launches.clear()
            self._launches[n] = launch
        return launch

    def __call__(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: Any = None) -> IdsLaunch:
        """Copy validated int64 id arrays; enqueued on ``stream`` (GPU) or done on return
        (interpreter)."""
        return self.pack(src_ids, dst_ids)(stream)

    def pack(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> Any:
        """The host half of a call: the ids packed into a pinned launch buffer and the
        launch arguments resolved now; the returned ``launch(stream) -> IdsLaunch``
        enqueues the kernel(s) that read them.
        A caller that records a start marker between the two times the device's part
        alone; ``launch.cancel()`` returns the buffer where nothing is launched."""
        n = len(src_ids)
        if n == 0:
            return _Later(self, IdsLaunch(0, 0, 0, None))
        launch = self._plan(n)
        if self.copy._pool is None:  # the interpreter copies at launch
            return _Later(self, launch, np.concatenate((src_ids, dst_ids)).astype(np.int64, copy=False))
        entry = self.copy._pool.take(2 * n)
        entry.view[:n] = src_ids
        entry.view[n:2 * n] = dst_ids
        try:
            calls = self._direct_calls(entry, launch)
        except BaseException:
            self.copy._pool.give(entry)
            raise
        return _Packed(self, entry, launch, calls)

    def launch_only(self, n: int) -> bool:
        """Whether a call of ``n`` id pairs is only launches: the kernel reads the ids where
        the call packed them, in pinned host memory, or an upload kernel copies them to the
        device first; every launch direct, no profiler hook set (:meth:`_direct`)."""
        return self.copy._pool is not None and n > 0 and self._direct(self._plan(n)) is not None

    # -- launching ---------------------------------------------------------------------------
    def _interpret(self, ids: np.ndarray, launch: IdsLaunch) -> None:
        import torch

        from .by_ids_jit import copy_by_ids_kernel

        t = launch.tile
        copy_by_ids_kernel[(launch.grid,)](torch.from_numpy(self.packed), torch.from_numpy(ids), launch.n,
                                           self.pieces, t.splits, self.each, JOBS=t.jobs, WORDS=t.words,
                                           ALIGN=t.align, CACHE=t.cache, UNIFORM=self.uniform, num_warps=t.warps)

    def _direct(self, launch: IdsLaunch) -> Optional[tuple[Variant, Optional[Variant]]]:
        """The compiled copy and, where the kernel reads the ids from the device, the ids'
        upload, when every launch of the call is direct and no launch hook is set; else None
        (the call goes through :meth:`_launch`)."""
        variant = self._variant(launch.tile)
        if not variant.direct or self._hooked():
            return None
        if launch.ids == "host":
            return variant, None
        upload = _upload_variant(self.copy.device_index)
        return (variant, upload) if upload.direct else None

    def _direct_calls(self, entry: Any, launch: IdsLaunch) -> Optional[tuple]:
        """The launches of a packed call, every argument but the stream resolved now
        (before the caller's start marker): ``(run, grid, function, metadata, args)`` each,
        ids upload first where the kernel reads them from the device. None where they are
        not direct (:meth:`_direct`)."""
        direct = self._direct(launch)
        if direct is None:
            return None
        variant, upload = direct
        if upload is None:
            ptr, calls = entry.host_ptr, ()
        else:
            self.copy._pool.device_buffer(entry)  # made on first need
            ptr, m = entry.dev_ptr, 2 * launch.n
            calls = ((upload.run, -(-m // UPLOAD_BLOCK), upload.function, upload.metadata,
                      (entry.host_ptr, ptr, m, UPLOAD_BLOCK)),)
        return calls + ((variant.run, launch.grid, variant.function, variant.metadata, self._args(launch, ptr)),)

    def _args(self, launch: IdsLaunch, ids_ptr: int) -> tuple:
        """The copy kernel's arguments, constexprs last, for ids at ``ids_ptr``."""
        t = launch.tile
        return (self._tmpl_ptr, ids_ptr, launch.n, self.pieces, t.splits, self.each, t.jobs, t.words, t.align,
                t.cache, self.uniform)

    def _enqueue(self, entry: Any, launch: IdsLaunch, calls: Optional[tuple], stream: Any) -> None:
        """Enqueue a packed call on ``stream`` with the copy's device current; between the
        caller's start marker and a pre-resolved launch (``calls``), only the stream's
        handle, the device check and the launcher run."""
        c = self.copy
        last = self._last_stream
        if last is not None and last[0] is stream:
            s, handle = last[1], last[2]
        else:
            s = c._streams.get(stream)
            handle = s.cuda_stream
            if stream is not None:  # None means the current stream, which may change
                self._last_stream = (stream, s, handle)
        cuda = self._cuda
        try:
            if cuda.current_device() == c.device_index:
                self._issue(entry, launch, calls, s, handle, stream is None)
            else:
                with cuda.device(c.device_index):
                    self._issue(entry, launch, calls, s, handle, stream is None)
        finally:
            # Also on failure: the upload may already be in flight.
            entry.done.record(s)
            c._pool.give(entry)

    def _issue(self, entry: Any, launch: IdsLaunch, calls: Optional[tuple], s: Any, handle: int,
               current: bool) -> None:
        if calls is None:
            self._launch(entry, launch, s, current)
            return
        for run, grid, function, metadata, args in calls:
            run(grid, 1, 1, handle, function, metadata, None, None, None, *args)

    def _launch(self, entry: Any, launch: IdsLaunch, s: Any, current: bool) -> None:
        """A launch with nothing resolved ahead: through Triton's JIT where this Triton has
        no direct launch, or with a launch hook (a profiler) set."""
        import torch

        c, tile = self.copy, launch.tile
        variant = self._variant(tile)
        if launch.ids == "host":
            ids, ptr = entry.host, entry.host_ptr
        else:
            ids, ptr = c._pool.device_buffer(entry), entry.dev_ptr
            m = 2 * launch.n
            if current:
                ids[:m].copy_(entry.host[:m], non_blocking=True)
            else:
                with torch.cuda.stream(s):
                    ids[:m].copy_(entry.host[:m], non_blocking=True)
        args = self._args(launch, ptr)
        if variant.direct:  # with a launch hook set (a profiler): the launch carries Triton's metadata
            rt = self._runtime
            enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
            if hook_is_set(enter) or hook_is_set(leave):
                meta = variant.compiled.launch_metadata((launch.grid, 1, 1), s.cuda_stream, *args)
            else:
                meta = enter = leave = None
            variant.run(launch.grid, 1, 1, s.cuda_stream, variant.function, variant.metadata, meta, enter, leave,
                        *args)
        else:
            from .by_ids_jit import copy_by_ids_kernel

            with torch.cuda.stream(s):
                copy_by_ids_kernel[(launch.grid,)](self._tmpl, ids, launch.n, self.pieces, tile.splits, self.each,
                                                   JOBS=tile.jobs, WORDS=tile.words, ALIGN=tile.align,
                                                   CACHE=tile.cache, UNIFORM=self.uniform, num_warps=tile.warps)

    def _hooked(self) -> bool:
        """Whether a launch hook (a profiler) is set: launches then carry Triton's metadata."""
        rt = self._runtime
        return rt is not None and (hook_is_set(rt.launch_enter_hook) or hook_is_set(rt.launch_exit_hook))

    def _variant(self, tile: Tile) -> Variant:
        key = (tile.jobs, tile.words, tile.align, tile.cache, tile.warps)
        v = self._variants.get(key)
        if v is None:
            v = self._variants[key] = _compile(self.copy.device_index, tile, self.uniform)
            if v.direct and self._runtime is None:
                from triton import knobs

                self._runtime = knobs.runtime
        return v

    def prepare(self, counts: Any = (1024,)) -> None:
        """Compile now the variants that batches of ``counts`` id pairs will use, and the
        ids' upload (GPU)."""
        if self.copy.device_index is not None:
            for n in counts:
                self._variant(self._plan(int(n)).tile)
            _upload_variant(self.copy.device_index)


class _Packed:
    """A call's ids in a launch buffer, waiting for their launch (:meth:`CopyByIds.pack`)."""

    __slots__ = ("fn", "entry", "launch", "calls")

    def __init__(self, fn: CopyByIds, entry: Any, launch: IdsLaunch, calls: Optional[tuple]) -> None:
        self.fn, self.entry, self.launch, self.calls = fn, entry, launch, calls

    def __call__(self, stream: Any = None) -> IdsLaunch:
        entry, self.entry = self.entry, None
        if entry is None:
            raise RuntimeError("these packed ids were already launched or cancelled")
        self.fn._enqueue(entry, self.launch, self.calls, stream)
        self.fn.last_launch = self.launch
        return self.launch

    def cancel(self) -> None:
        entry, self.entry = self.entry, None
        if entry is not None:  # never launched: nothing reads it
            self.fn.copy._pool.give(entry)


class _Later:
    """A call without a launch buffer: no ids, or the interpreter's (copied here, read at launch)."""

    __slots__ = ("fn", "launch", "ids")

    def __init__(self, fn: CopyByIds, launch: IdsLaunch, ids: Optional[np.ndarray] = None) -> None:
        self.fn, self.launch, self.ids = fn, launch, ids

    def __call__(self, stream: Any = None) -> IdsLaunch:
        if self.ids is not None:
            self.fn._interpret(self.ids, self.launch)
        self.fn.last_launch = self.launch
        return self.launch

    def cancel(self) -> None:
        pass


_COMPILED: dict[tuple, Variant] = {}
_UPLOADS: dict[int, Variant] = {}
UPLOAD_BLOCK = 1024  # ids each program of the upload kernel copies


def _upload_variant(device_index: int) -> Variant:
    """The compiled ids upload (:func:`~.by_ids_jit.load_ids_kernel`) of one device."""
    v = _UPLOADS.get(device_index)
    if v is None:
        import torch

        from .by_ids_jit import load_ids_kernel

        with torch.cuda.device(device_index):
            compiled = load_ids_kernel.warmup(torch.int64, torch.int64, 0, BLOCK=UPLOAD_BLOCK, grid=(1,))
            parts = direct_parts(compiled) if compiled is not None else None
        v = _UPLOADS[device_index] = Variant(compiled, *parts) if parts else Variant(compiled)
    return v


def _compile(device_index: int, tile: Tile, uniform: bool) -> Variant:
    """One compiled variant per device, tile shape and ``uniform``, shared by every binding."""
    key = (device_index, tile.jobs, tile.words, tile.align, tile.cache, tile.warps, uniform)
    v = _COMPILED.get(key)
    if v is None:
        import torch

        from .by_ids_jit import copy_by_ids_kernel

        with torch.cuda.device(device_index):
            # ``torch.int64`` stands for the two (16-byte aligned) pointers; the ints only type n, pieces,
            # splits, each.
            compiled = copy_by_ids_kernel.warmup(torch.int64, torch.int64, 0, 1, 1, 1, JOBS=tile.jobs,
                                                 WORDS=tile.words, ALIGN=tile.align, CACHE=tile.cache,
                                                 UNIFORM=uniform, num_warps=tile.warps, grid=(1,))
            parts = direct_parts(compiled) if compiled is not None else None
        v = _COMPILED[key] = Variant(compiled, *parts) if parts else Variant(compiled)
    return v


class KernelCopyByIds(KernelCopy):
    """The bound ``triton.kernel`` transfer: a :class:`KernelCopy` that also offers the
    optional ``by_ids`` capability (:class:`kvswap.registry.impl.ByIdsFn`)."""

    def by_ids(self, template: Any) -> Optional[CopyByIds]:
        """Copy blocks by id with the addresses derived on the device from ``template``,
        or None where the template does not suit the kernel."""
        return bind_by_ids(self, template)
