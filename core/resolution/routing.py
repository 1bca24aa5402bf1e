"""The one rule that ranks copy routes and builds the routes of a plan.

The resolver decides by it, calibration fits its decisions by it, and the bench and the
tests reproduce routes with it. Everything here is a pure function of a
:class:`~kvswap.Calibration`, the usable implementations, the policy and the device.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Iterable, NamedTuple, Optional, Sequence

from ..registry.impl import CopyImpl
from ..registry.thresholds import Calibration
from ..types import DeviceInfo, Direction, Policy
from .plan import Route

__all__ = [
    "EDGES",
    "HOST_COST_AT",
    "KERNEL_MARGIN",
    "Rate",
    "SIZE_CLASSES",
    "knee_sms",
    "margin",
    "paying_tiers",
    "predicted",
    "rank",
    "rank_key",
    "rates",
    "routes",
    "sm_cap",
    "thread_bound",
    "sms_by_batch",
    "step_cost",
    "tiers_at",
]

KiB = 1024
# Block-size classes the plan decides for: powers of two and their midpoints, 1 KiB-4 MiB.
EDGES: tuple[int, ...] = (1,) + tuple(
    sorted({KiB << i for i in range(13)} | {3 * (KiB << i) // 2 for i in range(12)})
)

# ``(min_bytes, max_bytes or None, at_bytes)`` per class: from one edge to the next, decided
# at its lower edge. The edges are the sizes calibration measures, and the block sizes of KV
# caches are powers of two and their midpoints too, so a block of exactly an edge's size gets
# the decision of its own measurements, not of a size between two of them. The class under
# 1 KiB, below every measurement, is decided at its geometric middle.
SIZE_CLASSES: tuple[tuple[int, Optional[int], int], ...] = tuple(
    (lo, hi, lo if lo >= KiB else int(math.sqrt(lo * (hi + 1))))
    for lo, hi in zip(EDGES, [e - 1 for e in EDGES[1:]] + [None])
)

# On a measured calibration, a route that takes SMs wins a block or batch size from one that
# takes none only when predicted faster by more than this: its SMs come out of compute, and
# routes closer than this swap places between two calibrations (docs/calibrating-a-device.md).
KERNEL_MARGIN = 0.01


# The descriptor count the thread-time rule decides at, and from which it must hold: 32 blocks
# of a 64-descriptor layout (llama-3.1-8b's per-layer K and V), a small step's transfer.
HOST_COST_AT = 2048


def thread_bound(ranked: Sequence[tuple[CopyImpl, Optional[float]]], cal: Calibration, direction: Direction,
                 size: int, at: int = HOST_COST_AT) -> dict[str, tuple[float, float, str]]:
    """The routes of ``ranked`` whose call holds the engine's thread longer than the whole
    transfer takes on another route: ``{impl: (host_us, other_us, other_impl)}`` at ``at``
    descriptors of ``size`` bytes.

    With ``host_us(n) = a + b*n`` (:meth:`Calibration.host_line`) and another route's whole
    transfer ``t(n) = n * size / GB/s`` (its predicted bandwidth, which was measured from
    the call to the last byte), a route is excluded when ``host_us(at) > t(at)`` and its
    slope ``b`` exceeds ``size / GB/s``: then it holds for every batch of ``at`` descriptors
    or more. ``other_impl`` is the route whose transfer is quickest. A route without a
    measured host cost, or compared only with routes without a prediction, is never
    excluded; where no predicted route would be left, the one that holds the thread least
    is kept.
    """
    per_desc = {impl.name: size / (g * 1e3) for impl, g in ranked if g}  # microseconds per descriptor
    out: dict[str, tuple[float, float, str]] = {}
    for impl, _ in ranked:
        line = cal.host_line(impl.name, impl.kind, direction)
        others = [(t, name) for name, t in per_desc.items() if name != impl.name]
        if line is None or not others:
            continue
        a, b = line
        t, other = min(others)
        if a + b * at > t * at and b > t:
            out[impl.name] = (a + b * at, t * at, other)
    if out and not any(g for impl, g in ranked if impl.name not in out):
        keep = min(out, key=lambda name: (out[name][0], name))
        del out[keep]
    return out


def margin(cal: Calibration) -> float:
    """The margin a kernel must win by under ``cal``: :data:`KERNEL_MARGIN` for measured
    numbers, none for published or guessed ones (``calibrated=False``), taken as drawn."""
    return KERNEL_MARGIN if cal.calibrated else 0.0


def rank_key(gbps: Optional[float], uses_sms: bool, name: str, *, kernel_margin: float = KERNEL_MARGIN,
             builtin: bool = True) -> tuple:
    """The sort key of one route: ascending is best first.

    Unknown speeds rank last; a route that takes SMs is scored ``gbps / (1 + margin)``;
    ties go to the route that takes no SMs, then to a built-in implementation, then by
    name, so registration order never decides.
    """
    score = 0.0 if gbps is None else (gbps / (1.0 + kernel_margin) if uses_sms else gbps)
    return (gbps is None, -score, uses_sms, not builtin, name)


def sm_cap(n: int, policy: Policy, device: DeviceInfo) -> int:
    """``n`` SMs within the policy's budget and the device's count."""
    if policy.max_sms is not None:
        n = min(n, policy.max_sms)
    if device.compute_units and device.platform != "cpu":  # CPU cores are not SMs
        n = min(n, device.compute_units)
    return max(n, 1)


def knee_sms(cal: Calibration, direction: Direction, policy: Policy, device: DeviceInfo) -> int:
    """The SMs a kernel route is bound with: the calibration's knee, capped."""
    return sm_cap(cal.sms(direction), policy, device)


