"""Every error kvswap raises derives from :class:`KvSwapError`.

Bad input is a :class:`ValueError` too, failures of the driver or of resolution a
:class:`RuntimeError`, so callers that already catch the builtin kinds keep working.
"""
from __future__ import annotations


class KvSwapError(Exception):
    """Root of every kvswap error."""


class ConfigurationError(KvSwapError, ValueError):
    """A direction, policy, device or option that kvswap cannot accept."""


class DeviceNotFoundError(ConfigurationError):
    """The device asked for is not on this machine: torch sees no GPU, or fewer than the
    index named (the CLI exits 3 for it)."""


class InvalidImplError(ConfigurationError):
    """A CopyImpl or Calibration that contradicts itself; the message names it."""


class InvalidTransferError(KvSwapError, ValueError):
    """A transfer refused before any byte moved (bad descriptors, ids, tensors)."""


# BlockMover's refusals, each an InvalidTransferError (so a ValueError).

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


class AllocationError(KvSwapError, MemoryError):
    """Memory kvswap needs could not be allocated: device memory, or page-locked host memory.

    Nothing allocated for that purpose is kept; the mover or call that asked for it is left
    as it was, and other movers are not affected.

    :ivar what: what the memory was for (``"BlockMover descriptor buffer for 1024
        descriptors"``).
    :ivar nbytes: how many bytes were asked for (0: not known, as for a stream).
    :ivar memory: ``"device"``, ``"page-locked host"`` or ``"host"``.
    """

    def __init__(self, what: str, nbytes: int, memory: str, cause: str = "") -> None:
        self.what, self.nbytes, self.memory = what, int(nbytes), memory
        detail = f": {cause}" if cause else ""
        size = f"{self.nbytes:,} bytes of " if self.nbytes > 0 else ""
        super().__init__(f"could not allocate {size}{memory} memory for {what}{detail}")


class ForkedProcessError(KvSwapError, RuntimeError):
    """A BlockMover used in a process forked after it was built, or a device mover built in
    a child forked after CUDA was initialised: neither the mover's threads nor a device
    context survive ``fork()``. Build movers in the process that uses them (start workers
    with ``multiprocessing``'s ``spawn`` method where they use the device)."""


class ResolutionError(KvSwapError, RuntimeError):
    """No implementation can serve the request, or a forced one cannot be honoured."""


class UnknownImplError(ResolutionError):
    """A forced implementation name that no loaded plugin registers (a mistake in the
    caller's ``Policy.force`` or ``KVSWAP_FORCE_IMPL``; the CLI exits 2 for it)."""


class DriverError(KvSwapError, RuntimeError):
    """A driver or runtime call failed.

    :ivar code: the numeric status the driver returned.
    :ivar name: the driver's name for it (``CUDA_ERROR_INVALID_VALUE``), if known.
    :ivar index: the failing descriptor's index where the driver reports one, else None.
    """

    def __init__(
        self,
        call: str,
        code: int,
        name: str | None = None,
        text: str | None = None,
        index: int | None = None,
    ) -> None:
        self.call = call
        self.code = code
        self.name = name
        self.text = text
        self.index = index
        label = name or "unknown error"
        message = f"{call} failed: {label} ({code})"
        if text:
            message += f": {text}"
        if index is not None:
            message += f" [descriptor {index}]"
        super().__init__(message)


class BackendError(KvSwapError, RuntimeError):
    """A copy implementation's own code raised an exception that is not kvswap's (a
    vendor runtime's ``RuntimeError("DMA queue full")``, say). The message names the
    implementation; the original exception is chained as ``__cause__``.

    :ivar impl: the implementation's name.
    """

    def __init__(self, impl: str, cause: str) -> None:
        self.impl = impl
        super().__init__(f"{impl} failed: {cause}")


class KvSwapWarning(UserWarning):
    """Root of kvswap's warnings."""


class PluginWarning(KvSwapWarning):
    """A plugin was dropped or partly ignored; the message names it and says why."""


class ProfileWarning(KvSwapWarning):
    """A calibration profile was skipped; the message names the file and says why."""
