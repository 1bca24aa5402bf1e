"""Descriptor arrays: the one place that normalises, checks and coalesces them.

A batch is three 1-D int64 arrays of equal length: source addresses, destination
addresses, byte counts (vLLM's ``swap_blocks_batch`` shape). Everything here is
vectorised numpy: no per-descriptor Python work.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .errors import InvalidTransferError


def as_int64(values: Any, what: str) -> np.ndarray:
    """``values`` as a 1-D C-contiguous int64 array, without a copy where possible.

    Accepts numpy integer arrays, CPU torch integer tensors, and sequences of ints.
    """
    if type(values).__module__.startswith("torch"):
        if getattr(values, "device", None) is not None and values.device.type != "cpu":
            raise InvalidTransferError(f"{what} must be a CPU tensor, got one on {values.device}")
        if values.is_floating_point() or values.is_complex() or values.dtype.__str__() == "torch.bool":
            raise InvalidTransferError(f"{what} must hold integers, got dtype {values.dtype}")
        values = values.detach().contiguous().numpy()
    arr = np.asarray(values)
    if arr.dtype == object or arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":
            arr = arr.astype(np.int64)
        else:
            raise InvalidTransferError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidTransferError(f"{what} must be 1-D, got shape {tuple(arr.shape)}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:
        raise InvalidTransferError(f"{what} holds values beyond int64")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _int64(values: Any, what: str) -> np.ndarray:
    # The common case (what BlockMover and engines pass) costs one type check, no copy.
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1 and values.flags.c_contiguous:
        return values
    return as_int64(values, what)


def normalize(src: Any, dst: Any, sizes: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check a batch and return it as three int64 arrays.

    Raises :class:`InvalidTransferError` for unequal lengths, sizes < 1 or null addresses.
    """
    return checked(src, dst, sizes)[:3]


# Up to this many descriptors, Python's min and max over lists beat numpy's reductions,
# which cost about a microsecond each whatever the length: a 1-block call checks in a
# fifth of the time (every call of a SwapFn is checked).
SMALL_BATCH = 16


def checked(src: Any, dst: Any, sizes: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """:func:`normalize`, plus the smallest and largest size (0, 0 for an empty batch),
    which routing needs anyway: each reduction is done once."""
    s, d, n = _int64(src, "src_ptrs"), _int64(dst, "dst_ptrs"), _int64(sizes, "sizes")
    if not (len(s) == len(d) == len(n)):
        raise InvalidTransferError(
            f"src_ptrs, dst_ptrs and sizes must have equal length, got {len(s)}, {len(d)}, {len(n)}"
        )
    if not len(n):
        return s, d, n, 0, 0
    if len(n) <= SMALL_BATCH:
        listed = n.tolist()
        smallest, largest, lowest = min(listed), max(listed), min(min(s.tolist()), min(d.tolist()))
    else:
        smallest, largest, lowest = int(n.min()), int(n.max()), int(min(s.min(), d.min()))
    if smallest < 1:
        i = int(np.argmin(n))
        raise InvalidTransferError(f"sizes[{i}]={int(n[i])}: every size must be >= 1 byte")
    if lowest <= 0:
        arr, what = (s, "src_ptrs") if s.min() <= 0 else (d, "dst_ptrs")
        i = int(np.argmin(arr))
        raise InvalidTransferError(f"{what}[{i}]={int(arr[i])} is not a valid address")
    return s, d, n, smallest, largest


def misaligned(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, alignment: int) -> np.ndarray:
    """Boolean mask of descriptors whose address or size is not a multiple of ``alignment``."""
    if alignment == 1:
        return np.zeros(len(sizes), dtype=bool)
    return ((src | dst | sizes) & (alignment - 1)) != 0


def first_overlap(addrs: np.ndarray, sizes: np.ndarray) -> Optional[tuple[int, int]]:
    """Indices ``(i, j)`` of two byte ranges that overlap, or None."""
    if len(addrs) < 2:
        return None
    order = np.argsort(addrs, kind="stable")
    a, n = addrs[order], sizes[order]
    clash = np.flatnonzero(a[:-1] + n[:-1] > a[1:])
    if not len(clash):
        return None
    k = int(clash[0])
    return int(order[k]), int(order[k + 1])


def coalesce(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge neighbours that are contiguous on both sides into one descriptor.

    The driver does not merge adjacent descriptors itself (FACTS.md: merged runs of
    16 x 8 KiB went 15 -> 54 GB/s), so this is the caller's job.
    """
    if len(sizes) < 2:
        return src, dst, sizes
    ends_s, ends_d = src[:-1] + sizes[:-1], dst[:-1] + sizes[:-1]
    starts = np.ones(len(sizes), dtype=bool)
    starts[1:] = (ends_s != src[1:]) | (ends_d != dst[1:])
    if starts.all():
        return src, dst, sizes
    idx = np.flatnonzero(starts)
    return src[idx], dst[idx], np.add.reduceat(sizes, idx)
