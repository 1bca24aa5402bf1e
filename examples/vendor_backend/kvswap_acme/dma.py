"""The ACME runtime's batch copy, simulated in host memory.

A real vendor runtime exposes one call that takes the three descriptor arrays by pointer
and copies the whole batch (``cuMemcpyBatchAsync``, ``hipMemcpyBatchAsync``); the backend
hands the arrays over without touching them one by one. This stand-in has the same
contract and the same limits as the imaginary hardware: 8-byte aligned addresses and sizes,
at most 1 MiB per descriptor (a 20-bit length field). It refuses a bad batch whole, before
copying anything, as a driver does.
"""
from __future__ import annotations

import ctypes

import numpy as np

ALIGNMENT = 8
MAX_DESCRIPTOR_BYTES = 1 << 20


class AcmeError(RuntimeError):
    """The runtime refused a batch; ``index`` is the first bad descriptor."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(f"{message} [descriptor {index}]")
        self.index = index


def batch_copy(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
    """Copy ``sizes[i]`` bytes from ``src[i]`` to ``dst[i]`` for every i (host addresses)."""
    bad = ((src | dst | sizes) % ALIGNMENT != 0) | (sizes > MAX_DESCRIPTOR_BYTES) | (sizes < 1)
    if bad.any():
        raise AcmeError("descriptor violates the DMA engine's limits", int(np.flatnonzero(bad)[0]))
    # The simulated engine: one memmove per descriptor (the hardware would walk the list).
    memmove = ctypes.memmove
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        memmove(d, s, n)
