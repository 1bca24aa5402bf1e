"""What a BlockMover accepts: its tensors' placement and memory kind, and each job's block ids.

Checked once when the mover is built (tensors) and once per job before anything is
enqueued (ids: integers, in range, paired one to one, each destination written once).
"""
from __future__ import annotations

from typing import Any, Sequence, Union

import numpy as np

from .descriptors import as_int64
from .errors import BlockIdError, BlockLayoutError, InvalidTransferError, TensorPlacementError, UnpinnedMemoryError
from .regions import DescriptorTemplate
from .swapfn import SwapFn
from .types import Direction

Tensors = Union[Any, Sequence[Any]]


def tensor_list(tensors: Tensors, what: str, where: str = "") -> list:
    import torch

    items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not items:
        raise BlockLayoutError(f"{where}{what} is empty; pass at least one tensor")
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise BlockLayoutError(f"{where}{what}[{i}] is a {type(t).__name__}, not a torch.Tensor")
    return items


def device_side(src: list, dst: list, direction: Direction) -> Any:
    """The device of the non-host side(s); checks that the host side is on the host."""
    if direction is Direction.D2D:
        host, dev, host_name, dev_name, role = [], src + dst, "", "src_tensors and dst", ""
    else:
        host, dev = (src, dst) if direction.src_is_host else (dst, src)
        host_name, dev_name = ("src", "dst") if direction.src_is_host else ("dst", "src")
        role = "sources" if direction.src_is_host else "destinations"
    for i, t in enumerate(host):
        if t.device.type != "cpu":
            raise TensorPlacementError(
                f"{host_name}_tensors[{i}] is on {t.device}, but for direction {direction!s} the {role} "
                f"must be host (CPU) tensors"
            )
    devices = {t.device for t in dev}
    if len(devices) > 1:
        raise TensorPlacementError(
            f"{dev_name}_tensors are on {sorted(map(str, devices))}; a mover serves one device"
        )
    device = devices.pop()
    if device.type == "meta":
        raise TensorPlacementError(f"{dev_name}_tensors are meta tensors, which hold no memory")
    if device.type not in ("cpu", "cuda"):
        raise TensorPlacementError(
            f"{dev_name}_tensors are on {device}; BlockMover drives streams through torch.cuda (CUDA or ROCm)"
        )
    return device


def pinned_routes(fn: SwapFn, on_device: bool) -> list[str]:
    """The routes that may copy and need page-locked host memory.

    Every route's implementation and small-batch implementation count; so do the
    fallbacks (they take the descriptors a route's constraints refuse) when a device
    reads the host memory, since a kernel on pageable memory faults the device. A mover
    between host tensors has no device access, and on a CPU no memory can be pinned: there
    a fallback that declares the need (Triton's interpreter) does not impose it.
    """
    names = set()
    for r in fn.plan.routes:
        names.update(n for n in (r.impl, r.small_batch_impl) if n)
        if on_device:
            names.update(r.fallbacks)
    need = {c.name for c in fn.plan.candidates if c.constraints.get("requires_pinned")}
    return sorted(names & need)


def refuse_pageable(host: list, pageable: list[int], direction: Direction, routes: list[str], grouped: bool) -> None:
    name = "src" if direction.src_is_host else "dst"
    which = f"host tensor {pageable[0]} (over all groups)" if grouped else f"{name}_tensors[{pageable[0]}]"
    need = f"the route(s) {', '.join(routes)} need" if routes else "a device reads it asynchronously only when it is"
    raise UnpinnedMemoryError(
        f"{which} is pageable host memory, but {need} pinned (page-locked) memory and the policy sets "
        f"require_pinned=True; allocate it with pin_memory=True, or drop require_pinned to stage it (slower)"
    )


def groups_share_destinations(sides: list[tuple[list, list]]) -> bool:
    """Whether two groups' destination tensors share storage (then a job's destinations
    are checked across groups)."""
    seen: dict[int, int] = {}
    for g, (_, dst) in enumerate(sides):
        for t in dst:
            key = t.untyped_storage().data_ptr() if t.device.type != "meta" else id(t)
            if seen.setdefault(key, g) != g:
                return True
    return False


def checked_pair(t: DescriptorTemplate, src_block_ids: Any, dst_block_ids: Any,
                  at: str) -> tuple[np.ndarray, np.ndarray]:
    sid = block_ids(src_block_ids, f"src_block_ids{at}")
    did = block_ids(dst_block_ids, f"dst_block_ids{at}")
    if len(sid) != len(did):
        raise BlockIdError(
            f"src_block_ids{at} has {len(sid)} ids but dst_block_ids{at} has {len(did)}; they pair up one to one"
        )
    if len(sid):
        in_range(sid, f"src_block_ids{at}", t.src_blocks, "source")
        in_range(did, f"dst_block_ids{at}", t.dst_blocks, "destination")
        if len(did) > 1:
            s = np.sort(did)
            rep = s[1:] == s[:-1]
            if rep.any():
                v = s[1:][rep][0]
                i, j = np.flatnonzero(did == v)[:2]
                raise BlockIdError(
                    f"dst_block_ids{at}[{i}] and dst_block_ids{at}[{j}] are both {int(v)}: a destination block "
                    f"may be written once per job"
                )
    return sid, did


def block_ids(ids: Any, what: str) -> np.ndarray:
    try:
        return as_int64(ids, what)
    except InvalidTransferError as e:
        raise BlockIdError(str(e)) from None


def in_range(ids: np.ndarray, what: str, limit: int, side: str) -> None:
    if ids.min() < 0 or ids.max() >= limit:
        i = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise BlockIdError(
            f"{what}[{i}]={int(ids[i])} is out of range: the {side} tensors hold {limit} blocks (0..{limit - 1})"
        )
