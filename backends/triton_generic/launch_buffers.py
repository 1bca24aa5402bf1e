"""Where a GPU launch keeps its descriptors, and the stream it enqueues on.

A :class:`LaunchBuffer` is one pinned int64 buffer the launcher packs a batch into, with the
event recorded after the kernel that reads it and, made on first need, a device buffer of
the same size for batches whose descriptors are uploaded first. The event guards both:
neither is written again before the kernel that read it has finished. Buffers are kept
across calls (allocating pinned or device memory and events per call costs several µs).

Imported only from the launch path; torch loads in the methods.
"""
from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any, Callable, Optional

import numpy as np

from kvswap.memory.allocation import allocating

MIN_ELEMS = 3 * 1024  # the smallest buffer: batches up to 1024 descriptors
# How many kept buffers one take() asks about before making a new one: every query is a
# driver call, and on one stream the oldest buffer frees first anyway.
PROBES = 3


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


class LaunchBuffer:
    """One launch buffer: ``host`` (pinned tensor), ``view`` (its numpy view),
    ``host_ptr`` (the address a kernel reads it at), ``done`` (event), ``dev`` (device
    tensor or None until needed) and ``dev_ptr``."""

    __slots__ = ("host", "view", "host_ptr", "done", "dev", "dev_ptr")

    def __init__(self, host: Any, host_ptr: int, done: Any) -> None:
        self.host = host
        self.view: np.ndarray = host.numpy()
        self.host_ptr = host_ptr
        self.done = done
        self.dev: Any = None
        self.dev_ptr = 0

    @property
    def capacity(self) -> int:
        return self.view.size


class LaunchBufferPool:
    """Launch buffers of one device, each reused only once its last kernel finished.
    Launchers share one per device (:func:`shared_pool`), so ``take`` and ``give`` hold
    a lock.

    :param device_index: the GPU the events and device buffers belong to.
    :param translate: maps host addresses to ones a kernel may use (ROCm can map pinned
        memory elsewhere); applied once per buffer. None: identity.
    """

    def __init__(self, device_index: int, translate: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> None:
        self.device_index = device_index
        # Weak: a shared pool is kept per translator only while that translator lives (its
        # launchers hold it), so the pool must not be what keeps it alive.
        self._translate_ref = None if translate is None else weakref.ref(translate)
        # Oldest first: buffers go back in the order their kernels were enqueued.
        self._free: deque[LaunchBuffer] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._free)

    @property
    def _translate(self) -> Optional[Callable[[np.ndarray], np.ndarray]]:
        return None if self._translate_ref is None else self._translate_ref()

    def take(self, count: int) -> LaunchBuffer:
        """A free buffer of at least ``count`` elements (made if none is; never waits)."""
        free = self._free
        with self._lock:
            for _ in range(min(PROBES, len(free))):
                entry = free[0]
                if not entry.done.query():
                    # Busy: look behind it next time too (another stream's buffers may be free).
                    free.rotate(-1)
                    continue
                free.popleft()
                if entry.capacity >= count:
                    return entry
                # Free but too small: let it go; a larger one replaces it.
        # None free: make another rather than wait. Waiting would stall the engine's host
        # thread behind every transfer in flight (an engine may queue dozens behind a busy
        # stream); the pool grows to the most transfers ever in flight, a few KiB each.
        return self._new(count)

    def give(self, entry: LaunchBuffer) -> None:
        """Return ``entry`` once its kernel (and event) are enqueued."""
        with self._lock:
            self._free.append(entry)

    def device_buffer(self, entry: LaunchBuffer) -> Any:
        """``entry``'s device buffer, made on first need (same size, same event)."""
        if entry.dev is None:
            import torch

            with allocating(f"the device copy of a kernel launch's descriptors ({entry.capacity} words)",
                            8 * entry.capacity, "device"):
                entry.dev = torch.empty(entry.capacity, dtype=torch.int64, device=f"cuda:{self.device_index}")
            entry.dev_ptr = entry.dev.data_ptr()
        return entry.dev

    def _new(self, count: int) -> LaunchBuffer:
        import torch

        translate = self._translate
        if translate is None and self._translate_ref is not None:
            raise RuntimeError("launch buffer pool outlived the address translator its buffers are mapped through")
        words = max(_pow2_at_least(count), MIN_ELEMS)
        with allocating(f"a kernel launch's descriptor buffer ({words} words)", 8 * words, "page-locked host"):
            host = torch.empty(words, dtype=torch.int64, pin_memory=True)
        ptr = host.data_ptr()
        if translate is not None:
            ptr = int(np.asarray(translate(np.array([ptr], dtype=np.int64)))[0])
        return LaunchBuffer(host, ptr, torch.cuda.Event())


_POOLS: dict[int, LaunchBufferPool] = {}
# Pools whose buffers are mapped through a translator live as long as it does: a plugin may
# make a translator per resolve, and a pool held past it would keep its pinned buffers.
_MAPPED: "weakref.WeakKeyDictionary[Any, dict[int, LaunchBufferPool]]" = weakref.WeakKeyDictionary()
_POOLS_LOCK = threading.Lock()


def shared_pool(device_index: int, translate: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> LaunchBufferPool:
    """The launch buffer pool every launcher on ``device_index`` (with this ``translate``)
    shares. One pool, not one per bound function: a resolved function binds its kernel
    once per SM tier, an engine resolves both directions, and each pool would keep its own
    pinned buffers (and two bindings of one route would read descriptors from buffers placed
    differently, which timed them apart)."""
    # Up to 2% apart on the H200.
    with _POOLS_LOCK:
        pools = _POOLS if translate is None else _MAPPED.setdefault(translate, {})
        pool = pools.get(device_index)
        if pool is None:
            pool = pools[device_index] = LaunchBufferPool(device_index, translate)
        return pool


class Streams:
    """Turns the ``stream`` argument into a torch stream, keeping the wrappers of raw
    handles (making an ``ExternalStream`` per call costs µs) — see kvswap.registry.streams."""

    KEEP = 64  # raw handles remembered

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self._external: dict[int, Any] = {}

    def get(self, stream: Any) -> Any:
        if hasattr(stream, "cuda_stream"):
            return stream
        import torch

        if stream is None:
            return torch.cuda.current_stream(self.device_index)
        if isinstance(stream, int) and not isinstance(stream, bool):
            s = self._external.get(stream)
            if s is None:
                if len(self._external) >= self.KEEP:
                    self._external.clear()
                s = self._external[stream] = torch.cuda.ExternalStream(stream, device=self.device_index)
            return s
        from kvswap.registry.streams import torch_stream

        return torch_stream(stream, self.device_index)
