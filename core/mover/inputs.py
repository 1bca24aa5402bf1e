"""What a BlockMover accepts: its tensors' placement and memory kind, and each job's block ids.

Checked once when the mover is built (tensors) and once per job before anything is
enqueued (ids: integers, in range, paired one to one, each destination written once).
"""
from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import numpy as np

from ..addressing.descriptors import as_int64
from ..addressing.regions import DescriptorTemplate, pair_regions
from ..errors import BlockIdError, BlockLayoutError, InvalidTransferError, TensorPlacementError, UnpinnedMemoryError
from ..memory.bounce import Bouncer, PageableMemoryWarning, storage_spans
from ..resolution.swapfn import SwapFn
from ..types import Direction, Policy
from .types import BlockIds, KVGroup, Tensors



def tensor_list(tensors: Tensors, what: str, where: str = "") -> list:
    import torch

    try:
        items = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    except TypeError:
        raise BlockLayoutError(
            f"{where}{what} is a {type(tensors).__name__}; pass a tensor or a sequence of them"
        ) from None
    if not items:
        raise BlockLayoutError(f"{where}{what} is empty; pass at least one tensor")
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise BlockLayoutError(f"{where}{what}[{i}] is a {type(t).__name__}, not a torch.Tensor")
        if t.is_nested or t.layout != torch.strided:
            kind = "nested" if t.is_nested else str(t.layout)
            raise BlockLayoutError(
                f"{where}{what}[{i}] is a {kind} tensor; blocks are cut from dense (strided) tensors"
            )
    return items


def group_specs(groups: Any) -> list[KVGroup]:
    """:meth:`BlockMover.groups`' argument as one :class:`KVGroup` per group."""
    if isinstance(groups, KVGroup) or not isinstance(groups, Sequence) or not len(groups):
        raise BlockLayoutError(f"groups={groups!r} must be a non-empty list of KVGroup or (src, dst[, block_dim])")
    specs = []
    for g, spec in enumerate(groups):
        if isinstance(spec, KVGroup):
            specs.append(spec)
        elif isinstance(spec, tuple) and len(spec) in (2, 3):
            specs.append(KVGroup(*spec))
        else:
            raise BlockLayoutError(
                f"groups[{g}] is a {type(spec).__name__}; pass a KVGroup or a tuple (src_tensors, dst_tensors"
                f"[, block_dim])"
            )
    return specs


def paired_sides(specs: Sequence[Any], grouped: bool) -> list[tuple[list, list]]:
    """Per KV group (``KVGroup``): its source and destination tensors, as many of each."""
    sides = []
    for g, spec in enumerate(specs):
        where = f"groups[{g}]: " if grouped else ""
        src = tensor_list(spec.src_tensors, "src_tensors", where)
        dst = tensor_list(spec.dst_tensors, "dst_tensors", where)
        if len(src) != len(dst):
            raise BlockLayoutError(
                f"{where}src_tensors has {len(src)} tensor(s) but dst_tensors has {len(dst)}; "
                f"pass one destination per source"
            )
        sides.append((src, dst))
    return sides


def group_templates(sides: list[tuple[list, list]], block_dims: list[Any], grouped: bool) -> list[DescriptorTemplate]:
    """Per KV group, where its blocks live (:func:`pair_regions`); errors name the group."""
    templates = []
    for g, ((src, dst), block_dim) in enumerate(zip(sides, block_dims)):
        try:
            templates.append(pair_regions(src, dst, block_dim))
        except BlockLayoutError as e:
            if not grouped:
                raise
            raise BlockLayoutError(f"groups[{g}]: {e}") from None
    return templates


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


def bouncer_for(host: list, fn: SwapFn, direction: Direction, policy: Policy, on_device: bool,
                grouped: bool) -> Optional[Bouncer]:
    """Bounce buffers for the pageable ones among ``host`` where a route needs pinned
    memory (with a warning, once), or None; refused under ``Policy(require_pinned=True)``."""
    pinned_for = pinned_routes(fn, on_device=on_device)
    if not (on_device or pinned_for):
        return None  # asked first: is_pinned() needs the accelerator, which a forked child cannot use
    pageable = [i for i, t in enumerate(host) if not t.is_pinned()]
    if not pageable:
        return None
    if policy.require_pinned:
        refuse_pageable(host, pageable, direction, pinned_for, grouped)
    warnings.warn(PageableMemoryWarning(
        f"{len(pageable)} of the {len(host)} host tensor(s) of this {direction} mover are pageable: "
        f"their blocks go through pinned bounce buffers, a host memcpy of every byte on top of the "
        f"device copy; allocate host KV with pin_memory=True (or kvswap.host_empty) to avoid it"
    ), stacklevel=5)  # BlockMover's caller
    return Bouncer(storage_spans([host[i] for i in pageable]), 0 if direction.src_is_host else 1, pinned=on_device)


