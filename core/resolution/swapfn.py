"""SwapFn: the callable ``resolve()`` returns; per call it only routes and launches."""
from __future__ import annotations

from bisect import bisect_right
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from ..addressing.descriptors import merge_runs, run_starts, validate
from ..errors import DriverError, InvalidTransferError
from ..registry.failures import copy_failure
from ..registry.impl import CopyImpl, TransferFn
from ..registry.thresholds import Calibration
from .plan import Plan, Route
from .routing import Rate, rates


# Batches shorter than this are not worth a look for contiguous runs: the look costs more
# than the few driver descriptors it could save.
COALESCE_FROM = 8


class Steps(NamedTuple):
    """What one route does by batch size, decided at resolve time: one entry per step,
    ``starts`` ascending from 0; a batch of ``n`` descriptors takes the last step whose start
    is ``<= n`` (the small-batch implementation below ``min_batch`` and in tiers of 0 SMs,
    the kernel's SM tiers elsewhere)."""

    starts: tuple[int, ...]
    fns: tuple[TransferFn, ...]
    plain: tuple[bool, ...]  # no constraint to check per call: the batch goes to ``fns[i]`` as is
    keys: tuple[tuple[str, Optional[int]], ...]  # (implementation, num_sms)


class BatchSteps(NamedTuple):
    """Where a batch of one route goes whole, by its descriptor count: ``fns[i]`` (bound
    from ``impls[i]``) for the last ``starts[i] <= n``; ``fns[i]`` is None where that
    implementation checks constraints per call."""

    starts: tuple[int, ...]
    fns: tuple[Optional[TransferFn], ...]
    impls: tuple[CopyImpl, ...]


class RateTable(NamedTuple):
    """What each route is predicted to cost for one block size, per batch tier
    (:meth:`SwapFn.rate_table`)."""

    starts: tuple[int, ...]
    every: tuple[Optional[tuple[Rate, ...]], ...]

    def at(self, count: int) -> Optional[tuple[Rate, ...]]:
        """The tier of ``count`` descriptors: its own route's rate first, then the others'."""
        return self.every[bisect_right(self.starts, count) - 1]


