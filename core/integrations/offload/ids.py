"""From an offloading job's block lists to the block ids a mover takes, per KV group.

The device side names device blocks, one id each, grouped by KV group (``group_sizes``).
The host side names chunks of ``blocks_per_chunk`` device blocks, chunk ``c`` holding host
blocks ``c * k .. c * k + k - 1``. A group's run of device blocks starts at logical block
``block_indices[g]`` of its request, so when that is not a multiple of ``k`` the run starts
inside its first chunk (the blocks before it are already stored), and it may end inside
its last. This is the job format of vLLM's ``GPULoadStoreSpec`` and ``CPULoadStoreSpec``
(``vllm/v1/kv_offload/base.py``), read from their fields only.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ... import BlockIdError


def _int_list(values: Any, what: str) -> list[int]:
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError):
        raise BlockIdError(f"{what}={values!r} must be a sequence of integers") from None
    if any(v < 0 for v in out):
        raise BlockIdError(f"{what}={out!r} holds a negative number")
    return out


def _ids(values: Any, what: str) -> np.ndarray:
    a = values if isinstance(values, np.ndarray) else np.asarray(values)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise BlockIdError(f"{what} must be a 1-D sequence of integers, not {a.dtype} of shape {a.shape}")
    return a


def host_block_ids(chunk_ids: Any, group_sizes: Sequence[int], block_indices: Sequence[int],
                   blocks_per_chunk: int) -> list[np.ndarray]:
    """The host block ids of each group's device blocks, in order.

    :param chunk_ids: the chunks of every group, group after group (each group's chunks
        cover its blocks, from the chunk holding its first block to the one holding its last).
    :param group_sizes: device blocks per group.
    :param block_indices: per group, the logical index (within its request) of the group's
        first device block: its offset inside the first chunk is this modulo ``blocks_per_chunk``.
    :param blocks_per_chunk: device blocks per chunk (``k``).
    :raises BlockIdError: the lists disagree in length, or the chunks do not cover the groups.
    """
    chunks = _ids(chunk_ids, "chunk ids")
    sizes = _int_list(group_sizes, "group_sizes")
    starts = _int_list(block_indices, "block_indices")
    if len(sizes) != len(starts):
        raise BlockIdError(f"group_sizes has {len(sizes)} groups but block_indices has {len(starts)}")
    k = blocks_per_chunk
    out, at = [], 0
    for g, (size, start) in enumerate(zip(sizes, starts)):
        skip = start % k
        n = -(-(size + skip) // k) if size else 0
        if at + n > len(chunks):
            raise BlockIdError(f"group {g} needs chunks {at}..{at + n - 1} ({size} blocks from logical block "
                               f"{start}, {k} per chunk) but the job names {len(chunks)} chunks")
        mine = chunks[at:at + n]
        at += n
        if k == 1:
            out.append(mine)
        else:
            out.append((mine.astype(np.int64)[:, None] * k + np.arange(k)).ravel()[skip:skip + size])
    if at != len(chunks):
        raise BlockIdError(f"the job names {len(chunks)} chunks but its groups cover {at} "
                           f"(group_sizes={sizes}, block_indices={starts}, {k} blocks per chunk)")
    return out


def device_block_ids(block_ids: Any, group_sizes: Sequence[int]) -> list[np.ndarray]:
    """``block_ids`` cut into one array per group.

    :raises BlockIdError: ``group_sizes`` does not add up to the number of ids.
    """
    ids = _ids(block_ids, "device block ids")
    sizes = _int_list(group_sizes, "group_sizes")
    if sum(sizes) != len(ids):
        raise BlockIdError(f"group_sizes={sizes} add up to {sum(sizes)} but the job names {len(ids)} device blocks")
    out, at = [], 0
    for size in sizes:
        out.append(ids[at:at + size])
        at += size
    return out


def job_block_ids(device_spec: Any, host_spec: Any, blocks_per_chunk: int,
                  num_groups: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``(device ids per group, host ids per group)`` for one job.

    :param device_spec: an object with ``block_ids``, ``group_sizes`` and ``block_indices``.
    :param host_spec: an object with ``block_ids`` (chunk ids).
    :raises BlockIdError: the job does not fit ``num_groups`` groups, or its lists disagree.
    """
    sizes = list(device_spec.group_sizes)
    if len(sizes) != num_groups:
        raise BlockIdError(f"the job has {len(sizes)} KV groups (group_sizes={sizes}); this worker moves {num_groups}")
    device = device_block_ids(device_spec.block_ids, sizes)
    host = host_block_ids(host_spec.block_ids, sizes, device_spec.block_indices, blocks_per_chunk)
    return device, host
