"""``copy()``: the Triton copy kernel as a plain function, without ``resolve()``.

For code that has already decided to use the kernel (a benchmark, an engine with its own
routing) and wants one launch over a batch of descriptors, with an explicit SM budget.
It takes the same arguments as a :class:`~kvswap.SwapFn` plus ``num_sms`` and ``device``,
validates the whole batch with the same check a ``SwapFn`` makes
(:func:`kvswap.addressing.descriptors.validate`) before any byte moves, and reuses one bound
launcher per ``(num_sms, device)``. It does not merge contiguous runs: it launches what
it is given.

``resolve()`` is the way to get the kernel chosen, capped and translated for you; this is
the way to call it directly.
"""
from __future__ import annotations

from typing import Any, Optional

from kvswap.addressing.descriptors import validate
from kvswap.errors import ConfigurationError

from . import launch
from .launch import KernelCopy, Launch, interpreting

__all__ = ["copy"]

_LAUNCHERS: dict[tuple[int, Optional[int]], KernelCopy] = {}


def _launch_device(device: Any) -> Optional[int]:
    if interpreting():
        if device is not None and str(device) != "cpu":
            raise ConfigurationError(
                f"device={device!r}: under TRITON_INTERPRET=1 the kernel runs on the CPU; pass device=None or 'cpu'"
            )
        return None
    import torch

    if not torch.cuda.is_available():
        raise ConfigurationError(
            "no GPU visible to torch; on a CPU set TRITON_INTERPRET=1 to run the kernel in Triton's interpreter"
        )
    if device is None:
        return torch.cuda.current_device()
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise ConfigurationError(f"device={device!r} must be a CUDA/ROCm device ('cuda:N') or an index")
    return torch.cuda.current_device() if dev.index is None else dev.index


def copy(src_ptrs: Any, dst_ptrs: Any, sizes: Any, *, num_sms: int,
         device: Any = None, stream: Any = None) -> Launch:
    """Copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to ``dst_ptrs[i]`` with one kernel launch.

    :param src_ptrs: source addresses (1-D int64 CPU tensor, numpy array or sequence).
    :param dst_ptrs: destination addresses, same length; the ranges must not overlap each
        other or any source range.
    :param sizes: byte counts (>= 1 each; any size, any alignment).
    :param num_sms: the SM budget: the grid never has more programs than this.
    :param device: the GPU (``"cuda:N"``, an index, a torch.device; default the current one).
        Under ``TRITON_INTERPRET=1`` the kernel runs in Triton's CPU interpreter and every
        address is a host address.
    :param stream: where to enqueue (None: the current stream; a torch stream; a raw handle).
    :return: what was launched (:class:`~kvswap.backends.triton_generic.launch.Launch`:
        grid size and tile shape).
    :raises InvalidTransferError: a batch :func:`kvswap.addressing.descriptors.validate` refuses (the
        check every ``SwapFn`` makes), before any byte moves.
    :raises ConfigurationError: no Triton, no device to run on, or a bad ``num_sms``.

    Addresses are used as given: on ROCm, pass device pointers for ``hipHostRegister``
    memory (``resolve()`` translates them itself). Any mix of host and device addresses
    the device can reach is fine (host->device, device->host, device->device). On a GPU
    the call returns once the copy is enqueued.
    """
    if not launch.HAS_TRITON:
        raise ConfigurationError("Triton is not installed (pip install 'kvswap[triton]')")
    if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1:
        raise ConfigurationError(f"num_sms={num_sms!r} must be an int >= 1")
    # The SwapFn's own check: nothing reaches the kernel that resolve() would refuse.
    src, dst, n = validate(src_ptrs, dst_ptrs, sizes)[:3]
    index = _launch_device(device)
    key = (num_sms, index)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        launcher = _LAUNCHERS[key] = KernelCopy(num_sms, index)
    return launcher(src, dst, n, stream)