class SwapFn:
    """``fn(src_ptrs, dst_ptrs, sizes, *, stream=None)`` copies a batch of blocks.

    Arguments are 1-D int64 CPU tensors, numpy arrays or sequences of addresses and byte
    counts. Per call it does only what cannot be known at resolve time: it validates the
    whole batch (:func:`kvswap.addressing.descriptors.validate`), merges runs of descriptors that are
    contiguous on both sides where that shortens the batch by a quarter or more
    (``Policy.coalesce``), routes each descriptor by size class and batch size, and sends
    descriptors a route's constraints refuse (alignment) to the next route that accepts
    them. Every check runs before the first byte moves, so no implementation sees an
    invalid batch and a batch split across routes gets one verdict; errors name the
    caller's descriptor indices. Where a stream applies, the copy is enqueued on
    ``stream`` (default: the current stream) and the call returns without waiting.
    """

    def __init__(self, plan: Plan, impls: dict[str, CopyImpl],
                 bound: dict[tuple[str, Optional[int]], TransferFn], calibration: Optional[Calibration] = None,
                 usable: Sequence[CopyImpl] = ()) -> None:
        """:param bound: the bound transfer per ``(impl, num_sms)``: num_sms as in
        ``plan.params`` (None for impls that take no SMs), plus one per SM count the
        routes' batch tiers name.
        :param calibration: what the plan was decided by (for :meth:`rate_table`).
        :param usable: every implementation that could copy here, used or not."""
        self.plan = plan
        self._cal = calibration
        self._usable = tuple(usable)
        self._impls = impls
        self._fns = bound
        self._sms = {name: plan.params.get(name, {}).get("num_sms") for name in impls}
        self._routes = plan.routes
        self._lows = np.array([r.min_bytes for r in plan.routes], dtype=np.int64)
        self._low_list = [r.min_bytes for r in plan.routes]
        # Impls with no constraint to check per call: the hot path hands them the batch as is.
        self._plain = {
            name for name, i in impls.items()
            if i.alignment == 1 and i.min_block_bytes == 1 and i.max_block_bytes is None and i.mixed_sizes
        }
        self._steps = [self._steps_of(r) for r in plan.routes]
        self._by_size: dict[int, tuple] = {}
        # A merged run must stay within every route's largest descriptor.
        caps = [i.max_block_bytes for i in impls.values() if i.max_block_bytes is not None]
        self._merge_cap = min(caps) if caps else None
        self._coalesce = plan.policy.coalesce

    def _steps_of(self, route: Route) -> Steps:
        """What ``route`` does by batch size, decided once (:class:`Steps`)."""
        base = route.min_batch if route.small_batch_impl else 0
        steps: list[tuple[int, str, Optional[int]]] = []
        for start in sorted({0, base} | {t for t, _ in route.sms_by_batch if t > base}):
            name, tier = route.runs(start)
            sms = tier or self._sms[name]
            if not steps or steps[-1][1:] != (name, sms):
                steps.append((start, name, sms))
        return Steps(tuple(start for start, _, _ in steps), tuple(self._fns[(n, k)] for _, n, k in steps),
                     tuple(n in self._plain for _, n, _ in steps), tuple((n, k) for _, n, k in steps))

    @property
    def requires_pinned(self) -> bool:
        """Whether any route this function may take needs page-locked host memory."""
        return any(impl.requires_pinned for impl in self._impls.values())

    @property
    def calibration(self) -> Optional[Calibration]:
        """The calibration the routes were decided by (None: the backends' defaults)."""
        return self._cal

    @property
    def impls(self) -> tuple[str, ...]:
        """Names of the implementations this function may call."""
        return tuple(sorted(self._impls))

    def explain(self) -> str:
        """The decision trace in words: platform, device, candidates, calibration, routes."""
        return self.plan.explain()

    def __repr__(self) -> str:
        routes = ", ".join(r.impl for r in self._routes)
        return f"<kvswap.SwapFn {self.plan.direction} on {self.plan.device.platform}: {routes}>"

    def __call__(self, src_ptrs: Any, dst_ptrs: Any, sizes: Any, *, stream: Any = None) -> None:
        src, dst, n, smallest, largest = validate(src_ptrs, dst_ptrs, sizes)
        if len(n):
            self._route(src, dst, n, smallest, largest, stream)

    def call_validated(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, *, stream: Any = None) -> None:
        """The call for a batch its caller has already validated as a whole (BlockMover:
        descriptors built from a checked template and checked block ids): 1-D C-contiguous
        int64 arrays, non-empty, with no invalid address and no overlapping destination.
        It routes and copies without checking the batch again."""
        self._route(src, dst, sizes, int(sizes.min()), int(sizes.max()), stream)

    def call_built(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any) -> None:
        """:meth:`call_validated` for a batch whose contiguous runs its caller has merged
        already (a BlockMover job): no second look for runs."""
        self._route(src, dst, sizes, int(sizes.min()), int(sizes.max()), stream, False)

    def _route(self, src: np.ndarray, dst: np.ndarray, n: np.ndarray, smallest: int, largest: int,
               stream: Any, merge: bool = True) -> None:
        count = len(n)
        given = None
        if merge and self._coalesce and count >= COALESCE_FROM:
            merged = self._merged(src, dst, n)
            if merged is not None:
                given, (src, dst, n) = (src, dst, n), merged
                count, smallest, largest = len(n), int(n.min()), int(n.max())
        # Every SwapFn, forced or resolved, one route or many, takes this same path, so
        # two functions on the same route cost the same per call.
        if smallest == largest:  # one block size, as engines send: a dict hit after the first
            steps = self._by_size.get(smallest)
            if steps is None:
                steps = self._steps_at(smallest)
        else:
            lows = self._low_list
            r = bisect_right(lows, smallest) - 1
            steps = self._steps[r] if r == bisect_right(lows, largest) - 1 else None
        if steps is not None:  # one size class: the common case, no per-descriptor work here
            i = bisect_right(steps.starts, count) - 1
            if steps.plain[i]:
                try:
                    steps.fns[i](src, dst, n, stream)
                except Exception as e:
                    out = _raised(e, steps.keys[i][0], None, given)
                    if out is e:
                        raise
                    raise out from e
                return
        try:
            parts = self.assign(src, dst, n)
        except InvalidTransferError:
            if given is None:
                raise
            # A route refused a merged descriptor: decide on the batch as given, so that
            # a refusal names the caller's own descriptor.
            src, dst, n = given
            given = None
            parts = self.assign(src, dst, n)
        for name, sms, sel in parts:
            fn = self._fns[(name, sms)]
            try:
                if sel is None:
                    fn(src, dst, n, stream)
                else:
                    fn(src[sel], dst[sel], n[sel], stream)
            except Exception as e:
                out = _raised(e, name, sel, given)
                if out is e:
                    raise
                raise out from e

    def _merged(self, src: np.ndarray, dst: np.ndarray, n: np.ndarray) -> Optional[tuple[np.ndarray, ...]]:
        """The batch with contiguous runs merged, or None where that does not pay: fewer
        than a quarter of the descriptors would go, or a run would outgrow a route."""
        quarter = len(n) // 4
        follows = src[:-1] + n[:-1] == src[1:]  # the sources alone rule most batches out
        if np.count_nonzero(follows) < quarter:
            return None
        if np.count_nonzero(follows & (dst[:-1] + n[:-1] == dst[1:])) < quarter:
            return None
        merged = merge_runs(src, dst, n)
        if self._merge_cap is not None and int(merged[2].max()) > self._merge_cap:
            return None
        return merged

    def _steps_at(self, size: int) -> Steps:
        """The steps of the route for blocks of ``size`` bytes, remembered (up to 4096 sizes)."""
        steps = self._steps[bisect_right(self._low_list, size) - 1]
        if len(self._by_size) < 4096:
            self._by_size[size] = steps
        return steps

    def _choose(self, r: int, count: int) -> tuple[str, Optional[int]]:
        """The impl, and its SM count, that route ``r`` takes for ``count`` descriptors."""
        steps = self._steps[r]
        return steps.keys[bisect_right(steps.starts, count) - 1]

    def rate_table(self, size: int) -> Optional[RateTable]:
        """What each route is predicted to cost for blocks of ``size`` bytes at every batch
        tier of this function (:func:`kvswap.resolution.routing.rates`): per tier, the tier's
        own route first, then every other usable one (kernels at the tier's SMs, else the
        knee), or None where the tier's own route is not predicted; None for a forced route
        or without a calibration. What a BlockMover ranks the staged route against
        (:mod:`kvswap.mover.route_choice`)."""
        if self._cal is None or self.plan.forced:
            return None
        r = bisect_right(self._low_list, size) - 1
        steps = self._steps[r]
        route, usable, cal, direction = self._routes[r], self._usable, self._cal, self.plan.direction
        knee = next((k for k in self._sms.values() if k), None) or cal.sms(direction)
        every: list[Optional[tuple[Rate, ...]]] = []
        for name, sms in steps.keys:
            own = rates(route, self._impls[name], sms, usable, cal, direction, size)
            if own is None:
                every.append(None)
                continue
            kernels = (rates(route, k, sms or knee, (), cal, direction, size) for k in usable
                       if k.uses_sms and k.name != name and k.accepts_size(size))
            others = [q for q in own[1:] if q.name != name] + [q[0] for q in kernels if q is not None]
            every.append((own[0], *others))
        return RateTable(steps.starts, tuple(every))

    def whole_batch_steps(self, smallest: int, largest: int) -> Optional[BatchSteps]:
        """Where a batch whose sizes all lie in ``[smallest, largest]`` goes whole, by its
        descriptor count (:class:`BatchSteps`); None when such a batch could span routes.
        BlockMover asks once, to bind the transfers' optional ``by_ids``
        (:attr:`~kvswap.CopyImpl.by_ids`)."""
        lows = self._low_list
        r = bisect_right(lows, smallest) - 1
        if r != bisect_right(lows, largest) - 1:
            return None
        steps = self._steps[r]
        return BatchSteps(steps.starts, tuple(f if p else None for f, p in zip(steps.fns, steps.plain)),
                          tuple(self._impls[name] for name, _ in steps.keys))

    def assign(self, src: np.ndarray, dst: np.ndarray, n: np.ndarray) -> list[tuple[str, Optional[int], Optional[np.ndarray]]]:
        """Which implementation copies which descriptors: ``(impl, num_sms, indices or
        None=all)``; ``num_sms`` is what a kernel runs on (None for impls without SMs).

        Raises :class:`InvalidTransferError` for a descriptor no usable route accepts.
        """
        routes = self._routes
        if len(routes) == 1:
            groups: list[tuple[int, Optional[np.ndarray]]] = [(0, None)]
        else:
            lo, hi = int(n.min()), int(n.max())
            r_lo, r_hi = (int(np.searchsorted(self._lows, v, side="right")) - 1 for v in (lo, hi))
            if r_lo == r_hi:
                groups = [(r_lo, None)]
            else:
                which = np.searchsorted(self._lows, n, side="right") - 1
                groups = [(int(r), np.flatnonzero(which == r)) for r in np.unique(which)]
        out: list[tuple[str, Optional[int], Optional[np.ndarray]]] = []
        for r, sel in groups:
            count = len(n) if sel is None else len(sel)
            self._place(*self._choose(r, count), routes[r], src, dst, n, sel, out)
        return out

    def _place(self, name: str, sms: Optional[int], route: Route, src: np.ndarray, dst: np.ndarray,
               n: np.ndarray, sel: Optional[np.ndarray], out: list) -> None:
        impl = self._impls[name]
        view = (src, dst, n) if sel is None else (src[sel], dst[sel], n[sel])
        bad = impl.refused(*view)
        if not bad.any():
            self._split_sizes(impl, sms, sel, view[2], out)
            return
        idx = np.arange(len(n)) if sel is None else sel
        if (~bad).any():
            self._split_sizes(impl, sms, idx[~bad], view[2][~bad], out)
        left = idx[bad]
        for other in (route.impl, route.small_batch_impl, *route.fallbacks):
            if not left.size or other is None or other == name:
                continue
            alt = self._impls[other]
            refused = alt.refused(src[left], dst[left], n[left])
            if (~refused).any():
                self._split_sizes(alt, self._sms[other], left[~refused], n[left][~refused], out)
            left = left[refused]
        if left.size:
            i = int(left[0])
            raise InvalidTransferError(
                f"descriptor {i} (src=0x{int(src[i]):x}, dst=0x{int(dst[i]):x}, size={int(n[i])}) "
                f"is refused by {name}: {impl.why_refused(int(src[i]), int(dst[i]), int(n[i]))}; "
                f"no other usable implementation accepts it"
            )

    @staticmethod
    def _split_sizes(impl: CopyImpl, sms: Optional[int], sel: Optional[np.ndarray], sizes: np.ndarray,
                     out: list) -> None:
        if impl.mixed_sizes or sizes.min() == sizes.max():
            out.append((impl.name, sms, sel))
            return
        idx = np.arange(len(sizes)) if sel is None else sel
        for size in np.unique(sizes):
            out.append((impl.name, sms, idx[sizes == size]))


def _raised(e: Exception, impl: str, sel: Optional[np.ndarray], given: Optional[tuple]) -> Exception:
    """What the caller gets for ``e``, raised by ``impl``'s copy (:func:`copy_failure`): a
    DriverError with its descriptor index turned into the caller's (:func:`_callers_index`)."""
    out = copy_failure(e, impl)
    return _callers_index(out, sel, given) if isinstance(out, DriverError) else out


def _callers_index(e: DriverError, sel: Optional[np.ndarray], given: Optional[tuple]) -> DriverError:
    """``e`` with its descriptor index turned into the caller's: through the route's
    selection ``sel`` (indices into the batch), then through the merge of runs
    (``given``: the batch as the caller passed it)."""
    if e.index is None or (sel is None and given is None):
        return e
    i = int(e.index) if sel is None else int(sel[e.index])
    if given is not None:
        i = int(run_starts(*given)[i])
    out = type(e).__new__(type(e))  # keeps a subclass (a failure reported from another thread)
    out.__dict__.update(e.__dict__)
    DriverError.__init__(out, e.call, e.code, e.name, e.text, index=i)
    return out
