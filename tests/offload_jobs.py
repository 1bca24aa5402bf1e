"""Stand-ins for what vLLM hands an offloading worker, and a reference of what a job moves.

The stand-ins carry the fields vLLM 0.32 passes (``vllm/v1/kv_offload/base.py``) and
nothing else: ``GPULoadStoreSpec`` (``block_ids``, ``group_sizes``, ``block_indices``),
``CPULoadStoreSpec`` (``block_ids``: chunk ids), and ``CanonicalKVCaches`` (int8
``(num_blocks, page_size_bytes)`` tensors, and per group references naming a tensor and
the un-padded page of a layer). The reference computes, element by element, which host
block each device block goes to, and what every byte of both sides must hold afterwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np


@dataclass
class DeviceSpec:
    block_ids: np.ndarray
    group_sizes: list[int]
    block_indices: list[int]


@dataclass
class HostSpec:
    block_ids: np.ndarray


@dataclass
class CanonicalTensor:
    tensor: Any
    page_size_bytes: int


@dataclass
class Ref:
    tensor_idx: int
    page_size_bytes: int


@dataclass
class CanonicalCaches:
    tensors: list[CanonicalTensor]
    group_data_refs: list[list[Ref]]


@dataclass
class Job:
    device: DeviceSpec
    host: HostSpec
    pairs: list[list[tuple[int, int]]]  # per group: (device block, host block), from the reference


def reference_host_ids(chunk_ids: Sequence[int], group_sizes: Sequence[int], block_indices: Sequence[int],
                       k: int) -> list[list[int]]:
    """Host block of every device block, one logical position at a time: position ``p`` of
    a group lies in the group's chunk ``(p - first) // k``, where ``first`` is the first
    position of the chunk holding the group's first block, at sub-block ``p % k``."""
    out, at = [], 0
    for size, start in zip(group_sizes, block_indices):
        first = start - start % k
        out.append([int(chunk_ids[at + (p - first) // k]) * k + p % k for p in range(start, start + size)])
        if size:
            at += (start + size - 1 - first) // k + 1
    assert at == len(chunk_ids)
    return out


def random_job(rng: np.random.Generator, device_free: list[int], host_chunks_free: list[int], k: int,
               groups: int, max_blocks: int, partial: bool = True) -> Job:
    """A job of up to ``max_blocks`` device blocks per group, taking its device blocks and
    chunks out of the free lists (so jobs in flight never share a block). With
    ``partial``, a group may start inside its first chunk and end inside its last."""
    sizes, starts, dev, chunks = [], [], [], []
    for _ in range(groups):
        n = int(rng.integers(0 if groups > 1 else 1, max_blocks + 1))
        start = int(rng.integers(0, 40)) if partial else k * int(rng.integers(0, 10))
        n_chunks = -(-(n + start % k) // k) if n else 0
        sizes.append(n)
        starts.append(start)
        dev += [device_free.pop(int(rng.integers(len(device_free)))) for _ in range(n)]
        chunks += [host_chunks_free.pop(int(rng.integers(len(host_chunks_free)))) for _ in range(n_chunks)]
    host = reference_host_ids(chunks, sizes, starts, k)
    bounds = np.cumsum([0] + sizes)
    pairs = [list(zip(dev[bounds[g]:bounds[g + 1]], host[g])) for g in range(groups)]
    return Job(DeviceSpec(np.array(dev, dtype=np.int32), sizes, starts), HostSpec(np.array(chunks, dtype=np.int32)),
               pairs)


def expected_host(buffer: Any, offsets: Sequence[int], widths: Sequence[int], tensors: Sequence[Any],
                  groups: Sequence[Sequence[int]], job: Job) -> Any:
    """The host buffer after storing ``job``: a copy of ``buffer`` with, for every tensor of
    each group and every (device, host) pair, the device page's un-padded bytes at that
    tensor's offset in the host block."""
    import torch

    out = buffer.clone()
    for members, pairs in zip(groups, job.pairs):
        for i in members:
            src = tensors[i].view(torch.uint8)
            for d, h in pairs:
                out[h, offsets[i]:offsets[i] + widths[i]] = src[d, :widths[i]]
    return out


def expected_device(tensors: Sequence[Any], buffer: Any, offsets: Sequence[int], widths: Sequence[int],
                    groups: Sequence[Sequence[int]], job: Job) -> list:
    """Every device tensor after loading ``job``: copies with the host bytes in place of
    each loaded page's un-padded bytes; padding and every other block as they were."""
    import torch

    out = [t.clone() for t in tensors]
    for members, pairs in zip(groups, job.pairs):
        for i in members:
            dst = out[i].view(torch.uint8)
            for d, h in pairs:
                dst[d, :widths[i]] = buffer[h, offsets[i]:offsets[i] + widths[i]]
    return out
