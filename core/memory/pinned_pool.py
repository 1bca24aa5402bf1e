"""Reusable descriptor buffers, page-locked where a device reads them.

A transfer's descriptors (src addresses, dst addresses, sizes) must stay valid until the
device has finished with them, and an asynchronous upload from pageable memory is
synchronous (CUDA runtime API, "API synchronization behavior"), so on a GPU they live in
pinned memory. The bounce buffers that carry pageable host memory's blocks are pooled
the same way. Pinning is slow (a driver call per
allocation), hence a pool: buffers are sized in powers of two and come back to the pool
only when the owner says the job that used them has completed.

A mover's issuing thread acquires buffers while the engine's thread releases them (and may
acquire one for ``descriptors()``): a lock guards the shelves.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .allocation import allocating

# Small jobs share one size class; 1024 descriptors are 24 KiB.
MIN_CAPACITY = 1024


@dataclass(eq=False)
class DescriptorBuffer:
    """``array[0]``: src addresses, ``array[1]``: dst addresses, ``array[2]``: sizes.

    ``owner`` keeps the memory alive (the pinned torch tensor, or None for numpy memory).
    """

    array: np.ndarray
    owner: Any
    capacity: int


class DescriptorPool:
    """Buffers of ``(3, capacity)`` int64, reused by size class.

    :param pinned: allocate page-locked host memory through torch (needs a GPU build of
        torch and a device); otherwise plain numpy memory.
    """

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._free: dict[int, list[DescriptorBuffer]] = {}
        self._lent: set[int] = set()
        self._lock = threading.Lock()
        self.allocated = 0

    @property
    def in_use(self) -> int:
        """Buffers acquired and not yet released."""
        return len(self._lent)

    @property
    def idle(self) -> int:
        """Buffers waiting in the pool."""
        return sum(len(v) for v in self._free.values())

    def acquire(self, count: int) -> DescriptorBuffer:
        """A buffer for at least ``count`` descriptors, from the pool or newly allocated."""
        return self._take(MIN_CAPACITY if count <= MIN_CAPACITY else 1 << (count - 1).bit_length())

    def _take(self, cap: int) -> DescriptorBuffer:
        with self._lock:
            shelf = self._free.get(cap)
            buf = shelf.pop() if shelf else None
            if buf is not None:
                self._lent.add(id(buf))
                return buf
        buf = self._allocate(cap)  # slow (pinning): outside the lock
        with self._lock:
            self._lent.add(id(buf))
        return buf

    def release(self, buf: DescriptorBuffer) -> None:
        """Give ``buf`` back; only once the device is done reading it."""
        key = id(buf)
        with self._lock:
            if key not in self._lent:
                raise RuntimeError("descriptor buffer released twice or not from this pool")
            self._lent.discard(key)
            self._free.setdefault(buf.capacity, []).append(buf)

    def clear(self) -> None:
        """Drop the idle buffers (buffers still lent stay with their jobs)."""
        with self._lock:
            self._free.clear()

    def _allocate(self, cap: int) -> DescriptorBuffer:
        array, owner = host_array((3, cap), np.int64, self.pinned, f"a BlockMover descriptor buffer of {cap} descriptors")
        with self._lock:
            self.allocated += 1
        return DescriptorBuffer(array, owner, cap)


def host_array(shape: tuple[int, ...], dtype: Any, pinned: bool, what: str) -> tuple[np.ndarray, Any]:
    """``(array, owner)``: a new host array, page-locked through torch where ``pinned``
    (``owner`` keeps it alive). Running out of memory raises :class:`kvswap.AllocationError`
    naming ``what``. Every pool of this module allocates here."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    with allocating(what, nbytes, "page-locked host" if pinned else "host"):
        return new_host_array(shape, dtype, pinned)


def new_host_array(shape: tuple[int, ...], dtype: Any, pinned: bool) -> tuple[np.ndarray, Any]:
    """The allocation itself, the one place a pool's memory comes from."""
    if not pinned:
        return np.empty(shape, dtype=dtype), None
    import torch

    owner = torch.empty(shape, dtype=getattr(torch, np.dtype(dtype).name), pin_memory=True)
    return owner.numpy(), owner


# A bounce buffer is at least 1 MiB: small jobs share one size class.
MIN_BOUNCE_BYTES = 1 << 20


class BouncePool(DescriptorPool):
    """Byte buffers (``array`` is 1-D uint8) that carry pageable host memory's blocks,
    page-locked where a device reads them; reused by power-of-two size class."""

    def acquire(self, count: int) -> DescriptorBuffer:
        """A buffer of at least ``count`` bytes."""
        return self._take(MIN_BOUNCE_BYTES if count <= MIN_BOUNCE_BYTES else 1 << (count - 1).bit_length())

    def _allocate(self, cap: int) -> DescriptorBuffer:
        array, owner = host_array((cap,), np.uint8, self.pinned, "a bounce buffer for pageable host memory")
        with self._lock:
            self.allocated += 1
        return DescriptorBuffer(array, owner, cap)
