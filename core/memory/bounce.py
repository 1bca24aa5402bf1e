"""Pageable host memory, carried through kvswap's own page-locked bounce buffers.

A device reads and writes host memory asynchronously only where it is page-locked: a copy
kernel faults on pageable memory, and the driver's pageable path is synchronous with the
calling thread (a device-to-host copy into pageable memory returns only after everything
queued before it has run; CUDA runtime API, "API synchronization behavior"). So a mover
whose host tensors are pageable moves their blocks in two steps, with the resolved route
unchanged between a pinned bounce buffer and the device:

* host to device: ``submit`` copies each descriptor's bytes from the pageable tensors into
  the bounce buffer on the calling thread (so the host blocks are read at that moment,
  not when the device copy runs), then enqueues the device copy from there;
* device to host: the device copy lands in the bounce buffer, and a worker thread copies
  the bytes out to the pageable tensors once the device copy has completed. The job is
  reported complete only after that.

Both cost a host memcpy of every byte on top of the device copy, hence the warning.
"""
from __future__ import annotations

import ctypes
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..errors import KvSwapWarning
from .pinned_pool import BouncePool, DescriptorBuffer


class PageableMemoryWarning(KvSwapWarning):
    """A mover's host tensors are pageable: their blocks go through bounce buffers,
    which costs a host memcpy of every byte (allocate host KV with ``pin_memory=True``)."""

# Bounced descriptors start on 256-byte boundaries: as aligned as any route asks of the
# addresses it is given (kernels vectorise up to 16 bytes; DMA prefers 256).
ALIGN = 256


# A bounced job this large may be copied by several threads (ctypes releases the GIL during
# each memmove). One thread by default: with 8, the Python loop between memmoves contends
# for the GIL and pageable jobs ran about twice as slow (docs/benchmarks.md, pageable host
# memory).
PARALLEL_BYTES = 8 << 20
COPY_THREADS = 1
_copiers: Optional[ThreadPoolExecutor] = None
_copiers_lock = threading.Lock()


def _memmove_each(src: list, dst: list, sizes: list) -> None:
    move = ctypes.memmove
    for s, d, n in zip(src, dst, sizes):
        move(d, s, n)


def host_memmove(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, threads: Optional[int] = None) -> None:
    """``memmove`` each descriptor (the caller checked the ranges), split over up to
    ``threads`` (default :data:`COPY_THREADS`) threads when there are at least
    :data:`PARALLEL_BYTES` to copy. One call per descriptor beat numpy's fancy-index
    gathers, whose per-element loop ran several times slower."""
    global _copiers
    s, d, n = src.tolist(), dst.tolist(), sizes.tolist()
    threads = COPY_THREADS if threads is None else threads
    total = int(sizes.sum()) if len(n) else 0
    parts = min(threads, len(n), max(1, total // (PARALLEL_BYTES // 4)))
    if parts < 2 or total < PARALLEL_BYTES:
        _memmove_each(s, d, n)
        return
    with _copiers_lock:
        if _copiers is None:
            _copiers = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvswap-memmove")
    # equal bytes per part: cut the running total into ``parts`` ranges
    cuts = np.searchsorted(np.cumsum(sizes), np.arange(1, parts) * (total / parts)).tolist()
    bounds = [0, *cuts, len(n)]
    futures = [_copiers.submit(_memmove_each, s[a:b], d[a:b], n[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
    for f in futures:
        f.result()


@dataclass(eq=False)
class Bounced:
    """One job's bounce: its buffer, the pageable host addresses and the bounce addresses
    that stand in for them, their sizes and, for device-to-host, the copy-out still to do."""

    buffer: DescriptorBuffer
    host: np.ndarray
    bounce: np.ndarray
    sizes: np.ndarray
    finish: Optional[Future] = None


def storage_spans(tensors: Sequence[Any]) -> list[tuple[int, int]]:
    """``[start, end)`` of the storage behind each tensor, merged where they overlap."""
    spans = sorted({(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                    for t in tensors})
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


class Bouncer:
    """Swap the pageable host addresses of a batch for bounce-buffer addresses, and move the
    bytes between them.

    :param spans: ``[start, end)`` of the pageable host memory.
    :param host_row: which row of a descriptor buffer holds host addresses (0: sources,
        host to device; 1: destinations, device to host).
    :param pinned: page-lock the bounce buffers (a device reads them).
    """

    def __init__(self, spans: Sequence[tuple[int, int]], host_row: int, pinned: bool) -> None:
        self.lo = np.array([lo for lo, _ in spans], dtype=np.int64)
        self.hi = np.array([hi for _, hi in spans], dtype=np.int64)
        self.row = host_row
        self.pool = BouncePool(pinned=pinned)
        self._worker: Optional[ThreadPoolExecutor] = None

    def bounce(self, arr: np.ndarray, m: int) -> Optional[Bounced]:
        """Point the pageable descriptors of ``arr[:, :m]`` at a bounce buffer; for host to
        device, copy their bytes in now. None when no descriptor is pageable."""
        addrs = arr[self.row, :m]
        at = np.searchsorted(self.lo, addrs, side="right") - 1
        mask = (at >= 0) & (addrs < self.hi[np.maximum(at, 0)])
        if not mask.any():
            return None
        sizes = arr[2, :m][mask]
        pitch = (sizes + (ALIGN - 1)) & ~(ALIGN - 1)
        offsets = np.cumsum(pitch) - pitch
        buf = self.pool.acquire(int(pitch.sum()) + ALIGN)
        base = -(-buf.array.ctypes.data // ALIGN) * ALIGN
        bounce = base + offsets
        host = addrs[mask]
        addrs[mask] = bounce
        if self.row == 0:
            host_memmove(host, bounce, sizes)
        return Bounced(buf, host, bounce, sizes)

    def copy_out(self, job: Bounced, wait: Callable[[], None]) -> None:
        """Device to host: after ``wait`` returns (the device copy is complete), copy the
        bounced bytes to the pageable tensors, on the worker thread."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvswap-bounce")

        def run() -> None:
            wait()
            host_memmove(job.bounce, job.host, job.sizes)

        job.finish = self._worker.submit(run)

    def release(self, job: Bounced) -> None:
        self.pool.release(job.buffer)

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self.pool.clear()
