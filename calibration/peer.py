"""The bench's peer on a CUDA device: vLLM's policy as vLLM PR 42212 ships it.

Host to device, blocks under 28 KiB in calls of 16 descriptors or more: a Triton copy kernel
on 12 SMs whose address tensors are built from numpy and uploaded with
``.to("cuda", non_blocking=True)`` on every call, launched through Triton's launcher.
Otherwise one ``cuMemcpyBatchAsync`` call, with no check of the batch. The kernel is kvswap's
own (:mod:`kvswap.backends.triton_generic.jit`): what the policy is measured by here is what
it costs per call, the upload and the launch as it ships them, against the same copy.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from kvswap import Direction, Policy, resolve
from kvswap.registry.plugins import PluginHost
from kvswap.types import DeviceInfo

from .binding import bound_at

KiB = 1024
PEER_KERNEL, PEER_BATCH = "triton.kernel", "cuda.batch"
PEER_SMS, PEER_MAX_BLOCK, PEER_MIN_BATCH = 12, 28 * KiB, 16
SHIPPED = ("as vLLM PR 42212 ships it: the kernel's address tensors built from numpy and uploaded by "
           "`.to(device, non_blocking=True)` on every call, the batch route one unchecked driver call")


def peer_route(direction: str, block_bytes: int, batch: int) -> tuple[str, Optional[int]]:
    """The impl (and SM count) vLLM's policy uses at this point."""
    if direction == "h2d" and block_bytes < PEER_MAX_BLOCK and batch >= PEER_MIN_BATCH:
        return PEER_KERNEL, PEER_SMS
    return PEER_BATCH, None


class UploadingKernel:
    """``fn(src, dst, sizes, stream=None)``: the Triton copy kernel on ``num_sms`` SMs, its
    descriptors packed by numpy and uploaded by torch per call, on ``stream``'s device (or,
    with ``device_index`` None, read from host memory by Triton's interpreter)."""

    def __init__(self, direction: Direction, device_index: Optional[int], num_sms: int = PEER_SMS) -> None:
        import torch

        from kvswap.backends.triton_generic.compiled import constexprs
        from kvswap.backends.triton_generic.jit import copy_kernel
        from kvswap.backends.triton_generic.launch import DEFAULT_PLANS, batch_alignment

        self.torch, self.kernel, self.constexprs, self.alignment = torch, copy_kernel, constexprs, batch_alignment
        self.tiles = DEFAULT_PLANS[str(direction)]
        self.num_sms = num_sms
        self.device = None if device_index is None else f"cuda:{device_index}"

    def __call__(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any = None) -> None:
        n = len(sizes)
        packed = np.concatenate((src, dst, sizes))
        tile = self.tiles.pick(n, int(sizes.sum()), self.num_sms, self.alignment(packed))
        grid = min(self.num_sms, -(-n // tile.jobs) * tile.splits)
        torch = self.torch
        if self.device is None:
            self.kernel[(grid,)](torch.from_numpy(packed), n, tile.splits, **self.constexprs(tile),
                                 num_warps=tile.warps)
            return
        with torch.cuda.stream(stream if stream is not None else torch.cuda.current_stream(self.device)):
            desc = torch.from_numpy(packed).to(self.device, non_blocking=True)
            self.kernel[(grid,)](desc, n, tile.splits, **self.constexprs(tile), num_warps=tile.warps)


def shipped(direction: str, dev: DeviceInfo, device: Any, host: Optional[PluginHost],
            block_sizes: Sequence[int]) -> Optional[Callable[[int, int], Any]]:
    """``peer(block_bytes, batch)``: the copy vLLM's policy makes there, as shipped; None
    where it cannot run here (not a CUDA device, or without both of its routes)."""
    if dev.platform != "cuda":
        return None
    try:
        kernel = UploadingKernel(Direction.parse(direction), dev.index or 0)
        batch = resolve(direction, device=device, host=host, policy=Policy(force=PEER_BATCH))
    except Exception:
        return None
    bound = {}
    for b in block_sizes:
        steps = batch.whole_batch_steps(b, b)
        fn = steps.fns[0] if steps is not None else None
        if fn is None:
            return None
        bound[b] = fn  # the bound driver call itself, as the policy makes it

    def peer(block_bytes: int, n: int) -> Any:
        return kernel if peer_route(direction, block_bytes, n)[0] == PEER_KERNEL else bound[block_bytes]

    return peer


def on_routes(direction: str, dev: DeviceInfo, device: Any, host: Optional[PluginHost],
              forced: set) -> Optional[Callable[[int, int], Any]]:
    """``peer(block_bytes, batch)``: vLLM's policy on kvswap's own routes (where it cannot
    run as shipped: a modelled device, say); None without both of its routes."""
    if not {PEER_KERNEL, PEER_BATCH} <= forced:
        return None
    # Its own functions, as a peer engine would hold: never a candidate's object.
    kernel = bound_at(direction, dev, device, host, PEER_KERNEL, PEER_SMS)
    batch = resolve(direction, device=device, host=host, policy=Policy(force=PEER_BATCH))
    return lambda block_bytes, n: kernel if peer_route(direction, block_bytes, n)[0] == PEER_KERNEL else batch