def tiers_at(tiers: Iterable[tuple[int, int]], knee: Optional[int]) -> tuple[tuple[int, int], ...]:
    """``tiers`` with equal neighbours merged; empty when every tier runs on ``knee``, the
    SMs the kernel is bound with (no tiers: the knee for every batch)."""
    out: list[tuple[int, int]] = []
    for start, k in tiers:
        if not out or out[-1][1] != k:
            out.append((start, k))
    return () if all(k == knee for _, k in out) else tuple(out)


def sms_by_batch(cal: Calibration, direction: Direction, policy: Policy, device: DeviceInfo,
                 size: int, num_sms: int) -> tuple[tuple[int, int], ...]:
    """The calibration's SM tiers at ``size``, capped like the knee (0, the route that
    takes no SMs, stays 0): :func:`tiers_at` the knee ``num_sms``."""
    return tiers_at(((start, sm_cap(k, policy, device) if k else 0)
                     for start, k in cal.sms_tiers(direction, size)), num_sms)


def paying_tiers(tiers: tuple[tuple[int, int], ...], cal: Calibration, direction: Direction, kernel: CopyImpl,
                 size: int, knee: int) -> tuple[tuple[int, int], ...]:
    """``tiers`` where each SM count above the knee pays for the compute it takes: its
    predicted speed over the knee's at ``size`` must grow by more than the compute slowdown
    it adds (``slowdown_by_sms``, measured beside compute). Otherwise that tier runs on the
    knee. Only for copies to the host (offloads, which no step waits for); a copy from the
    host is a load the next step may wait for, so its tiers keep buying time. Unchanged
    where the calibration measured no slowdown by SM count."""
    if not tiers or direction.src_is_host or not cal.slowdown_by_sms.get(str(direction)):
        return tiers
    name, kind = kernel.name, kernel.kind
    base = cal.predict(name, kind, direction, size, knee)
    if not base:
        return tiers
    base_slow = cal.slowdown_at(name, kind, direction, knee, size)
    out = []
    for start, k in tiers:
        if k > knee:
            gbps = cal.predict(name, kind, direction, size, k)
            if gbps is None or gbps / base - 1.0 <= cal.slowdown_at(name, kind, direction, k, size) - base_slow:
                k = knee
        out.append((start, k))
    return tiers_at(out, knee)


def predicted(impl: CopyImpl, cal: Calibration, direction: Direction, size: int, num_sms: Optional[int],
              builtin: bool = True) -> Optional[float]:
    """GB/s ``cal`` predicts for ``impl`` at ``size``, or None. A curve for a kind
    (``*batch``, ``*kernel``) speaks for built-in implementations only: another plugin's
    implementation is predicted by curves that name it, or not at all."""
    curve, scale = cal.curve_for(impl.name, impl.kind, direction, num_sms if impl.uses_sms else None)
    if curve is None or (not builtin and curve.impl != impl.name):
        return None
    return curve.gbps(size) * scale


