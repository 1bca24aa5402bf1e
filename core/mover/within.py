"""Which copy function a BlockMover job with ``within`` seconds beside the engine's compute
takes: the mover's, or that of a route that takes no SMs where it is predicted to end the
step sooner (:meth:`kvswap.SwapFn.quieter`); for a mover whose host side suits the staged
route, the one of the staged route, the kernel and the batch route predicted to end the
step soonest (:class:`StagedRanking`).

It holds no reference to the mover, so the mover's issuing thread can decide for the jobs
handed to it, off the engine's thread; ``submit`` decides only for a job it may launch.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional

from ..addressing.regions import DescriptorTemplate
from ..errors import ConfigurationError
from ..resolution.resolver import resolve
from ..resolution.routing import step_cost
from ..resolution.swapfn import SwapFn
from ..types import Direction, Policy
from .staged import seconds


# A route that slows the compute more than the mover's own must be predicted to end the step
# this much sooner before a job leaves its own for it: the prediction leaves out how much
# the copy itself slows beside compute, which grows with the SMs it takes (on an H200, a
# 2.7 GB load into block-major blocks predicted 2% quicker on a 4-SM kernel took 58 ms
# beside GEMMs, the mover's staged route 51; docs/design.md).
SWITCH_MARGIN = 0.05


def check_within(within: Any) -> None:
    """Refuse a ``within`` that is no number of seconds >= 0."""
    # A float or an int skips the abstract-class check, slow on a cold thread.
    if (type(within) not in (float, int) and (isinstance(within, bool) or not isinstance(within, numbers.Real))
            or not within >= 0):
        raise ConfigurationError(f"within={within!r} must be a number of seconds >= 0, or None")


class QuietChoice:
    """``choice(n, within)``: the function of the route that takes no SMs for a job of ``n``
    ids, or None (the mover's own). Applies to movers of one template with one chunk size;
    for others it always answers None.

    :param bind: resolve the quiet routes and predict their costs now (a device mover, so
        that an engine's step pays a few float operations), not on first use.
    """

    def __init__(self, fn: SwapFn, direction: Direction, policy: Policy, resolve_args: dict[str, Any],
                 templates: list[DescriptorTemplate], chunk_sizes: list[int], bind: bool) -> None:
        self._fn, self._direction, self._policy, self._resolve_args = fn, direction, policy, resolve_args
        self._fns: dict[str, SwapFn] = {}
        self._size = chunk_sizes[0] if len(templates) == 1 and len(chunk_sizes) == 1 else None
        self._count, self._bytes = templates[0].count, templates[0].block_bytes
        if bind and self._size is not None:
            for name in fn.quiet_impls:
                self._quiet_fn(name)
            fn.prepare_quieter(self._size)

    def __call__(self, n: int, within: float) -> Optional[SwapFn]:
        size = self._size
        if size is None or not n:
            return None
        name = self._fn.quieter(size, n * self._count, n * self._bytes, float(within))
        return None if name is None else self._quiet_fn(name)

    def _quiet_fn(self, name: str) -> SwapFn:
        fn = self._fns.get(name)
        if fn is None:
            policy = dataclasses.replace(self._policy, force=name)
            fn = self._fns[name] = resolve(self._direction, policy=policy, **self._resolve_args)
        return fn


class StagedRanking:
    """``choice(n, within)`` for a device mover whose host side suits the staged route and
    whose calibration predicts it (:func:`kvswap.mover.staged.staged_choice`): the staged
    route, the resolved route at the job's batch tier and every other usable route, ranked
    by the step each is predicted to end (:func:`kvswap.resolution.routing.step_cost`); the
    function of the winner, or None where it is the mover's own (staged, or the resolved
    route, as built). Ties go to the mover's own, and a route that slows the compute more
    than the mover's own must win by :data:`SWITCH_MARGIN`.

    :param bind: resolve the other routes now (a device mover), not on first use.
    """

    def __init__(self, choice: Any, fn: SwapFn, direction: Direction, policy: Policy, resolve_args: dict[str, Any],
                 template: DescriptorTemplate, bind: bool = True) -> None:
        self._choice, self._fn, self._direction, self._policy = choice, fn, direction, policy
        self._resolve_args = resolve_args
        self._staged = choice.staged[0]
        self._own_staged = choice.steps is not None
        self._count, self._bytes = template.count, template.block_bytes
        self._fns: dict[str, Optional[SwapFn]] = {}
        if bind:
            names = {r[0] for every in choice.table[2] if every is not None for r in every[1:]}
            for name in sorted(names - {self._staged}):
                self._forced(name)

    def __call__(self, n: int, within: float) -> Optional[SwapFn]:
        if not n:
            return None
        count, nbytes = n * self._count, n * self._bytes
        rates = self._choice.rates(count)
        if rates is None:
            return None
        own = self._staged if self._own_staged else rates[1][0]
        own_slowdown = next((r[4] for r in rates if r[0] == own), 0.0)
        best, cost = own, None
        for r in rates:
            c = step_cost(seconds(r, count, nbytes), r[4], float(within))
            if r[0] == own:
                c -= 1e-12  # a tie keeps the mover's own route
            elif r[4] > own_slowdown:
                c *= 1.0 + SWITCH_MARGIN  # a route that slows the compute more must win clearly
            if cost is None or c < cost:
                best, cost = r[0], c
        if best == own:
            return None
        if best == self._staged:
            return self._choice.fn
        if best == rates[1][0]:
            return self._fn  # the resolved route, at this job's tier
        return self._forced(best)

    def _forced(self, name: str) -> Optional[SwapFn]:
        if name not in self._fns:
            try:
                policy = dataclasses.replace(self._policy, force=name)
                self._fns[name] = resolve(self._direction, policy=policy, **self._resolve_args)
            except ConfigurationError:
                raise
            except Exception:  # a route that cannot be bound is not chosen
                self._fns[name] = None
        return self._fns[name]
