"""Streams as GPU backends receive them: one way to turn what a caller passed into a handle."""
from __future__ import annotations

from typing import Any


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
