"""``cuda.batch``: a batch in one ``cuMemcpyBatchAsync`` call on the copy engines.

The descriptor arrays reach the driver as raw pointers to the caller's int64 numpy arrays
(no per-descriptor Python objects). A batch above :data:`DEFAULT_CHUNK` descriptors (or
the bound ``batch_chunk``) becomes several calls, enqueued in order on the same stream.
Where the batch call cannot serve — a driver older than 12.8, or the legacy default
stream, which it rejects — each descriptor becomes one ``cuMemcpyAsync``: correct, just
slower (each copy pays the driver's fixed cost), and the callable's ``note`` says so in
``explain()``.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional

import numpy as np

from kvswap.backends import chunking
from kvswap.errors import DriverError
from kvswap.registry.impl import BindContext, CopyImpl
from kvswap.registry.streams import raw_handle
from kvswap.types import DeviceInfo, Direction

from . import driver as drv
from .device import torch_reason

NAME = "cuda.batch"
BATCH, PER_COPY = "batch", "per-copy"
# Descriptors per cuMemcpyBatchAsync call: a hang was reported on Blackwell with 51,828 in
# one call (vLLM issue 49276); larger batches are split into calls of at most this many.
DEFAULT_CHUNK = 32768
CHUNK_ENV = "KVSWAP_CUDA_BATCH_CHUNK"
# Descriptors per call for a batch of mixed sizes. On an H100 (driver 580.159.04) host-to-device
# calls of mixed sizes copied wrong bytes, failed the stream, hung or faulted inside the driver
# from 1,536 descriptors of 4-12 KiB, and faulted from 32,768 of 1 B-64 KiB; 1,024 of each were
# clean, and so was every batch of one size up to 200,000 and every device-to-host or
# device-to-device one (docs/known-issues.md, tests/bench/batch_fault/). Host to device gets
# half the largest clean count; the other directions keep the 4,096 that earlier runs of the
# 1-4,096 B fault settled on.
MIXED_CHUNK = 4096
MIXED_CHUNK_H2D = 512


def chunk_size(params: Any, env: Any = None) -> int:
    """Descriptors per batch call: ``params["batch_chunk"]``, else ``KVSWAP_CUDA_BATCH_CHUNK``,
    else :data:`DEFAULT_CHUNK`."""
    return chunking.chunk_size(params, DEFAULT_CHUNK, CHUNK_ENV, env)


def access_order(direction: Direction) -> int:
    """ANY lets the copy engine read the source before earlier work on the stream is done:
    safe only for a host source nobody on the GPU writes; a device source (d2h, d2d) keeps
    STREAM order, as the kernels that wrote it must finish first."""
    return drv.ORDER_ANY if Direction.parse(direction).src_is_host else drv.ORDER_STREAM


def make_attributes(direction: Direction) -> drv.MemcpyAttributes:
    """The one attribute (``attrsIdxs=[0]``, ``numAttrs=1``) that covers every copy."""
    attr = drv.MemcpyAttributes()
    attr.srcAccessOrder = access_order(direction)
    return attr


def choose_path(batch_ready: bool, handle: int) -> str:
    """``"batch"`` when the batch entry point exists and ``handle`` is not the legacy stream."""
    return BATCH if batch_ready and handle not in drv.LEGACY_STREAMS else PER_COPY


class BatchCopy:
    """The callable ``cuda.batch``'s factory binds: ``fn(src, dst, sizes, stream)``.

    :param batch_fn: ``cuMemcpyBatchAsync`` of ``abi``'s prototype, or None (per-copy only).
    :param memcpy_fn: ``cuMemcpyAsync(dst, src, size, stream)``.
    :param error: ``error(call, code, index) -> DriverError``.
    :param context: a :class:`~kvswap.backends.cuda.driver.ContextGuard`, or None.
    :param why: why there is no batch entry point (when ``batch_fn`` is None).
    :param chunk: the most descriptors one batch call takes; larger batches are split into
        calls enqueued in order on the same stream.

    ``last_path`` says which path the latest call took (``"batch"`` or ``"per-copy"``).
    """

    def __init__(
        self,
        direction: Direction,
        device_index: int,
        *,
        abi: Optional[drv.BatchAbi],
        batch_fn: Any,
        memcpy_fn: Any,
        error: Callable[..., DriverError],
        context: Optional[drv.ContextGuard] = None,
        why: str = "",
        driver_version: Optional[int] = None,
        chunk: int = DEFAULT_CHUNK,
    ) -> None:
        self.direction = Direction.parse(direction)
        self.device_index = int(device_index)
        self.abi = abi if batch_fn is not None else None
        self._batch = batch_fn if self.abi is not None else None
        self._memcpy = memcpy_fn
        self._error = error
        self._context = context
        self.chunk = int(chunk)
        self.mixed_chunk = MIXED_CHUNK_H2D if self.direction is Direction.H2D else MIXED_CHUNK
        self._attr = make_attributes(self.direction)
        self._attr_idx = (ctypes.c_size_t * 1)(0)
        self._attr_addr = ctypes.addressof(self._attr)
        self._attr_idx_addr = ctypes.addressof(self._attr_idx)
        self._fail_idx = self.abi is not None and self.abi.has_fail_idx
        self.last_path: Optional[str] = None
        on = f" on driver CUDA {drv.version_text(driver_version)}" if driver_version else ""
        if self.abi is None:
            self.note = f"per-copy path: one cuMemcpyAsync per descriptor (correct, slower) because {why or 'no batch entry point'}"
        else:
            order = "ANY (host source)" if self._attr.srcAccessOrder == drv.ORDER_ANY else "STREAM"
            self.note = (
                f"batch path: one cuMemcpyBatchAsync call per transfer ({self.abi.label}, found by "
                f"cuGetProcAddress{on}), source order {order}, at most {self.chunk} descriptors a call "
                f"({self.mixed_chunk} where sizes differ); "
                f"the legacy default stream, which the batch call rejects, takes the per-copy cuMemcpyAsync path"
            )

    def path_for(self, handle: int) -> str:
        return choose_path(self._batch is not None, handle)

    def __call__(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any = None) -> None:
        count = len(sizes)
        if count == 0:
            return
        # The arrays arrive checked (SwapFn: 1-D C-contiguous int64 of equal length), so
        # their buffers go to the driver as they are.
        handle = stream if type(stream) is int else raw_handle(stream, self.device_index)
        context = self._context
        pushed = context.enter() if context is not None else False
        try:
            if self._batch is None or handle in drv.LEGACY_STREAMS:
                path = PER_COPY
                self._copy_each(src, dst, sizes, handle)
            elif count <= self.chunk and (count <= self.mixed_chunk or sizes.min() == sizes.max()):
                path = BATCH  # one call: the common case, without the pieces' bookkeeping
                self._call(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, count, handle, 0)
            else:
                path = BATCH
                self._copy_batch(src, dst, sizes, handle)
        finally:
            if pushed:
                context.exit()
        self.last_path = path

    def _call(self, d: int, s: int, n: int, count: int, handle: int, lo: int) -> None:
        """One ``cuMemcpyBatchAsync`` of ``count`` descriptors at these array addresses;
        a failure names descriptor ``lo`` + the driver's index."""
        if self._fail_idx:
            failed = ctypes.c_size_t(drv.SIZE_MAX)  # per call: concurrent callers never share it
            rc = self._batch(d, s, n, count, self._attr_addr, self._attr_idx_addr, 1, ctypes.addressof(failed),
                             handle)
            if rc:
                index = drv.fail_index(failed.value, count)
                raise self._error("cuMemcpyBatchAsync", rc, None if index is None else lo + index)
        else:
            rc = self._batch(d, s, n, count, self._attr_addr, self._attr_idx_addr, 1, handle)
            if rc:
                raise self._error("cuMemcpyBatchAsync", rc, None)

    def _copy_batch(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, handle: int) -> None:
        # Pieces of at most ``chunk`` descriptors, each its own call on the same stream:
        # the arrays are int64 (8 bytes a descriptor), so a piece is an offset into them.
        d, s, n = dst.ctypes.data, src.ctypes.data, sizes.ctypes.data
        chunk = self.chunk
        mixed = self.mixed_chunk
        if chunk > mixed and len(sizes) > mixed and sizes.min() != sizes.max():
            chunk = mixed  # the driver's faults on long mixed-size batches (above)
        for lo, count in chunking.pieces(len(sizes), chunk):
            off = 8 * lo
            self._call(d + off, s + off, n + off, count, handle, lo)

    def _copy_each(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, handle: int) -> None:
        memcpy = self._memcpy
        for i, (d, s, n) in enumerate(zip(dst.tolist(), src.tolist(), sizes.tolist())):
            rc = memcpy(d, s, n, handle)
            if rc:
                raise self._error("cuMemcpyAsync", rc, i)


