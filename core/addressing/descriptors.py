"""Descriptor arrays: the one place that normalises, checks and coalesces them.

A batch is three 1-D int64 arrays of equal length: source addresses, destination
addresses, byte counts (vLLM's ``swap_blocks_batch`` shape). Everything here is
vectorised numpy, but for the check of a short batch, which runs on Python ints.
"""
from __future__ import annotations

from bisect import bisect_left
from operator import add, gt, sub
from typing import Any, NamedTuple, Optional

import numpy as np

from ..errors import InvalidTransferError


def as_int64(values: Any, what: str) -> np.ndarray:
    """``values`` as a 1-D C-contiguous int64 array, without a copy where possible.

    Accepts numpy integer arrays, CPU torch integer tensors, and sequences of ints.
    """
    if type(values).__module__.startswith("torch") and hasattr(values, "layout"):  # a tensor, not a torch.Size
        if values.device.type != "cpu":
            raise InvalidTransferError(f"{what} must be a CPU tensor, got one on {values.device}")
        if values.is_nested or str(values.layout) != "torch.strided":
            kind = "nested" if values.is_nested else str(values.layout).removeprefix("torch.")
            raise InvalidTransferError(f"{what} must be a dense tensor, got a {kind} one")
        if values.is_floating_point() or values.is_complex() or values.dtype.__str__() == "torch.bool":
            raise InvalidTransferError(f"{what} must hold integers, got dtype {values.dtype}")
        values = values.detach().contiguous().numpy()
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError) as e:  # ragged nesting, or an __array__ that fails
        raise InvalidTransferError(f"{what} must be a 1-D sequence of integers; numpy cannot read it: {e}") from None
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


def _addresses(values: Any, what: str) -> np.ndarray:
    """:func:`_int64` for an array of addresses: an array or tensor must already be 64-bit
    (int64, or uint64 within int64), since a narrower one has lost the pointers' high bits."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1 and values.flags.c_contiguous:
        return values
    dtype = getattr(values, "dtype", None)
    if dtype is not None and str(dtype).removeprefix("torch.") in _NARROW:
        raise InvalidTransferError(
            f"{what} must be int64 (or uint64) addresses, got dtype {dtype}: a narrower integer cannot hold a pointer"
        )
    return as_int64(values, what)


_NARROW = {"int8", "int16", "int32", "uint8", "uint16", "uint32"}
INT64_MAX = int(np.iinfo(np.int64).max)


def normalize(src: Any, dst: Any, sizes: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check a batch (:func:`validate`) and return it as three int64 arrays."""
    return validate(src, dst, sizes)[:3]


# Up to this many descriptors the batch is checked on Python ints: numpy's reductions cost
# about a microsecond each whatever the length, and more on a thread that ran other code
# since (the engine's): 64 scattered descriptors checked in 1/2-2/3 of the time after a
# 25 ms nap on a cloud VM's CPU, about as fast warm (tests/bench/diag_cold_calls.py).
SMALL_BATCH = 64


class Batch(NamedTuple):
    """A validated batch: three int64 arrays and the smallest and largest size."""

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    smallest: int
    largest: int


