"""What a BlockMover decides once, when it is built: how each of its jobs is issued.

A :class:`Plan` holds everything a job does not depend on: the resolved route (a
:class:`~kvswap.SwapFn`), whether a job sends block ids to a transfer that derives the
addresses on the device (:class:`IdSteps`) or descriptors, where jobs are issued (the
mover's issuing thread or the caller's), and the parts a job uses: its descriptor builder,
the completion (stream and markers) and, for pageable host memory, the bounce buffers.
:func:`kvswap.mover.run.run` reads it per job; nothing in it changes after the build.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

from ..addressing.regions import DescriptorTemplate
from ..errors import AllocationError
from ..memory.bounce import Bouncer
from ..registry.impl import ByIdsFn
from ..resolution.swapfn import SwapFn
from .descriptors import JobDescriptors
from .types import BlockIds

# A launch in submit holds the engine's thread 50-100 us longer than a handoff to the
# issuing thread (measured cold, beside queued GEMMs, on an H100); submit's budget of
# 100 us + 10 ns per descriptor covers that from about this many descriptors on.
LAUNCH_HERE_FROM = 8192


class IdSteps(NamedTuple):
    """Where a one-group job goes by id, by its descriptor count: ``fns[i]`` (of the
    implementation ``names[i]``) for the last ``starts[i] <= count``; ``fns[i]`` is None
    where that step takes descriptors."""

    starts: tuple[int, ...]
    fns: tuple[Optional[ByIdsFn], ...]
    names: tuple[str, ...]

    def at(self, count: int) -> tuple[Optional[ByIdsFn], str]:
        i = bisect_right(self.starts, count) - 1
        return self.fns[i], self.names[i]


def bind_ids(fn: SwapFn, template: DescriptorTemplate) -> Optional[IdSteps]:
    """The by-id steps of the route that takes this template's batches whole: each step's
    transfer bound to the template where its implementation declares
    :attr:`~kvswap.CopyImpl.by_ids` (the template goes to the device here, once); None where
    no step offers one."""
    sizes = template.chunk_sizes
    steps = fn.whole_batch_steps(sizes[0], sizes[-1])
    if steps is None:
        return None
    bound: dict[int, Optional[ByIdsFn]] = {}
    for f, impl in zip(steps.fns, steps.impls):
        if f is not None and impl.by_ids and id(f) not in bound:
            try:
                b = f.by_ids(template)
                bound[id(f)] = b if isinstance(b, ByIdsFn) else None
            except AllocationError:  # out of memory: the mover cannot be built as asked
                raise
            except Exception:  # the descriptor path serves instead
                bound[id(f)] = None
    fns = tuple(bound.get(id(f)) for f in steps.fns)
    if all(b is None for b in fns):
        return None
    return IdSteps(steps.starts, fns, tuple(impl.name for impl in steps.impls))


@dataclass(eq=False)
class Plan:
    """How a mover's jobs are issued, decided and bound at build time.

    :ivar fn: the resolved route; descriptor jobs call it.
    :ivar descriptors: builds a job's descriptors (templates, pool, per-job checks).
    :ivar completion: the transfer stream and its markers (or the host's).
    :ivar ids: where a one-group job sends only its block ids, by size; None: descriptors.
    :ivar bounce: bounce buffers for pageable host memory, or None.
    :ivar threaded: jobs go to the mover's issuing thread (else the caller's).
    :ivar here_from: descriptors from which a threaded by-id job whose call is only
        launches is issued in ``submit`` while the thread holds no earlier job; None: never.
    :ivar grouped: built by :meth:`BlockMover.groups` (ids come one list per group).
    :ivar notes: what ``explain()`` adds to the route's own decision trace.
    :ivar templates: where every block lives, per KV group (the descriptors' templates).
    :ivar checks: building a job's descriptors may refuse it: they are built in ``submit``,
        before anything is enqueued.
    """

    fn: SwapFn
    descriptors: JobDescriptors
    completion: Any
    ids: Optional[IdSteps]
    bounce: Optional[Bouncer]
    threaded: bool
    here_from: Optional[int]
    grouped: bool
    notes: tuple[str, ...] = ()
    templates: list[DescriptorTemplate] = field(init=False)
    checks: bool = field(init=False)

    def __post_init__(self) -> None:
        self.templates = self.descriptors.templates
        self.checks = self.descriptors.checks

    def by_ids(self, ids: list[BlockIds]) -> tuple[Optional[ByIdsFn], str]:
        """The by-id transfer a job of these checked ids takes whole and its implementation's
        name, or ``(None, "")`` (descriptors)."""
        steps = self.ids
        n = len(ids[0].src)
        if steps is None or not n:
            return None, ""
        return steps.at(n * self.templates[0].count)

    def issues_here(self, ids: list[BlockIds], thread_idle: bool) -> bool:
        """Whether a job of these ids is issued on the caller's thread on a threaded mover
        that may launch in ``submit``: a by-id job of :attr:`here_from` descriptors or more
        whose call is only launches, while the thread holds no earlier job (the stream sees
        jobs in submission order)."""
        if self.here_from is None or not thread_idle:
            return False
        n = len(ids[0].src)
        if n * self.templates[0].count < self.here_from:
            return False
        fn, _ = self.by_ids(ids)
        return fn is not None and fn.launch_only(n)
