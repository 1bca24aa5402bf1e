"""How a mover orders, marks and times its jobs: device streams and events, or the host.

A mover enqueues every job on one transfer stream, so jobs complete in submission order
and a job is complete once the marker recorded after it is. The host flavour is what a
CPU-only machine gets: the copy has finished when the copy function returns.

Markers may be recorded on a mover's issuing thread while the engine's thread records
those of a job it issues itself and recycles finished ones: the free list is only popped
and extended, each atomic under the GIL.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, ContextManager

from ..errors import ConfigurationError


class _CurrentStream:
    def __repr__(self) -> str:
        return "CURRENT_STREAM"


CURRENT_STREAM: Any = _CurrentStream()
"""``submit(..., after=CURRENT_STREAM)``, the default: order after the work already
queued on the current stream."""


# The kind of each type of ``after`` seen so far: a failed hasattr raises inside, which a
# submit on a cold thread pays for every time.
_KINDS: dict[type, str] = {}


def _after_kind(after: Any) -> str:
    """``"current"``, ``"none"``, ``"stream"`` or ``"event"``; refuses anything else."""
    if after is CURRENT_STREAM:
        return "current"
    if after is None:
        return "none"
    kind = _KINDS.get(type(after))
    if kind is not None:
        return kind
    if hasattr(after, "wait_stream") and hasattr(after, "cuda_stream"):
        kind = "stream"
    elif hasattr(after, "record") and hasattr(after, "query") and hasattr(after, "synchronize"):
        kind = "event"
    if kind is not None:
        _KINDS[type(after)] = kind
        return kind
    raise ConfigurationError(
        f"after={after!r} must be omitted (the current stream), None (wait for nothing), "
        f"a torch.cuda.Stream or a torch.cuda.Event"
    )


class HostCompletion:
    """Synchronous copies on the host: markers are clock readings, always complete."""

    stream: Any = None

    def order_after_compute(self) -> None:
        """Nothing to order after: host copies run when called."""

    def order_after(self, after: Any) -> None:
        """Nothing to wait for: host copies run when called."""

    def check_after(self, after: Any) -> None:
        """Host copies run when called: only the default and None make sense here."""
        if _after_kind(after) not in ("current", "none"):
            raise ConfigurationError(
                f"after={after!r}: a mover between host tensors copies when submit is called, so it "
                f"can wait for no stream or event; pass None or leave after out"
            )

    def device_guard(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def bind_thread(self) -> None:
        """Nothing to bind: host copies need no device context."""

    def mark(self) -> Any:
        return time.perf_counter()

    def unrecorded(self) -> Any:
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
    :param stream: the transfer stream (a torch stream or a raw handle); None takes one of
        kvswap's own (:func:`kvswap.registry.streams.own_stream`), so copies overlap the
        compute stream instead of queueing behind it.
    """

    def __init__(self, device_index: int, stream: Any = None) -> None:
        import torch

        from ..registry.streams import own_stream, torch_stream

        self._torch = torch
        self.index = device_index
        self.stream = own_stream(device_index, self) if stream is None else torch_stream(stream, device_index)
        self._events: list[Any] = []
        self._order_event: Any = None

    def order_after_compute(self) -> None:
        """Make the transfer stream wait for the work queued so far on the current stream,
        which produced the blocks a device-to-host copy reads or still reads the blocks a
        host-to-device copy overwrites."""
        current = self._torch.cuda.current_stream(self.index)
        if current.cuda_stream != self.stream.cuda_stream:
            self._wait_stream(current)

    def _wait_stream(self, other: Any) -> None:
        # One event, recorded again each time: a stream wait captures the record made
        # before it (CUDA's cudaStreamWaitEvent), so reuse is safe and saves creating one.
        if getattr(other, "device_index", self.index) != self.index:
            self.stream.wait_stream(other)  # another device's stream: an event of its own
            return
        ev = self._order_event
        if ev is None:
            ev = self._order_event = self._torch.cuda.Event()
        ev.record(other)
        self.stream.wait_event(ev)

    def check_after(self, after: Any) -> None:
        """Refuse an ``after`` that is no stream, event, None or the default."""
        _after_kind(after)

    def order_after(self, after: Any) -> None:
        """Make the transfer stream wait for ``after``: :data:`CURRENT_STREAM` (the
        current stream, :meth:`order_after_compute`), None (nothing), a stream (the work
        queued on it so far) or an event (its last record)."""
        kind = _after_kind(after)
        if kind == "current":
            self.order_after_compute()
        elif kind == "stream":
            if after.cuda_stream != self.stream.cuda_stream:
                self._wait_stream(after)
        elif kind == "event":
            self.stream.wait_event(after)

    def device_guard(self) -> ContextManager[Any]:
        """Make the mover's device current while a backend enqueues (kernels launch on the
        current device, whatever stream they are given)."""
        return self._torch.cuda.device(self.index)

    def bind_thread(self) -> None:
        """Make the device's primary context current on the calling thread (a mover's
        issuing thread, before its first job): driver-API launches on a thread that made no
        runtime call yet find no context. A runtime call on the transfer stream binds it."""
        with self.device_guard():
            self._torch.cuda.Event().record(self.stream)

    def mark(self) -> Any:
        try:
            ev = self._events.pop()
        except IndexError:
            ev = self._torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev

    def unrecorded(self) -> Any:
        """A marker that reads as passed at once, for a job that enqueued nothing where no
        marker could be recorded (an event never recorded counts as complete)."""
        return self._torch.cuda.Event(enable_timing=True)

    def done(self, marker: Any) -> bool:
        return marker.query()

    def wait(self, marker: Any) -> None:
        marker.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3

    def recycle(self, *markers: Any) -> None:
        self._events.extend(markers)