def validate(src: Any, dst: Any, sizes: Any) -> Batch:
    """Check a whole batch once, before any implementation sees it; return it as int64 arrays.

    Refused with :class:`InvalidTransferError`, naming the caller's descriptor indices:
    arrays of unequal length, not 1-D or not integers; addresses narrower than 64 bits;
    sizes under 1 byte; null or negative addresses; a range that ends past ``2**63 - 1``;
    two destination ranges that overlap; a destination range that overlaps any source
    range (the result would depend on the order of the copies). Source ranges may overlap
    each other. Arrays already int64 are returned as they are, without a copy.
    """
    s, d, n = _addresses(src, "src_ptrs"), _addresses(dst, "dst_ptrs"), _int64(sizes, "sizes")
    _equal_lengths(s, d, n)
    count = len(n)
    if not count:
        return Batch(s, d, n, 0, 0)
    if count <= SMALL_BATCH:
        return _validate_few(s, d, n)
    smallest, largest = int(n.min()), int(n.max())
    if smallest < 1:
        _bad_size(n)
    # Destinations sorted first (one sort): their ends are then their least and greatest.
    # Blocks of one size (what engines send) need only the sorted starts, not the
    # permutation; no sort at all when already ascending, nor for a large batch on a grid
    # of its block size (:func:`_grid_clash`).
    grid = None
    if smallest == largest:
        if count < GRID_FROM:  # short: a sort costs what the test for ascending order would
            ds = np.sort(d)
        elif bool((d[1:] >= d[:-1]).all()):
            ds = d
        else:
            grid = _grid_clash(d, smallest) if count >= GRID_FROM else None
            ds = None if grid is not None else np.sort(d)
        ends = None
    else:
        order = np.argsort(d)
        ds, ends = d[order], (d + n)[order]
    lo_s, hi_s = int(s.min()), int(s.max())
    lo_d, hi_d = (int(ds[0]), int(ds[-1])) if grid is None else grid[1:]
    if lo_s <= 0 or lo_d <= 0:
        _bad_address(s, d)
    if hi_s > INT64_MAX - largest or hi_d > INT64_MAX - largest:
        limit = INT64_MAX - n  # no overflow: every size is >= 1
        past = (s > limit) | (d > limit)
        if past.any():
            _past_end(s, d, n, int(np.argmax(past)))
    # Destinations against each other: of one size, no two starts closer than the size.
    if grid is not None:
        if grid[0]:
            _name_dst_clash(d, n)
    elif (int((ds[1:] - ds[:-1]).min()) < smallest) if ends is None else bool((ends[:-1] > ds[1:]).any()):
        _name_dst_clash(d, n)
    # Destinations against sources, where the two spans meet at all (host and device memory
    # lie apart): the destinations are sorted and disjoint, so their ends ascend too, and a
    # source overlaps one exactly when the last destination starting before the source ends,
    # ends after the source starts.
    if lo_d < hi_s + largest and lo_s < hi_d + largest:
        if ds is None:
            ds = np.sort(d)
        if ends is None:
            ends = ds + smallest
        pos = np.searchsorted(ds, s + n, side="left") - 1
        if bool(((pos >= 0) & (ends[np.maximum(pos, 0)] > s)).any()):
            _name_src_clash(s, d, n)
    return Batch(s, d, n, smallest, largest)


# From this many descriptors of one size, destinations on a grid of that size are checked
# by slot (:func:`_grid_clash`) instead of sorted: a few linear passes, where numpy's sort of
# 10,000 int64 addresses took 60-300 us on the hosts measured (validating 10,000: 292 -> 78 us
# on the slower, about even on the faster; tests/bench/bench_call_path.py).
GRID_FROM = 1024
# Slots per descriptor the grid check may mark in a bitmap; a wider range sorts 32-bit
# slot numbers instead (about 0.6 of sorting the addresses).
GRID_SLOTS = 64


def _grid_clash(d: np.ndarray, size: int) -> Optional[tuple[bool, int, int]]:
    """``(any two destinations overlap, least, greatest)`` for destinations that all lie
    on a grid of ``size`` bytes from the least (blocks of a pool of slots, as engines
    allocate them): two overlap exactly when they share a slot. None where they do not lie
    on such a grid, or span more slots than 32 bits count."""
    lo, hi = int(d.min()), int(d.max())
    span = (hi - lo) // size + 1
    dense = span <= GRID_SLOTS * len(d)
    if not dense and span >= 1 << 31:
        return None
    slot, off = np.divmod(d - lo, size)
    if off.any():
        return None
    if dense:
        seen = np.zeros(span, dtype=np.bool_)
        seen[slot] = True
        return np.count_nonzero(seen) != len(d), lo, hi
    slot = np.sort(slot.astype(np.int32))
    return bool((slot[1:] == slot[:-1]).any()), lo, hi


def checked(src: Any, dst: Any, sizes: Any) -> Batch:
    """:func:`validate` (the name the SwapFn's per-call check had before)."""
    return validate(src, dst, sizes)


def _validate_few(s: np.ndarray, d: np.ndarray, n: np.ndarray) -> Batch:
    """:func:`validate` for a few descriptors, on Python ints (cheaper than numpy here):
    the destinations sorted once, then linear passes and, where the spans of sources and
    destinations meet, a bisection per source."""
    sl, dl, nl = s.tolist(), d.tolist(), n.tolist()
    smallest = largest = nl[0]
    if nl.count(smallest) != len(nl):  # blocks of one size (what engines send) need no min and max
        smallest, largest = min(nl), max(nl)
    if smallest < 1:
        _bad_size(n)
    if smallest == largest:
        starts = sorted(dl)
        ends = None
    else:
        ranges = sorted(zip(dl, nl))
        starts = [a for a, _ in ranges]
        ends = list(map(add, starts, [k for _, k in ranges]))
    lo_s, lo_d, hi_s, hi_d = min(sl), starts[0], max(sl), starts[-1]
    if lo_s <= 0 or lo_d <= 0:
        _bad_address(s, d)
    if hi_s > INT64_MAX - largest or hi_d > INT64_MAX - largest:
        for i, (a, b, k) in enumerate(zip(sl, dl, nl)):
            if a > INT64_MAX - k or b > INT64_MAX - k:
                _past_end(s, d, n, i)
    if len(nl) > 1:
        if ends is None:
            clash = min(map(sub, starts[1:], starts)) < smallest  # the gaps between sorted starts
        else:
            clash = any(map(gt, ends[:-1], starts[1:]))
        if clash:
            _name_dst_clash(d, n)
    if lo_d < hi_s + largest and lo_s < hi_d + largest:
        if ends is None:
            ends = [a + smallest for a in starts]
        for a, k in zip(sl, nl):
            i = bisect_left(starts, a + k) - 1  # the last destination starting before this source ends
            if i >= 0 and ends[i] > a:
                _name_src_clash(s, d, n)
    return Batch(s, d, n, smallest, largest)