def availability(device: DeviceInfo) -> Optional[str]:
    """None when this process can drive a CUDA GPU through libcuda, else why not."""
    return drv.unavailable_reason() or torch_reason()


def bind(driver: drv.Driver, direction: Direction, device_index: int, chunk: int = DEFAULT_CHUNK) -> BatchCopy:
    """Bind ``cuda.batch`` for one direction and device on ``driver``: the entry points,
    the primary context and the path, once, at resolve time."""
    context = driver.context_guard(device_index)
    abi, why = driver.batch_abi()
    return BatchCopy(
        direction,
        device_index,
        abi=abi,
        batch_fn=driver.batch_function(abi) if abi is not None else None,
        memcpy_fn=driver.memcpy_async(),
        error=driver.error,
        context=context,
        why=why,
        driver_version=driver.version,
        chunk=chunk,
    )


def _factory(ctx: BindContext) -> Any:
    import torch

    chunk = chunk_size(ctx.params)
    torch.cuda.init()  # torch creates the primary context bind() then retains
    index = ctx.device.index if ctx.device.index is not None else torch.cuda.current_device()
    return bind(drv.get(), ctx.direction, index, chunk)


CUDA_BATCH = CopyImpl(
    name=NAME,
    kind="batch",
    platforms=("cuda",),
    directions=(Direction.H2D, Direction.D2H, Direction.D2D),
    factory=_factory,
    availability=availability,
    requires_pinned=True,
    description="copy engines: one cuMemcpyBatchAsync per batch (CUDA 12.8+), else cuMemcpyAsync per block",
)
