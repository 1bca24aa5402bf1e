"""``rocm.batch``: one HIP call per chunk of descriptors, or one per copy on old runtimes.

Which path a bound function takes is decided once, at resolve time, from the runtime
version and the symbols it exports:

* HIP < 7.1, or no ``hipMemcpyBatchAsync`` exported: ``hipMemcpyAsync`` per descriptor;
* 7.1 <= HIP < 7.13: ``hipMemcpyBatchAsync`` with ``numAttrs = 0`` (7.2.x rejects
  ``numAttrs > 0``: ROCm/clr issue 273);
* HIP >= 7.13: one attribute for the whole batch; source order ``ANY`` for a host source
  (host to device), ``STREAM`` for a device source (device to host: the copy must wait
  for the kernels that wrote the blocks).

Batches are cut into chunks of at most 8 192 descriptors (larger batches have faulted),
overridable with ``KVSWAP_ROCM_BATCH_CHUNK`` or the bind parameter ``batch_chunk``. The
bound function sees only batches core has validated and, where that pays, merged into
contiguous runs (``SwapFn``): it hands them to the runtime as they are.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import numpy as np

from kvswap.backends import chunking
from kvswap.errors import DriverError
from kvswap.registry.impl import BindContext, CopyImpl
from kvswap.registry.streams import raw_handle
from kvswap.types import DeviceInfo, Direction

from . import hip as runtime
from .hip import (
    MEMCPY_DEVICE_TO_DEVICE,
    MEMCPY_DEVICE_TO_HOST,
    MEMCPY_HOST_TO_DEVICE,
    SIZE_MAX,
    SRC_ACCESS_ORDER_ANY,
    SRC_ACCESS_ORDER_STREAM,
    HipApi,
    HipUnavailable,
    HipVersion,
    MemcpyAttributes,
)

NAME = "rocm.batch"
# hipMemcpyAsync's kind per direction (the per-copy path; the batch call takes none).
MEMCPY_KIND = {
    Direction.H2D: MEMCPY_HOST_TO_DEVICE,
    Direction.D2H: MEMCPY_DEVICE_TO_HOST,
    Direction.D2D: MEMCPY_DEVICE_TO_DEVICE,
}

DEFAULT_CHUNK = 8192  # hipMemcpyBatchAsync batches over 8,192 descriptors have faulted (vLLM PR 43018)
CHUNK_ENV = "KVSWAP_ROCM_BATCH_CHUNK"
BATCH_SINCE = (7, 1)
ATTRS_SINCE = (7, 13)


@dataclass(frozen=True)
class BatchPath:
    """How a bound function copies: ``batch`` (with ``num_attrs`` attributes whose source
    order is ``access_order``) or ``per_copy``; ``why`` is the reason in words."""

    kind: str
    num_attrs: int
    access_order: Optional[int]
    why: str


def choose_path(hip: HipApi, version: Optional[HipVersion], direction: Direction) -> BatchPath:
    if version is None:
        return BatchPath("per_copy", 0, None, "HIP runtime version unknown")
    if not version.at_least(*BATCH_SINCE):
        return BatchPath("per_copy", 0, None, f"HIP runtime {version} < 7.1 has no hipMemcpyBatchAsync")
    if not hip.has("hipMemcpyBatchAsync"):
        return BatchPath("per_copy", 0, None, f"{hip.origin} (HIP {version}) does not export hipMemcpyBatchAsync")
    if not version.at_least(*ATTRS_SINCE):
        return BatchPath("batch", 0, None, f"numAttrs=0: HIP runtime {version} < 7.13 rejects attributes")
    if direction.src_is_host:
        return BatchPath("batch", 1, SRC_ACCESS_ORDER_ANY,
                         f"one attribute, source order ANY (host source; HIP runtime {version} >= 7.13)")
    return BatchPath("batch", 1, SRC_ACCESS_ORDER_STREAM,
                     f"one attribute, source order STREAM (device source; HIP runtime {version} >= 7.13)")


def chunk_size(params: Mapping[str, Any], default: int = DEFAULT_CHUNK, env: Optional[Mapping[str, str]] = None) -> int:
    """Descriptors per batch call: ``params["batch_chunk"]``, else ``KVSWAP_ROCM_BATCH_CHUNK``,
    else ``default``. Raises :class:`ConfigurationError` for anything but a positive int."""
    return chunking.chunk_size(params, default, CHUNK_ENV, env)


def make_transfer(
    hip: HipApi,
    path: BatchPath,
    direction: Direction,
    device_index: int,
    chunk: int,
    stream_handle: Callable[[Any, int], int] = raw_handle,
) -> Callable[[np.ndarray, np.ndarray, np.ndarray, Any], None]:
    """The per-transfer callable for ``path``; ``.note`` says which path and why."""
    kind = MEMCPY_KIND[Direction.parse(direction)]
    if path.kind == "batch":
        batch_fn = hip.fn("hipMemcpyBatchAsync")
        attrs = (MemcpyAttributes * 1)()
        idxs = (ctypes.c_size_t * 1)(0)
        if path.num_attrs:
            attrs[0].srcAccessOrder = path.access_order
        attrs_ptr = ctypes.addressof(attrs) if path.num_attrs else None
        idxs_ptr = ctypes.addressof(idxs) if path.num_attrs else None
    else:
        copy_fn = hip.fn("hipMemcpyAsync")

    def transfer(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any) -> None:
        # A validated batch (SwapFn), already coalesced where that pays: handed over as is.
        if not len(sizes):
            return
        handle = stream_handle(stream, device_index)
        if path.kind == "batch":
            _batch(src, dst, sizes, handle)
        else:
            _per_copy(src, dst, sizes, handle)

    def _batch(s: np.ndarray, d: np.ndarray, n: np.ndarray, handle: int) -> None:
        fail = ctypes.c_size_t(SIZE_MAX)
        base_s, base_d, base_n = s.ctypes.data, d.ctypes.data, n.ctypes.data
        for lo, count in chunking.pieces(len(n), chunk):
            fail.value = SIZE_MAX
            off = lo * 8  # int64 == size_t == pointer width on every platform HIP serves
            code = batch_fn(base_d + off, base_s + off, base_n + off, count,
                            attrs_ptr, idxs_ptr, path.num_attrs, ctypes.byref(fail), handle)
            if code:
                raise hip.error("hipMemcpyBatchAsync", code, lo + fail.value if fail.value < count else None)

    def _per_copy(s: np.ndarray, d: np.ndarray, n: np.ndarray, handle: int) -> None:
        # One runtime call per descriptor is the point of this path (runtimes without the
        # batch call); the Python loop only feeds it.
        for i, (a, b, c) in enumerate(zip(d.tolist(), s.tolist(), n.tolist())):
            code = copy_fn(a, b, c, kind, handle)
            if code:
                raise hip.error("hipMemcpyAsync", code, i)

    if path.kind == "batch":
        # The call reads the attribute array through a raw address: the ctypes objects
        # must live as long as the bound function, not just this factory call.
        transfer._attrs = (attrs, idxs)  # type: ignore[attr-defined]
    what = "hipMemcpyBatchAsync" if path.kind == "batch" else "per-copy hipMemcpyAsync"
    extra = f"; chunks of <= {chunk} descriptors" if path.kind == "batch" else ""
    transfer.note = f"{what} path: {path.why}{extra}"  # type: ignore[attr-defined]
    transfer.path = path  # type: ignore[attr-defined]
    transfer.chunk = chunk  # type: ignore[attr-defined]
    return transfer


def availability(device: DeviceInfo) -> Optional[str]:
    """None when this process can drive the HIP runtime, else why not."""
    return runtime.unavailable_reason()


def bind(ctx: BindContext) -> Callable[..., None]:
    """The factory: choose the path once, at resolve time, from the runtime's version and
    symbols, and bind the chunk size (``ctx.params["batch_chunk"]``, else the default)."""
    hip = runtime.get()
    try:
        version = hip.runtime_version()
    except (DriverError, HipUnavailable):
        version = None  # choose_path then takes the per-copy path and says why
    path = choose_path(hip, version, ctx.direction)
    return make_transfer(hip, path, ctx.direction, ctx.device.index or 0, chunk_size(ctx.params))


ROCM_BATCH = CopyImpl(
    name=NAME,
    kind="batch",
    platforms=("rocm",),
    directions=(Direction.H2D, Direction.D2H, Direction.D2D),
    factory=bind,
    availability=availability,
    description="HIP copy engines: hipMemcpyBatchAsync in chunks (ROCm >= 7.1), else hipMemcpyAsync per block",
)
