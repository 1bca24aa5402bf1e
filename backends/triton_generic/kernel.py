"""``triton.kernel``: a batch of descriptors in one Triton kernel launch, h2d, d2h or d2d.

The kernel (:mod:`.jit`) copies a whole batch on a bounded number of programs (the SM
budget), several blocks side by side per step, so it stays near the link's ceiling at
block sizes where a copy engine's batch call is slow. It loads from and stores to pinned
host memory directly, so it needs a device that can address host memory from a kernel;
host addresses go through the platform's translator (identity on CUDA; ROCm may map
``hipHostRegister`` memory elsewhere).

Under ``TRITON_INTERPRET=1`` the same kernel runs in Triton's CPU interpreter over host
addresses, and ``triton.kernel`` is then offered on the ``cpu`` platform too, so its logic
is tested without a GPU.
"""
from __future__ import annotations

from typing import Optional

from kvswap.registry.impl import BindContext, CopyImpl, same_addresses
from kvswap.types import DeviceInfo, Direction

from . import launch
from .by_ids import KernelCopyByIds
from .launch import DEFAULT_PLANS, TilePlan, interpreting

NAME = "triton.kernel"
GPU_PLATFORMS = ("cuda", "rocm")
_TRITON_BACKEND = {"cuda": "nvidia", "rocm": "amd"}
# Block sizes whose kernel variants bind() compiles (16-byte aligned), so an engine's first
# transfers do not stop for a compile (~1 s each without Triton's on-disk cache, tens of
# ms with it). With the default shapes: 4 KiB blocks and everything from 8 KiB up; other
# sizes and alignments compile on first use.
PRECOMPILE_BLOCKS = (4096, 16384)


def availability(device: DeviceInfo) -> Optional[str]:
    """None when ``triton.kernel`` can run on ``device``, else the reason it cannot."""
    if not launch.HAS_TRITON:
        return "Triton is not installed (pip install 'kvswap[triton]')"
    if device.platform == "cpu":
        if interpreting():
            return None
        return "the device is a CPU; the Triton kernel runs there only in Triton's interpreter (TRITON_INTERPRET=1)"
    backend = _TRITON_BACKEND.get(device.platform)
    if backend is None:
        return f"Triton has no backend for {device.platform} devices"
    if interpreting():
        return "TRITON_INTERPRET=1 runs Triton kernels on the CPU, which cannot address device memory; unset it"
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


def bind(ctx: BindContext) -> KernelCopyByIds:
    """The factory: bind the SM budget and launch shapes once, at resolve time, and on a
    GPU compile the kernel variants for ``PRECOMPILE_BLOCKS``.

    ``ctx.params`` may override the direction's default shape (``tile_elems``,
    ``row_max``, ``warps``, ``align_max``, ``prefetch``, ``cache``, ``host_tiles``), e.g.
    from a calibration, and ``precompile`` (block sizes in bytes; empty: none).
    """
    num_sms = ctx.params.get("num_sms", 8)
    # Host addresses are translated for the device; device addresses (both sides of d2d)
    # are used as they are.
    translate = None if ctx.translate_host is same_addresses else ctx.translate_host
    direction = ctx.direction
    fn = KernelCopyByIds(
        num_sms=int(num_sms),
        device_index=_device_index(ctx.device),
        tiles=TilePlan.from_params(ctx.params, DEFAULT_PLANS[str(direction)]),
        translate_src=translate if direction.src_is_host else None,
        translate_dst=translate if direction.dst_is_host else None,
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
        directions=(Direction.H2D, Direction.D2H, Direction.D2D),
        factory=bind,
        availability=availability,
        requires_pinned=True,
        by_ids=True,
        description="Triton kernel: one launch per batch on a bounded SM budget, several blocks per step",
    )
