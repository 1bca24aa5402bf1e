"""kvswap backend ``triton``: the ``triton.kernel`` copy, for any GPU platform Triton runs on.

One Triton kernel copies a whole batch of (src, dst, size) descriptors in one launch on a
bounded number of programs (the SM budget), several blocks side by side per step, so it
stays near the link's ceiling at small block sizes where the copy engine's batch API
collapses (FACTS.md). It loads from and stores to pinned host memory directly, so it needs
a device that can address host memory from a kernel; host addresses go through the
platform's translator (identity on CUDA; ROCm may map ``hipHostRegister`` memory elsewhere).

:func:`copy` is the plain launcher. Under ``TRITON_INTERPRET=1`` it runs the same kernel
in Triton's CPU interpreter over host addresses, and ``triton.kernel`` is then offered on
the ``cpu`` platform too, so the kernel's logic is tested without a GPU.

Importing this module is cheap: Triton and torch.cuda load inside functions.
"""
from __future__ import annotations

import importlib.util
from typing import Any, Callable, Optional

from kvswap import hookimpl
from kvswap.descriptors import first_overlap, normalize
from kvswap.errors import ConfigurationError, InvalidTransferError
from kvswap.impl import BindContext, CopyImpl, same_addresses
from kvswap.types import DeviceInfo, Direction

from .launch import DEFAULT_PLANS, KernelCopy, Launch, Tile, TilePlan, interpreting

NAME = "triton.kernel"
# Whether Triton is installed, found without importing it.
HAS_TRITON = importlib.util.find_spec("triton") is not None
GPU_PLATFORMS = ("cuda", "rocm")
_TRITON_BACKEND = {"cuda": "nvidia", "rocm": "amd"}

__all__ = ["HAS_TRITON", "NAME", "PRECOMPILE_BLOCKS", "KernelCopy", "Launch", "Tile", "TilePlan", "copy", "copy_impl"]


def availability(device: DeviceInfo) -> Optional[str]:
    """None when ``triton.kernel`` can run on ``device``, else the reason it cannot."""
    if not HAS_TRITON:
        return "Triton is not installed (pip install 'kvswap[triton]')"
    if device.platform == "cpu":
        if interpreting():
            return None
        return "the device is a CPU; the Triton kernel runs there only in Triton's interpreter (TRITON_INTERPRET=1)"
    if interpreting():
        return "TRITON_INTERPRET=1 runs Triton kernels on the CPU, which cannot address device memory; unset it"
    backend = _TRITON_BACKEND.get(device.platform)
    try:
        import triton.backends
    except Exception as e:
        return f"Triton cannot be imported: {type(e).__name__}: {e}"
    if backend not in triton.backends.backends:
        return f"this Triton build has no {backend!r} backend for {device.platform}"
    for key in ("can_map_host_memory", "unified_addressing"):
        if device.details.get(key) is False:
            return f"the device cannot address host memory from a kernel ({key} is false)"
    return None


def _device_index(device: DeviceInfo) -> Optional[int]:
    if device.platform == "cpu":
        return None
    if device.index is not None:
        return device.index
    import torch

    return torch.cuda.current_device()


# Block sizes whose kernel variants bind() compiles (16-byte aligned), so an engine's first
# transfers do not stop for a compile (~1 s each without Triton's on-disk cache, tens of
# ms with it). With the default shapes: 4 KiB blocks and everything from 8 KiB up; other
# sizes and alignments compile on first use.
PRECOMPILE_BLOCKS = (4096, 16384)


def bind(ctx: BindContext) -> KernelCopy:
    """The factory: bind the SM budget and launch shapes once, at resolve time, and on a
    GPU compile the kernel variants for ``PRECOMPILE_BLOCKS``.

    ``ctx.params`` may override the direction's default shape (``tile_elems``,
    ``row_max``, ``warps``, ``align_max``, ``prefetch``, ``cache``, ``host_tiles``), e.g.
    from a calibration, and ``precompile`` (block sizes in bytes; empty: none).
    """
    num_sms = ctx.params.get("num_sms", 8)
    host_src = ctx.direction is Direction.H2D
    # No translation where host and device share addresses: no per-call work for it.
    translate = None if ctx.translate_host is same_addresses else ctx.translate_host
    fn = KernelCopy(
        num_sms=int(num_sms),
        device_index=_device_index(ctx.device),
        tiles=TilePlan.from_params(ctx.params, DEFAULT_PLANS[str(ctx.direction)]),
        translate_src=translate if host_src else None,
        translate_dst=None if host_src else translate,
    )
    fn.prepare(ctx.params.get("precompile", PRECOMPILE_BLOCKS))
    return fn


def copy_impl() -> CopyImpl:
    """``triton.kernel`` as registered now (``cpu`` too while ``TRITON_INTERPRET=1``)."""
    platforms = GPU_PLATFORMS + (("cpu",) if interpreting() else ())
    return CopyImpl(
        name=NAME,
        kind="kernel",
        platforms=platforms,
        directions=(Direction.H2D, Direction.D2H),
        factory=bind,
        availability=availability,
        requires_pinned=True,
        description="Triton kernel: one launch per batch on a bounded SM budget, several blocks per step",
    )


@hookimpl
def kvswap_register_copy_impls(platform: str, register: Callable[[CopyImpl], None]) -> None:
    impl = copy_impl()
    if platform in impl.platforms:
        register(impl)


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
    :param dst_ptrs: destination addresses, same length; the ranges must not overlap.
    :param sizes: byte counts (>= 1 each; any size, any alignment).
    :param num_sms: the SM budget: the grid never has more programs than this.
    :param device: the GPU (``"cuda:N"``, an index, a torch.device; default the current one).
        Under ``TRITON_INTERPRET=1`` the kernel runs in Triton's CPU interpreter and every
        address is a host address.
    :param stream: where to enqueue (None: the current stream; a torch stream; a raw handle).
    :return: what was launched (:class:`Launch`: grid size and tile shape).
    :raises InvalidTransferError: bad descriptors or overlapping destinations, before any byte moves.
    :raises ConfigurationError: no Triton, no device to run on, or a bad ``num_sms``.

    Addresses are used as given: on ROCm, pass device pointers for ``hipHostRegister``
    memory (``resolve()`` translates them itself). On a GPU the call returns once the copy
    is enqueued.
    """
    if not HAS_TRITON:
        raise ConfigurationError("Triton is not installed (pip install 'kvswap[triton]')")
    if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1:
        raise ConfigurationError(f"num_sms={num_sms!r} must be an int >= 1")
    src, dst, n = normalize(src_ptrs, dst_ptrs, sizes)
    clash = first_overlap(dst, n)
    if clash is not None:
        raise InvalidTransferError(f"destination ranges of descriptors {clash[0]} and {clash[1]} overlap")
    index = _launch_device(device)
    key = (num_sms, index)
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        launcher = _LAUNCHERS[key] = KernelCopy(num_sms, index)
    return launcher(src, dst, n, stream)
