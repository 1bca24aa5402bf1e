"""Which copy function a BlockMover job with ``within`` seconds beside the engine's compute
takes: the mover's, or that of a route that takes no SMs where it is predicted to end the
step sooner (:meth:`kvswap.SwapFn.quieter`).

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
from ..resolution.swapfn import SwapFn
from ..types import Direction, Policy


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
