"""How a mover orders, marks and times its jobs: device streams and events, or the host.

A mover enqueues every job on one transfer stream, so jobs complete in submission order
and a job is complete once the marker recorded after it is. The host flavour is what a
CPU-only machine gets: the copy has finished when the copy function returns.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager


class HostCompletion:
    """Synchronous copies on the host: markers are clock readings, always complete."""

    stream: Any = None

    def order_after_compute(self) -> None:
        """Nothing to order after: host copies run when called."""

    def device_guard(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def mark(self) -> Any:
        return time.perf_counter()

    def done(self, marker: Any) -> bool:
        return True

    def wait(self, marker: Any) -> None:
        pass

    def seconds(self, start: Any, end: Any) -> float:
        return end - start

    def recycle(self, *markers: Any) -> None:
        pass


class CudaCompletion:
    """A transfer stream on a CUDA (or ROCm) device, with timing events reused from a free list.

    :param device_index: the device the stream and events belong to.
    :param stream: the transfer stream (a torch stream or a raw handle); None creates one,
        so copies overlap the compute stream instead of queueing behind it.
    """

    def __init__(self, device_index: int, stream: Any = None) -> None:
        import torch

        from .streams import torch_stream

        self._torch = torch
        self.index = device_index
        self.stream = torch.cuda.Stream(device=device_index) if stream is None else torch_stream(stream, device_index)
        self._events: list[Any] = []

    def order_after_compute(self) -> None:
        """Make the transfer stream wait for the work queued so far on the current stream,
        which produced the blocks a device-to-host copy reads or still reads the blocks a
        host-to-device copy overwrites."""
        current = self._torch.cuda.current_stream(self.index)
        if current.cuda_stream != self.stream.cuda_stream:
            self.stream.wait_stream(current)

    def device_guard(self) -> ContextManager[Any]:
        """Make the mover's device current while a backend enqueues (kernels launch on the
        current device, whatever stream they are given)."""
        return self._torch.cuda.device(self.index)

    def mark(self) -> Any:
        ev = self._events.pop() if self._events else self._torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev

    def done(self, marker: Any) -> bool:
        return marker.query()

    def wait(self, marker: Any) -> None:
        marker.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3

    def recycle(self, *markers: Any) -> None:
        self._events.extend(markers)