def rank(
    usable: Sequence[CopyImpl], cal: Calibration, direction: Direction, policy: Policy,
    size: int, exact: bool, num_sms: int, builtin: Optional[frozenset[str]] = None,
) -> list[tuple[CopyImpl, Optional[float]]]:
    """Usable impls that can take ``size``, best first, with predicted GB/s.

    :param exact: ``size`` is a block size the caller named: alignment must admit it too
        (otherwise only the size bounds must).
    :param num_sms: the SMs kernels are predicted at.
    :param builtin: names of the built-in implementations (None: all are); another
        plugin's implementation is predicted only by curves that name it, and loses ties.
    """
    m = margin(cal)
    rows = []
    for impl in usable:
        if not (impl.accepts_size(size) if exact else impl.accepts_range(size)):
            continue
        own = builtin is None or impl.name in builtin
        g = predicted(impl, cal, direction, size, num_sms, own)
        score = g
        if score is not None and policy.prefer == "low_interference":
            score *= 1.0 - cal.slowdown_at(impl.name, impl.kind, direction, num_sms if impl.uses_sms else None, size)
        rows.append((rank_key(score, impl.uses_sms, impl.name, kernel_margin=m, builtin=own), impl, g))
    rows.sort(key=lambda r: r[0])
    return [(impl, g) for _, impl, g in rows]


def routes(
    usable: Sequence[CopyImpl], cal: Calibration, direction: Direction, policy: Policy,
    sizes: Sequence[int], num_sms: int, device: DeviceInfo, builtin: Optional[frozenset[str]] = None,
) -> tuple[Route, ...]:
    """The routes by block size that ``usable`` get under ``cal``: one per run of size
    classes with the same decision, decided at ``sizes`` where given (the block sizes the
    caller copies), else at each class's own size. Kernels are bound with ``num_sms``
    (:func:`knee_sms`); ``builtin`` as for :func:`rank`."""
    out: list[Route] = []
    for lo, hi, at in SIZE_CLASSES:
        given = [s for s in sizes if s >= lo and (hi is None or s <= hi)]
        rep = given[0] if given else at
        ranked = rank(usable, cal, direction, policy, rep, bool(given), num_sms, builtin)
        if not ranked:
            continue
        excluded = thread_bound(ranked, cal, direction, rep)
        best = next(impl for impl, _ in ranked if impl.name not in excluded)
        others = [r for r in ranked if r[0] is not best]  # in rank order: small batches, fallbacks
        # Tiers buy throughput with SMs: a low-interference policy keeps the knee.
        tiers = sms_by_batch(cal, direction, policy, device, rep, num_sms) if policy.prefer == "throughput" else ()
        kern = best if best.uses_sms else next((impl for impl, _ in others if impl.uses_sms), None)
        if kern is not None:
            tiers = paying_tiers(tiers, cal, direction, kern, rep, num_sms)
        if best.uses_sms:
            small = next((impl for impl, _ in others if not impl.uses_sms), None)
            min_batch = cal.min_batch(direction, block_bytes=rep) if small else 0
            if small is not None and small.name in excluded:
                # Below HOST_COST_AT it may still take the small batches it was measured to
                # win (min_batch); from there on, never a tier of its own.
                min_batch = min(min_batch, HOST_COST_AT)
                tiers = _no_zero_from(tiers, HOST_COST_AT, num_sms)
        else:
            # Ranked at a large batch, a route without SMs can still lose the small batches
            # of this size to a kernel: a tier of 0 SMs says the calibration measured where,
            # for a kernel it predicts (tiers fitted for another kernel say nothing of this one).
            kernel = next((impl for impl, g in others if impl.uses_sms and g is not None), None)
            if kernel is not None and any(k == 0 for _, k in tiers) and any(k for _, k in tiers):
                best, small, min_batch = kernel, best, 0
            else:
                small, min_batch, tiers = None, 0, ()
        if small is None:  # no route without SMs to give 0-SM tiers to: they keep the knee
            tiers = tiers_at(((n, k or num_sms) for n, k in tiers), num_sms)
        shown = [r for r in ranked if r[0].name not in excluded] + [r for r in ranked if r[0].name in excluded]
        route = Route(
            min_bytes=lo,
            max_bytes=hi,
            impl=best.name,
            at_bytes=rep,
            predicted=tuple((impl.name, None if g is None else round(g, 2)) for impl, g in shown),
            host_cost=tuple((impl.name, *(cal.host_line(impl.name, impl.kind, direction) or (None, None)))
                            for impl, _ in shown),
            host_at=HOST_COST_AT,
            excluded=tuple((name, round(h, 1), round(t, 1), other) for name, (h, t, other) in excluded.items()),
            min_batch=min_batch,
            small_batch_impl=small.name if small else None,
            fallbacks=tuple(impl.name for impl, _ in ranked if impl is not best),
            sms_by_batch=tiers,
        )
        prev = out[-1] if out else None
        decided = ("impl", "small_batch_impl", "min_batch", "fallbacks", "sms_by_batch")
        if (prev and prev.max_bytes == lo - 1 and all(getattr(prev, a) == getattr(route, a) for a in decided)
                and [e[0] for e in prev.excluded] == [e[0] for e in route.excluded]):
            keep = route if given and prev.at_bytes not in sizes else prev
            out[-1] = replace(prev, max_bytes=hi, at_bytes=keep.at_bytes, predicted=keep.predicted,
                              host_cost=keep.host_cost, excluded=keep.excluded)
        else:
            out.append(route)
    return tuple(out)