def _name_dst_clash(d: np.ndarray, n: np.ndarray) -> None:
    """Raise for two overlapping destinations (known to exist), naming their indices."""
    order = np.argsort(d, kind="stable")
    ends = (d + n)[order]
    k = int(np.argmax(ends[:-1] > d[order][1:]))
    _dst_clash(int(order[k]), int(order[k + 1]))


def _name_src_clash(s: np.ndarray, d: np.ndarray, n: np.ndarray) -> None:
    """Raise for a destination overlapping a source (known to exist), naming both."""
    order = np.argsort(d, kind="stable")
    ds, ends = d[order], (d + n)[order]
    pos = np.searchsorted(ds, s + n, side="left") - 1
    hit = (pos >= 0) & (ends[np.maximum(pos, 0)] > s)
    j = int(np.argmax(hit))
    _src_clash(int(order[int(pos[j])]), j)


def _equal_lengths(s: np.ndarray, d: np.ndarray, n: np.ndarray) -> None:
    if not len(s) == len(d) == len(n):
        raise InvalidTransferError(
            f"src_ptrs, dst_ptrs and sizes must have equal length, got {len(s)}, {len(d)}, {len(n)}"
        )


def _bad_size(n: np.ndarray) -> None:
    i = int(np.argmin(n))
    raise InvalidTransferError(f"sizes[{i}]={int(n[i])}: every size must be >= 1 byte")


def _bad_address(s: np.ndarray, d: np.ndarray) -> None:
    arr, what = (s, "src_ptrs") if s.min() <= 0 else (d, "dst_ptrs")
    i = int(np.argmin(arr))
    raise InvalidTransferError(f"{what}[{i}]={int(arr[i])} is not a valid address")


def _past_end(s: np.ndarray, d: np.ndarray, n: np.ndarray, i: int) -> None:
    arr, what = (s, "src_ptrs") if int(s[i]) > INT64_MAX - int(n[i]) else (d, "dst_ptrs")
    raise InvalidTransferError(
        f"descriptor {i}: {what}[{i}]=0x{int(arr[i]):x} + sizes[{i}]={int(n[i])} ends past the "
        f"largest address (2**63 - 1)"
    )


def _dst_clash(i: int, j: int) -> None:
    i, j = sorted((i, j))
    raise InvalidTransferError(f"destination ranges of descriptors {i} and {j} overlap")


def _src_clash(i: int, j: int) -> None:
    raise InvalidTransferError(
        f"the destination range of descriptor {i} overlaps the source range of descriptor {j}"
    )


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


def coalesce(src: Any, dst: Any, sizes: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge neighbours that are contiguous on both sides into one descriptor.

    A batch copy API copies each descriptor as its own transfer (``cuMemcpyBatchAsync``
    does not merge neighbours), and a small transfer costs the copy engine far more per
    byte than a large one, so merging runs of blocks is the caller's job.

    Takes what :func:`validate` takes (int64 arrays as they are, without a copy) and refuses
    arrays of unequal length; it does not check the descriptors themselves.
    """
    src, dst, sizes = _addresses(src, "src_ptrs"), _addresses(dst, "dst_ptrs"), _int64(sizes, "sizes")
    _equal_lengths(src, dst, sizes)
    return merge_runs(src, dst, sizes)


def merge_runs(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`coalesce` for int64 arrays of equal length (kvswap's own, already checked)."""
    if len(sizes) < 2:
        return src, dst, sizes
    idx = run_starts(src, dst, sizes)
    if len(idx) == len(sizes):
        return src, dst, sizes
    return src[idx], dst[idx], np.add.reduceat(sizes, idx)


def run_starts(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Indices of the descriptors that begin a run :func:`merge_runs` merges: merged
    descriptor ``k`` starts at the caller's descriptor ``run_starts(...)[k]``."""
    starts = np.ones(len(sizes), dtype=bool)
    starts[1:] = (src[:-1] + sizes[:-1] != src[1:]) | (dst[:-1] + sizes[:-1] != dst[1:])
    return np.flatnonzero(starts)