def refuse_pageable(host: list, pageable: list[int], direction: Direction, routes: list[str], grouped: bool) -> None:
    name = "src" if direction.src_is_host else "dst"
    which = f"host tensor {pageable[0]} (over all groups)" if grouped else f"{name}_tensors[{pageable[0]}]"
    need = f"the route(s) {', '.join(routes)} need" if routes else "a device reads it asynchronously only when it is"
    raise UnpinnedMemoryError(
        f"{which} is pageable host memory, but {need} pinned (page-locked) memory and the policy sets "
        f"require_pinned=True; allocate it with pin_memory=True, or drop require_pinned to carry it through bounce buffers (slower)"
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


# Up to this many ids, Python's builtins over a list check range and repeats: an engine's
# thread runs them all the time, while numpy's reductions and sort are cold there after the
# step's launches (32 ids on an H100 host: 50-75 us through numpy, 25-35 us this way).
SMALL_IDS = 256
# Beyond that, repeats are found by marking each destination block in a bitmap where the
# destination holds at most this many blocks per id (5,000 ids of 10,000 blocks: 18 us cold
# against 57 us for a sort), else by sorting: a few ids into a large pool would otherwise
# pay for zeroing and scanning a bitmap far larger than the ids.
BITMAP_BLOCKS_PER_ID = 32


def checked_groups(templates: list[DescriptorTemplate], src_block_ids: Any,
                   dst_block_ids: Any) -> list[BlockIds]:
    """A :meth:`BlockMover.groups` mover's ids: one id list per group on each side."""
    n = len(templates)
    for what, ids in (("src_block_ids", src_block_ids), ("dst_block_ids", dst_block_ids)):
        if isinstance(ids, (np.ndarray, str, bytes)) or not isinstance(ids, Sequence) or len(ids) != n:
            raise BlockIdError(
                f"{what} must be a list of {n} id lists, one per KV group, got {type(ids).__name__}"
                + (f" of {len(ids)}" if isinstance(ids, Sequence) else "")
            )
        for g, x in enumerate(ids):
            if isinstance(x, (int, np.integer)):
                raise BlockIdError(
                    f"{what}[{g}] is {x!r}, not a list of ids: a mover built by groups() takes one id "
                    f"list per KV group"
                )
    return [checked_pair(t, s, d, f"[{g}]")
            for g, (t, s, d) in enumerate(zip(templates, src_block_ids, dst_block_ids))]


def checked_pair(t: DescriptorTemplate, src_block_ids: Any, dst_block_ids: Any,
                 at: str) -> BlockIds:
    sid = block_ids(src_block_ids, "src_block_ids", at)
    did = block_ids(dst_block_ids, "dst_block_ids", at)
    n = len(sid)
    if n != len(did):
        raise BlockIdError(
            f"src_block_ids{at} has {n} ids but dst_block_ids{at} has {len(did)}; they pair up one to one"
        )
    if not n:
        return BlockIds(sid, did)
    if n <= SMALL_IDS:
        sl, dl = sid.tolist(), did.tolist()
        if not (min(sl) >= 0 and max(sl) < t.src_blocks and min(dl) >= 0 and max(dl) < t.dst_blocks):
            in_range(sid, f"src_block_ids{at}", t.src_blocks, "source")
            in_range(did, f"dst_block_ids{at}", t.dst_blocks, "destination")
        repeated = len(set(dl)) != n
    else:
        in_range(sid, f"src_block_ids{at}", t.src_blocks, "source")
        in_range(did, f"dst_block_ids{at}", t.dst_blocks, "destination")
        if t.dst_blocks <= BITMAP_BLOCKS_PER_ID * n:  # a mark per destination block: no sort
            seen = np.zeros(t.dst_blocks, dtype=np.bool_)
            seen[did] = True
            repeated = int(np.count_nonzero(seen)) != n
        else:
            s = np.sort(did)
            repeated = bool((s[1:] == s[:-1]).any())
    if repeated:
        _name_repeat(did, at)
    return BlockIds(sid, did)


def _name_repeat(did: np.ndarray, at: str) -> None:
    s = np.sort(did)
    v = s[1:][s[1:] == s[:-1]][0]
    i, j = np.flatnonzero(did == v)[:2]
    raise BlockIdError(
        f"dst_block_ids{at}[{i}] and dst_block_ids{at}[{j}] are both {int(v)}: a destination block "
        f"may be written once per job"
    )


def block_ids(ids: Any, what: str, at: str = "") -> np.ndarray:
    """``ids`` (named ``what`` + ``at`` in errors) as a 1-D C-contiguous int64 array."""
    # What engines pass (and the cheapest case to check): a 1-D C-contiguous int64 array.
    if type(ids) is np.ndarray and ids.ndim == 1:
        kind = ids.dtype.kind
        if kind == "i":  # int64 as it is; vLLM's int32 (and any narrower, or big-endian) converted in one copy
            return ids if ids.dtype == np.int64 and ids.flags.c_contiguous else ids.astype(np.int64)
        if kind == "u" and ids.dtype.itemsize < 8:
            return ids.astype(np.int64)
    try:
        return as_int64(ids, what + at)
    except InvalidTransferError as e:
        raise BlockIdError(str(e)) from None


def in_range(ids: np.ndarray, what: str, limit: int, side: str) -> None:
    # Negative ids read as uint64 are beyond any limit: one reduction checks both ends.
    if ids.view(np.uint64).max() >= limit:
        i = int(np.flatnonzero((ids < 0) | (ids >= limit))[0])
        raise BlockIdError(
            f"{what}[{i}]={int(ids[i])} is out of range: the {side} tensors hold {limit} blocks (0..{limit - 1})"
        )
