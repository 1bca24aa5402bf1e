"""What a BlockMover job's checked block ids become on the descriptor path: coalesced
descriptors in a pooled buffer.

This is the work that grows with layers x blocks; a device mover does it on its issuing
thread (:mod:`kvswap.mover.issuing`), off the engine's thread.
"""
from __future__ import annotations

from typing import NamedTuple

from ..addressing.descriptors import first_overlap, merge_runs, validate
from ..addressing.regions import DescriptorTemplate
from ..errors import BlockIdError, InvalidTransferError
from ..memory.pinned_pool import DescriptorBuffer, DescriptorPool
from .types import BlockIds



class Built(NamedTuple):
    """A job's coalesced descriptors: ``buffer.array[:, :count]`` (sources, destinations,
    sizes); the buffer is the job's until its end marker has completed."""

    buffer: DescriptorBuffer
    count: int


class JobDescriptors:
    """Builds a job's descriptors from its checked ids, per the mover's templates.

    :param check_across: destinations of different groups may share tensors: check them
        against each other (raises :class:`BlockIdError` on a clash).
    :param check_all: the two sides may share memory (:func:`~kvswap.addressing.regions.jobs_overlap`):
        check every job's descriptors as a SwapFn checks a batch (raises :class:`BlockIdError`).
    """

    def __init__(self, templates: list[DescriptorTemplate], pool: DescriptorPool, check_across: bool,
                 check_all: bool = False) -> None:
        self.templates, self.pool, self.check_across, self.check_all = templates, pool, check_across, check_all

    @property
    def checks(self) -> bool:
        """Whether building a job's descriptors may refuse it (:class:`BlockIdError`)."""
        return self.check_across or self.check_all

    def build(self, ids: list[BlockIds]) -> Built:
        """The job's coalesced descriptors, checked as the mover asks (:attr:`checks`)."""
        counts = [len(s) * t.count for (s, _), t in zip(ids, self.templates)]
        buf = self.pool.acquire(sum(counts))
        arr = buf.array
        m = 0
        for (sid, did), t in zip(ids, self.templates):
            if len(sid):
                m += t.fill(sid, did, arr[:, m:])
        s, d, z = arr[0, :m], arr[1, :m], arr[2, :m]
        if self.check_across and m:
            clash = first_overlap(d, z)
            if clash is not None:
                self.pool.release(buf)
                raise BlockIdError(
                    "two KV groups write the same destination bytes in this job (groups that share tensors "
                    "must use distinct blocks)"
                )
        if self.check_all and m:
            try:
                validate(s, d, z)
            except InvalidTransferError as e:
                self.pool.release(buf)
                raise BlockIdError(
                    f"this job's blocks overlap in memory ({e}); the mover's tensors share memory, so a job "
                    f"must not write a block it reads, nor write one byte twice"
                ) from None
        cs, cd, cz = merge_runs(s, d, z)
        if cz is not z:  # merged: the shorter arrays go back into the pinned buffer
            m = len(cz)
            arr[0, :m], arr[1, :m], arr[2, :m] = cs, cd, cz
        return Built(buf, m)
