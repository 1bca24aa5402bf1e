"""What a BlockMover takes and reports: KV groups, what an id moves in each, job results."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from ..addressing.regions import BlockDim

Tensors = Union[Any, Sequence[Any]]


@dataclass(frozen=True)
class TransferResult:
    """One finished job.

    :ivar bytes: bytes the job moved (block ids x bytes per block over all tensors).
    :ivar seconds: time on the transfer stream between the job's start event (recorded by
        ``submit``) and its end event (recorded once the copy was enqueued): a copy issued
        from the mover's issuing thread counts the thread's preparation too. On a
        host-only mover: wall time from ``submit`` to the copy's end.
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
