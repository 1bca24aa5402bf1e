"""Streams: one way to turn what a caller passed into a handle, and streams of kvswap's own.

``torch.cuda.Stream()`` hands out the device's pooled streams in turn (32 per priority), so
a stream made that way may be one the engine already computes on, and a copy queued on it
waits for the compute. kvswap's transfer and link streams are created by the platform's
backend instead (the hook ``kvswap_create_stream``), held by their owner, and given back to
a free list when the owner is collected, for kvswap's next owner on that device.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any, Optional

_lock = threading.Lock()
_free: dict[int, list[int]] = {}  # device index -> handles created for kvswap, not held now
_warned: set[int] = set()


def torch_stream(stream: Any, device_index: int) -> Any:
    """The torch stream to enqueue on: ``stream`` itself if it is a torch stream, the
    current stream of ``device_index`` if it is None, or an external stream around a raw
    handle (an int: ``0`` is the legacy default stream)."""
    import torch

    if stream is None:
        return torch.cuda.current_stream(device_index)
    if isinstance(stream, int) and not isinstance(stream, bool):
        return torch.cuda.ExternalStream(stream, device=device_index)
    if hasattr(stream, "cuda_stream"):
        return stream
    from ..errors import ConfigurationError

    raise ConfigurationError(f"stream={stream!r} must be None, a torch.cuda.Stream or a raw handle (int)")


def raw_handle(stream: Any, device_index: int) -> int:
    """The driver handle (``CUstream``/``hipStream_t``) as an int; 0 is the legacy default stream."""
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    return int(torch_stream(stream, device_index).cuda_stream)


def own_stream(device_index: int, owner: object, host: Any = None) -> Any:
    """A stream on device ``device_index`` that no other code is handed, as a torch stream,
    held for as long as ``owner`` lives (:func:`own_handle`); where no plugin creates
    streams, one from torch's pool."""
    import torch

    handle = own_handle(device_index, owner, host)
    if handle is None:
        return torch.cuda.Stream(device=device_index)
    return torch.cuda.ExternalStream(handle, device=device_index)


def own_handle(device_index: int, owner: object, host: Any = None, platform: Optional[str] = None) -> Optional[int]:
    """The handle of a stream of kvswap's own on ``device_index``, held until ``owner`` is
    collected: one given back earlier, else a new one from the first plugin whose
    ``kvswap_create_stream`` answers for the platform (a plugin that raises or answers
    nonsense is dropped, with a warning naming it). None where no plugin does, with a
    :class:`kvswap.KvSwapWarning` once per device: a pooled stream may be shared.
    """
    with _lock:
        free = _free.get(device_index)
        handle: Optional[int] = free.pop() if free else None
    if handle is None:
        handle = _create(device_index, host, platform)
    if handle is not None:
        weakref.finalize(owner, _give_back, device_index, handle)
    return handle


def _give_back(device_index: int, handle: int) -> None:
    with _lock:
        _free.setdefault(device_index, []).append(handle)


def valid_handle(handle: Any) -> bool:
    """Whether an answer of ``kvswap_create_stream`` is a stream handle: an int > 0."""
    return isinstance(handle, int) and not isinstance(handle, bool) and handle > 0


def _create(device_index: int, host: Any, platform: Optional[str]) -> Optional[int]:
    from ..errors import KvSwapWarning
    from .platform import torch_platform
    from .plugins import plugin_host

    host = host or plugin_host()
    platform = platform or torch_platform()
    for plugin, handle in host.call_each("kvswap_create_stream", platform=platform, device_index=device_index):
        if handle is None:
            continue
        if not valid_handle(handle):
            host.drop(plugin, f"kvswap_create_stream returned {handle!r}, not a stream handle")
            continue
        return handle
    with _lock:
        first = device_index not in _warned
        _warned.add(device_index)
    if first:
        warnings.warn(f"no kvswap plugin creates streams on {platform} device {device_index}: kvswap's transfer "
                      f"streams come from torch's stream pool and may be one the engine computes on",
                      KvSwapWarning, stacklevel=3)
    return None
