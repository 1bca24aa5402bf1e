"""Compiled variants of the copy kernel, launched without Triton's per-call dispatch.

``kernel[grid](...)`` binds and specialises every argument, hashes a cache key, asks torch
for the current device and stream and checks the kernel's globals on each call: tens of
µs of host time, more than the GPU spends on a small batch. What changes the compiled
code is only what a :class:`~kvswap.backends.triton_generic.launch.Tile` fixes (the
constexprs and the warps; ``n`` and ``splits`` are not specialised, see jit.py), so a
:class:`Variants` compiles each tile shape once per device through Triton's ``warmup``
and calls its launcher directly with plain ints and the raw stream handle.

The direct call uses ``CompiledKernel.run`` / ``.function`` / ``.packed_metadata``, which
Triton 3.6 to 3.9 share. Where a Triton lacks them, :attr:`Variant.direct` is False and
the caller launches through ``kernel[grid](...)`` as before (slower, same result). Launch
hooks (profilers) are honoured: while any is set, the launch carries Triton's metadata.

Imported only from the launch path (it is light itself; Triton loads in the methods).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


def variant_key(tile: Any) -> tuple:
    """What selects a compiled variant: the kernel's constexprs and the warps."""
    return (tile.jobs, tile.words, tile.align, tile.prefetch, tile.cache, tile.warps)


def constexprs(tile: Any) -> dict[str, Any]:
    """The kernel's constexpr arguments for ``tile`` (by name, in the kernel's order)."""
    return dict(JOBS=tile.jobs, WORDS=tile.words, ALIGN=tile.align, PREFETCH=tile.prefetch, CACHE=tile.cache)


@dataclass(frozen=True)
class Variant:
    """One compiled variant on one device: ``run(gx, gy, gz, stream, function, metadata,
    launch_metadata, enter_hook, exit_hook, *args)`` when ``direct``."""

    compiled: Any
    run: Any = None
    function: Any = None
    metadata: Any = None

    @property
    def direct(self) -> bool:
        return self.run is not None


def direct_parts(compiled: Any) -> Optional[tuple[Any, Any, Any]]:
    """``(launcher, function, packed metadata)`` of a compiled kernel, or None where this
    Triton does not expose them (the caller then launches through the JIT path).

    Reading ``run`` loads the binary on the current device."""
    try:
        import triton.knobs  # noqa: F401  (the hooks live there from 3.4 on)

        run = compiled.run
        return run, compiled.function, compiled.packed_metadata
    except (AttributeError, ImportError):
        return None


def hook_is_set(hook: Any) -> bool:
    """Whether a launch hook does anything: Triton 3.6+ keeps a (possibly empty) chain."""
    return bool(getattr(hook, "calls", hook))


class Variants:
    """The compiled variants of the copy kernel on one device, by :func:`variant_key`."""

    def __init__(self, device_index: int) -> None:
        self.device_index = device_index
        self._by_key: dict[tuple, Variant] = {}
        self._runtime: Any = None

    def __contains__(self, tile: Any) -> bool:
        return variant_key(tile) in self._by_key

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, tile: Any) -> Variant:
        """The variant for ``tile``, compiled (and loaded on the device) on first use."""
        v = self._by_key.get(variant_key(tile))
        return v if v is not None else self._compile(tile)

    def _compile(self, tile: Any) -> Variant:
        import torch

        from .jit import copy_kernel

        with torch.cuda.device(self.device_index):
            # ``torch.int64`` stands for the descriptor pointer (a 16-byte aligned one,
            # which every buffer the launcher passes is); 0 and 1 only type ``n``/``splits``.
            compiled = copy_kernel.warmup(torch.int64, 0, 1, **constexprs(tile), num_warps=tile.warps, grid=(1,))
            parts = direct_parts(compiled) if compiled is not None else None
        v = Variant(compiled, *parts) if parts else Variant(compiled)
        if parts and self._runtime is None:
            from triton import knobs

            self._runtime = knobs.runtime
        self._by_key[variant_key(tile)] = v
        return v

    def launch(self, v: Variant, tile: Any, grid: int, desc: int, n: int, splits: int, stream: int) -> None:
        """Launch ``v`` (``direct``) on the raw ``stream`` handle; ``desc`` is the device-usable
        address of the packed descriptors. The caller makes ``device_index`` current."""
        args = (desc, n, splits, tile.jobs, tile.words, tile.align, tile.prefetch, tile.cache)
        rt = self._runtime
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        if hook_is_set(enter) or hook_is_set(leave):
            meta = v.compiled.launch_metadata((grid, 1, 1), stream, *args)
        else:
            # No hook: skip building the metadata and calling the empty chains.
            meta = enter = leave = None
        v.run(grid, 1, 1, stream, v.function, v.metadata, meta, enter, leave, *args)


_BY_DEVICE: dict[int, Variants] = {}


def variants(device_index: int) -> Variants:
    """The process's compiled variants for one device (shared by every bound callable)."""
    v = _BY_DEVICE.get(device_index)
    if v is None:
        v = _BY_DEVICE[device_index] = Variants(device_index)
    return v
