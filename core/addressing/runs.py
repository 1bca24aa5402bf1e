"""A block's bytes on one side of a mover as contiguous runs: what a staged route moves
over the link, one descriptor per run and block.

A staged route gathers (or scatters) a block's pieces on the device into one slot of a
staging buffer, in the order the pieces have on the host side, so that every run of
pieces adjacent on the host is adjacent in the slot too and crosses the link whole. A
block-major host cache (:func:`kvswap.host_cache`) is one run per block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# Slots start on this boundary, so vector loads and stores stay aligned in the staging buffer.
SLOT_ALIGN = 16


@dataclass(frozen=True, eq=False)
class Runs:
    """Block ``i``'s host bytes: run ``r`` is ``size[r]`` bytes at ``base[r] + i * stride[r]``,
    and sits ``rel[r]`` bytes into a block's staging slot; piece ``p`` sits ``piece_rel[p]``
    bytes into it. A slot is ``slot_bytes`` (the block's bytes, rounded up to
    :data:`SLOT_ALIGN`)."""

    base: np.ndarray
    stride: np.ndarray
    size: np.ndarray
    rel: np.ndarray
    piece_rel: np.ndarray
    slot_bytes: int

    @property
    def count(self) -> int:
        return len(self.size)

    @property
    def smallest(self) -> int:
        """The shortest run: the link's smallest copy."""
        return int(self.size.min())


def host_runs(template: Any, host_is_src: bool) -> Runs:
    """The host side's pieces of ``template`` (a :class:`~kvswap.addressing.regions.DescriptorTemplate`
    or anything with its arrays) merged into runs: pieces that follow each other in host
    memory with one block stride."""
    base = np.asarray(template.src_base if host_is_src else template.dst_base, dtype=np.int64)
    stride = np.asarray(template.src_stride if host_is_src else template.dst_stride, dtype=np.int64)
    sizes = np.asarray(template.sizes, dtype=np.int64)
    order = np.lexsort((base, stride))  # by stride, then address
    b, s, z = base[order], stride[order], sizes[order]
    starts = np.ones(len(b), dtype=bool)
    starts[1:] = (b[:-1] + z[:-1] != b[1:]) | (s[:-1] != s[1:])
    first = np.flatnonzero(starts)
    run_size = np.add.reduceat(z, first)
    rel_sorted = np.concatenate(([0], np.cumsum(z)[:-1]))
    piece_rel = np.empty_like(rel_sorted)
    piece_rel[order] = rel_sorted
    slot = -(-int(z.sum()) // SLOT_ALIGN) * SLOT_ALIGN
    return Runs(b[first], s[first], run_size, rel_sorted[first], piece_rel, slot)
