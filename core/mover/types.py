"""What a BlockMover takes and reports: KV groups, what an id moves in each, job results."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np

from ..addressing.regions import BlockDim

Tensors = Union[Any, Sequence[Any]]


class BlockIds(NamedTuple):
    """One KV group's checked ids of a job: 1-D int64, paired one to one."""

    src: np.ndarray
    dst: np.ndarray


@dataclass(frozen=True)
class TransferResult:
    """One finished job.

    :ivar bytes: bytes the job moved (block ids x bytes per block over all tensors).
    :ivar seconds: time on the transfer stream between the job's start event (recorded once
        its addresses were ready, right before the copy was enqueued) and its end event
        (recorded after it): the device's time, the host's preparation left out. On a
        host-only mover: wall time of the copy.
    :ivar descriptors: descriptors after coalescing, as the copy route received them.
    :ivar error: why the copy call raised, when ``ok`` is False.
    """

    job_id: int
    ok: bool
    bytes: int
    seconds: float
    descriptors: int
    error: Optional[str] = None


@dataclass(frozen=True)
class KVGroup:
    """One KV group of a :meth:`BlockMover.groups` mover: its tensors and block dims.

    Arguments as :class:`BlockMover`'s ``src_tensors``, ``dst_tensors`` and ``block_dim``.
    Each group has its own block ids (its own block pool, block size and layout).
    """

    src_tensors: Tensors
    dst_tensors: Tensors
    block_dim: BlockDim = 0


@dataclass(frozen=True)
class GroupLayout:
    """What one block id moves in one KV group.

    :ivar factor: k where one side's blocks are k of the other side's (ids count the
        smaller block), else 1.
    """

    block_bytes: int
    chunks_per_block: int
    num_src_blocks: int
    num_dst_blocks: int
    factor: int
