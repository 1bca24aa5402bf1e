"""kvswap backend ``triton``: the ``triton.kernel`` copy, for any GPU platform Triton runs on.

Its one hook registers ``triton.kernel`` and ``triton.staged``; where each part lives:

* :mod:`.kernel` — the implementation ``triton.kernel``: availability, the factory that
  binds the SM budget and launch shapes at resolve time;
* :mod:`.copy` — :func:`copy`, the public launcher: the same kernel as a plain function
  with an explicit SM budget, for callers that do not go through ``resolve()``;
* :mod:`.launch` — the bound callable (:class:`KernelCopy`) and the launch shapes
  (:class:`TilePlan`, :class:`Tile`); :mod:`.launch_buffers` and :mod:`.compiled` — its pinned
  descriptor buffers and directly launched compiled variants;
* :mod:`.jit` — the Triton kernel itself (it and :mod:`.by_ids_jit` are the modules that
  import Triton at the top);
* :mod:`.by_ids` — ``KernelCopyByIds.by_ids``: blocks copied by id, addresses derived on the
  device from a BlockMover's template (kernel in :mod:`.by_ids_jit`);
* :mod:`.staged` — the implementation ``triton.staged``: the same kernels gather or scatter
  between the scattered chunks and a device staging buffer, and the platform's batch route
  moves whole runs over the link.

Importing this package is cheap: Triton and torch.cuda load inside functions.
"""
from __future__ import annotations

from typing import Callable

from kvswap import hookimpl
from kvswap.registry.impl import CopyImpl

from .copy import copy
from .launch import HAS_TRITON, KernelCopy, Launch, Tile, TilePlan

__all__ = ["HAS_TRITON", "KernelCopy", "Launch", "Tile", "TilePlan", "copy", "kvswap_register_copy_impls"]


@hookimpl
def kvswap_register_copy_impls(platform: str, register: Callable[[CopyImpl], None]) -> None:
    from .kernel import copy_impl
    from .staged import staged_impl

    for impl in (copy_impl(), staged_impl()):
        if platform in impl.platforms:
            register(impl)
