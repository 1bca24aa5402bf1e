"""What a BlockMover job's checked block ids become: coalesced descriptors in a pooled
buffer, or the ids themselves for a route that derives addresses on the device.

This is the work that grows with layers x blocks; a device mover does it on its issuing
thread (:mod:`kvswap.mover.issuing`), off the engine's thread.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Any, Optional

import numpy as np

from ..addressing.descriptors import first_overlap, merge_runs, validate
from ..addressing.regions import DescriptorTemplate
from ..errors import AllocationError, BlockIdError, InvalidTransferError
from ..memory.pinned_pool import DescriptorBuffer, DescriptorPool
from ..registry.failures import copy_failure
from ..resolution.swapfn import SwapFn

Ids = list  # [(src ids, dst ids)] per KV group, int64, checked


class JobDescriptors:
    """Builds a job's descriptors from its checked ids, per the mover's templates.

    :param check_across: destinations of different groups may share tensors: check them
        against each other (raises :class:`BlockIdError` on a clash).
    :param ids_steps: :func:`by_ids_steps` of the route, or None (descriptors only).
    :param check_all: the two sides may share memory (:func:`~kvswap.addressing.regions.jobs_overlap`):
        check every job's descriptors as a SwapFn checks a batch (raises :class:`BlockIdError`).
    """

    def __init__(self, templates: list[DescriptorTemplate], pool: DescriptorPool, check_across: bool,
                 ids_steps: Optional[tuple], check_all: bool = False) -> None:
        self.templates, self.pool, self.check_across, self.ids_steps = templates, pool, check_across, ids_steps
        self.check_all = check_all

    def build(self, ids: Ids) -> tuple[DescriptorBuffer, int]:
        """``(buffer, m)``: the coalesced descriptors in ``buffer.array[:, :m]``."""
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
        return buf, m

    def by_ids(self, ids: Ids) -> Any:
        """The by-id transfer a one-group batch of these ids takes whole, or None."""
        steps = self.ids_steps
        if steps is None or not len(ids[0][0]):
            return None
        return steps[1][bisect_right(steps[0], len(ids[0][0]) * self.templates[0].count) - 1]

    def failed(self, e: Exception, ids: Ids) -> Exception:
        """What a caller gets where the by-id transfer of these ids raised ``e``
        (:func:`~kvswap.registry.failures.copy_failure`, naming its implementation)."""
        steps = self.ids_steps
        name = steps[2][bisect_right(steps[0], len(ids[0][0]) * self.templates[0].count) - 1]
        return copy_failure(e, name)

    def ids_buffer(self, ids: Ids) -> tuple[DescriptorBuffer, int]:
        """The ids in a pooled buffer (rows 0 and 1), and the descriptors they stand for."""
        (sid, did), = ids
        n = len(sid)
        buf = self.pool.acquire(n)
        buf.array[0, :n], buf.array[1, :n] = sid, did
        return buf, n * self.templates[0].count


def by_ids_steps(fn: SwapFn, template: DescriptorTemplate) -> Optional[tuple[tuple[int, ...], tuple, tuple]]:
    """``(starts, by_ids, names)``: per step of the route that takes this template's batches
    whole (by descriptor count), the transfer's by-id capability bound to the template (the
    template goes to the device here, once), or None, and its implementation's name; None
    where no step offers one."""
    sizes = template.chunk_sizes
    steps = fn.whole_batch_steps(sizes[0], sizes[-1])
    if steps is None:
        return None
    bound: dict[int, Any] = {}
    for f in steps[1]:
        if f is not None and id(f) not in bound:
            try:
                make = getattr(f, "by_ids", None)
                bound[id(f)] = make(template) if callable(make) else None
            except AllocationError:  # out of memory: the mover cannot be built as asked
                raise
            except Exception:  # the descriptor path serves instead
                bound[id(f)] = None
    out = tuple(None if f is None else bound[id(f)] for f in steps[1])
    return (steps[0], out, steps[2]) if any(b is not None for b in out) else None


def stage_ids(by_ids: Any, src_ids: np.ndarray, dst_ids: np.ndarray) -> Any:
    """``by_ids``'s call in two halves where it offers ``stage`` (:class:`kvswap.registry.impl.ByIdsFn`):
    the ids staged now, and the returned ``launch(stream)`` that enqueues (``cancel()``
    where it never will); without ``stage``, the whole call is left to ``launch``."""
    stage = getattr(by_ids, "stage", None)
    return stage(src_ids, dst_ids) if callable(stage) else _WholeCall(by_ids, src_ids, dst_ids)


class _WholeCall:
    __slots__ = ("fn", "src", "dst")

    def __init__(self, fn: Any, src: np.ndarray, dst: np.ndarray) -> None:
        self.fn, self.src, self.dst = fn, src, dst

    def __call__(self, stream: Any) -> Any:
        return self.fn(self.src, self.dst, stream)

    def cancel(self) -> None:
        pass