def _no_zero_from(tiers: Sequence[tuple[int, int]], start: int, knee: int) -> tuple[tuple[int, int], ...]:
    """``tiers`` with no tier of 0 SMs (the route that takes none) from ``start`` descriptors
    on: those batches run on the knee instead."""
    if not tiers:
        return ()
    active = tiers[0][1]
    for n, k in tiers:
        if n <= start:
            active = k
    out = [(n, k) for n, k in tiers if n < start] + [(start, active or knee)]
    out += [(n, k or knee) for n, k in tiers if n > start]
    return tiers_at(out, knee)


def step_cost(seconds: float, slowdown: float, compute: float) -> float:
    """When both are done: the engine's compute, ``compute`` seconds alone, and a copy of
    ``seconds`` beside it that takes ``slowdown`` (a fraction) of the compute's throughput
    while they overlap: the compute ends ``slowdown * seconds`` late, unless the copy
    outlasts it, and then the copy ends the step."""
    return max(compute + slowdown * seconds, seconds)


class Rate(NamedTuple):
    """A route's predicted cost for blocks of one size: its speed (``gbps``), the host cost
    of a call of ``n`` descriptors (``a_us + b_us * n``) and the fraction of the compute's
    throughput it takes while it runs (``slowdown``)."""

    name: str
    gbps: float
    a_us: float
    b_us: float
    slowdown: float

    def seconds(self, count: int, nbytes: int) -> float:
        """The predicted time of ``count`` descriptors of ``nbytes`` in all: the bytes at the
        route's speed plus the host cost of its call. The two are added, though the speed
        curve holds the call's host work on the calibration's layout: where the call and the
        copy overlap that overestimates the route."""
        return nbytes / (self.gbps * 1e9) + (self.a_us + self.b_us * count) * 1e-6


def rates(route: Route, impl: CopyImpl, num_sms: Optional[int], others: Iterable[CopyImpl], cal: Calibration,
          direction: Direction, size: int) -> Optional[tuple[Rate, ...]]:
    """The predicted cost of blocks of ``size`` bytes on ``impl`` at ``num_sms`` first, then
    on every implementation among ``others`` that takes no SMs and is predicted (speed
    curve, host cost, compute slowdown by SM count and block size); None where ``impl`` is
    not predicted."""

    def rate(c: CopyImpl, sms: Optional[int]) -> Optional[Rate]:
        gbps = predicted(c, cal, direction, size, sms)
        line = route.host_line(c.name)
        if not gbps or line is None:
            return None
        return Rate(c.name, gbps, line[0], line[1], cal.slowdown_at(c.name, c.kind, direction, sms, size))

    mine = rate(impl, num_sms)
    if mine is None:
        return None
    quiet = (rate(o, None) for o in others if not o.uses_sms and o.accepts_size(size))
    return (mine, *(q for q in quiet if q is not None))
