"""The specific errors a :class:`~kvswap.BlockMover` raises before any byte moves.

All are :class:`~kvswap.InvalidTransferError` (so ``ValueError``): an engine that catches
either keeps working, and a test can ask for the exact kind.
"""
from __future__ import annotations

from .errors import InvalidTransferError


class BlockLayoutError(InvalidTransferError):
    """A tensor's blocks cannot be cut into contiguous chunks, or src and dst chunks differ."""


class TensorPlacementError(InvalidTransferError):
    """A tensor is on the wrong device for the direction, or the tensors disagree."""


class UnpinnedMemoryError(TensorPlacementError):
    """A host tensor is pageable where the chosen route reads or writes it from the device."""


class BlockIdError(InvalidTransferError):
    """Block ids that are out of range, negative, not integers, unequal in number or repeated."""


class MoverClosedError(InvalidTransferError):
    """A submit after :meth:`~kvswap.BlockMover.close`."""


__all__ = [
    "BlockIdError",
    "BlockLayoutError",
    "MoverClosedError",
    "TensorPlacementError",
    "UnpinnedMemoryError",
]
