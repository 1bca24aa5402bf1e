"""Turn measurements into decisions: pure functions, no device, no I/O.

Per direction (:class:`~.decisions.Decision`):

* **SM knee**: the fewest SMs at which the kernel stays within ``tolerance`` of its own
  peak (over every SM count measured), on the geometric mean of its fraction of that peak
  over the block sizes where, at the peak, it beats the best batch route. A mean, not every
  size, so that one noisy point, or the 1 KiB blocks that need many SMs, cannot buy the whole
  range its SMs. Every SM a copy kernel holds is taken from compute (docs/design.md), so
  nothing beyond the knee is worth taking.
* **Route per block size**: the fastest of the batch routes and the kernel *at the knee*,
  ranked by the resolver's rule (:mod:`kvswap.resolution.routing`: a kernel must be faster by more
  than its margin; ties go to the route that takes no SMs). ``by_size`` says it for each
  measured size; ``routes`` for each of the resolver's block-size classes, ranked from the
  profile's curves as the resolver ranks them, so ``explain()`` shows what the fit decided.
* **Minimum batch**: the batch-size threshold under which the batch route is used instead
  of the kernel, chosen to minimise the summed slowdown against the faster of the two over
  the measured batch sizes; ties go to the larger threshold. A kernel win within the margin
  and the timings' noise counts as a tie, so one noisy point cannot move it the way "first
  batch where the kernel won" would. Fitted per measured block size (``min_batch_by_size``,
  which the resolver interpolates) and over all of them (``kernel_min_batch``).
* **SM tiers by batch size**: the knee is fitted where the batch fills the link; a medium
  batch can finish sooner on more SMs. Per measured block size, over the batch sizes the
  kernel is used for, a step function from batch size to SM count (``kernel_sms_by_batch``):
  the fewest SMs the timings cannot tell from the fastest count at each batch size, where
  one noisy batch size cannot open a tier of its own (:func:`sms_by_batch`).
* **The kernel's batch window where the batch route is the route**: fitted at a large
  batch, the batch route can win a block size whose small batches a kernel on more SMs
  still copies sooner. Per such size, the batch sizes the kernel takes
  (:func:`kernel_window`, a tie going to the batch route), with their SM tiers, and 0 SMs
  (the batch route) for the others: ``[[1, 0], [4, 24], [181, 0]]`` gives batches of 4-180
  to the kernel on 24 SMs. A size where the kernel takes no batch gets ``[[1, 0]]``.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Optional

from kvswap import BindContext, Calibration, CopyImpl, Curve, DeviceInfo, Direction, Policy

from kvswap.resolution import routing
from .decisions import ClassRoute, Decision, Fitted, SizeRoute
from .records import BATCH, CEILING, SIZE, Measurement
from .timing import standard_error

KERNEL_MARGIN = routing.KERNEL_MARGIN

# "Within a few % of peak": what the knee may give up for fewer SMs, on the geometric mean
# over the kernel's block sizes (:func:`sm_knee`), so one size may fall further behind.
TOLERANCE = 0.05

# A batch-size tier takes the fewest SMs the timings cannot tell from the fastest count
# measured there (their standard error), with no slack beyond it: a slack of even 0.5% kept
# medium batches on fewer SMs than a faster count the bench then measured 3-5% ahead.
# Tiers are the throughput policy's (``Policy(prefer="low_interference")`` keeps the knee).
#
# A batch size whose fewest SMs differ from both neighbours' takes theirs when that count is
# within TIER_NOISE of the fastest there: one tier for one batch size is more likely the
# run-to-run noise of short calls than a feature. Kept well within the bench's 3% bar
# (:data:`~.bench.BAR_BEST`); the timings' standard error still counts beside it.
TIER_NOISE = 0.005

Key = tuple[str, str, Optional[int]]  # (impl, kind, num_sms)


def size_table(ms: Iterable[Measurement], direction: str) -> dict[Key, dict[int, float]]:
    """GB/s per route and block size from the size sweep of ``direction``."""
    out: dict[Key, dict[int, float]] = defaultdict(dict)
    for m in ms:
        if m.direction == direction and m.stage == SIZE:
            out[(m.impl, m.kind, m.num_sms)][m.block_bytes] = m.gbps
    return dict(out)


def _kernel_by_sms(table: dict[Key, dict[int, float]]) -> dict[int, dict[int, float]]:
    """The best kernel's GB/s per SM count and block size (any kernel impl)."""
    out: dict[int, dict[int, float]] = defaultdict(dict)
    for (impl, kind, sms), row in table.items():
        if kind == "kernel" and sms:
            for b, g in row.items():
                out[sms][b] = max(g, out[sms].get(b, 0.0))
    return dict(out)


def _best_batch(table: dict[Key, dict[int, float]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for (impl, kind, sms), row in table.items():
        if kind == "batch":
            for b, g in row.items():
                out[b] = max(g, out.get(b, 0.0))
    return out


def sm_knee(kernel: dict[int, dict[int, float]], sizes: Iterable[int], tolerance: float = TOLERANCE) -> int:
    """The fewest SMs whose bandwidth, as a fraction of the kernel's peak at each size in
    ``sizes``, has a geometric mean of at least ``1 - tolerance``.

    :param kernel: GB/s per SM count, then per block size.
    """
    counts = sorted(kernel)
    sizes = [b for b in sizes if any(b in kernel[k] for k in counts)]
    peak = {b: max(kernel[k].get(b, 0.0) for k in counts) for b in sizes}
    sizes = [b for b in sizes if peak[b] > 0]
    for k in counts:
        logs = [math.log(max(kernel[k].get(b, 0.0), 1e-12) / peak[b]) for b in sizes]
        if not logs or math.exp(sum(logs) / len(logs)) >= 1.0 - tolerance - 1e-12:
            return k
    return counts[-1]


def choose_routes(table: dict[Key, dict[int, float]], knee: Optional[int]) -> list[SizeRoute]:
    """The route per measured block size: batch routes and kernels bound at ``knee``,
    ranked by the resolver's rule."""
    sizes = sorted({b for row in table.values() for b in row})
    out = []
    for b in sizes:
        options = [(impl, kind, sms, g) for (impl, kind, sms), row in table.items()
                   if (g := row.get(b)) is not None and (kind == "batch" or (kind == "kernel" and sms == knee))]
        if options:
            impl, kind, sms, g = best(options)
            out.append(SizeRoute(b, impl, kind, sms, round(g, 3)))
    return out


Option = tuple[str, str, Optional[int], float]  # (impl, kind, num_sms, GB/s)


def best(options: Iterable[Option]) -> Option:
    """The route the resolver's rule (:func:`kvswap.resolution.routing.rank_key`) ranks first."""
    return min(options, key=lambda o: routing.rank_key(o[3], o[1] == "kernel", o[0]))


HostCost = dict[str, list[float]]  # one direction's [a_us, b_us] by route, as a profile's host_cost holds it


def resolver_routes(curves: list[Curve], direction: str, knee: Optional[int],
                    host_cost: Optional[HostCost] = None) -> list[ClassRoute]:
    """The route per block-size class that the resolver (:func:`kvswap.resolution.routing.routes`)
    gives routes of these names under ``curves`` and ``host_cost`` (the thread-time rule),
    kernels bound at ``knee`` SMs; runs of one route merged."""
    mine = [c for c in curves if str(c.direction) == direction]
    if not mine:
        return []
    d = Direction.parse(direction)
    kinds = {c.impl: "kernel" if c.num_sms else "batch" for c in mine}
    # Stand-ins named in the measured names' order (ties go by name), each with its curves.
    names = {impl: f"fit.route{i:04d}" for i, impl in enumerate(sorted(kinds))}
    real = {v: k for k, v in names.items()}
    usable = [CopyImpl(names[impl], kind, ("*",), (d,), _unbound) for impl, kind in kinds.items()
              if kind == "batch" or knee]
    if not usable:
        return []
    held = [(names[impl], a, b) for impl, (a, b) in (host_cost or {}).items() if impl in names]
    cal = Calibration(source="fit", platform="*", curves=tuple(
        Curve(names[c.impl], c.direction, c.points, c.num_sms) for c in mine), host_cost={direction: held})
    device = DeviceInfo(platform="*", name="fit", identity="fit", compute_units=knee or 1)
    out: list[ClassRoute] = []
    for r in routing.routes(usable, cal, d, Policy(), (), knee or 1, device):
        impl = real[r.impl]
        kind = kinds[impl]
        sms = knee if kind == "kernel" else None
        if out and (out[-1].impl, out[-1].num_sms) == (impl, sms) and out[-1].max_bytes == r.min_bytes - 1:
            out[-1] = ClassRoute(out[-1].min_bytes, r.max_bytes, impl, kind, sms)
        else:
            out.append(ClassRoute(r.min_bytes, r.max_bytes, impl, kind, sms))
    return out


def _unbound(ctx: BindContext) -> None:  # the fit ranks routes, it never binds one
    raise AssertionError("not bound")


def crossover(routes: list[ClassRoute]) -> Optional[int]:
    """The smallest block size from which a batch route is used at every larger size,
    when a kernel is used below it; None when one kind is used throughout."""
    kinds = [r.kind for r in routes]
    if "kernel" not in kinds or kinds[-1] == "kernel":
        return None
    last_kernel = max(i for i, k in enumerate(kinds) if k == "kernel")
    return routes[last_kernel + 1].min_bytes


def min_batch(points: Iterable[tuple[int, int, float, float]]) -> Optional[int]:
    """The batch size from which the kernel is used, from ``(block, n, t_kernel, t_batch)``.

    Candidates are the measured batch sizes; a threshold t sends batches of n >= t to the
    kernel. The winner minimises the summed ``t_chosen / min(t_kernel, t_batch)``; ties go
    to the larger t. Where the kernel never pays, the largest measured size is returned.
    """
    pts = list(points)
    if not pts:
        return None
    ns = sorted({n for _, n, _, _ in pts})
    best: Optional[tuple[float, int]] = None
    for t in ns + [ns[-1] + 1]:
        cost = sum((tk if n >= t else tb) / min(tk, tb) for _, n, tk, tb in pts)
        if best is None or cost < best[0] * (1 - 1e-9) or (cost <= best[0] * (1 + 1e-9) and t > best[1]):
            best = (cost, t)
    assert best is not None
    return min(best[1], ns[-1])


Timed = tuple[float, float, int]  # (median seconds, spread, repeats) of one measurement


def batch_points(ms: Iterable[Measurement], direction: str) -> list[tuple[int, int, float, float]]:
    """``(block, n, kernel seconds, batch seconds)`` from the batch sweep: the fastest of
    each kind, the kernel's taken as the batch route's where it wins by no more than
    ``KERNEL_MARGIN`` (the resolver's, for block sizes) and twice the standard error of
    the two timings: a closer call is a tie, which :func:`min_batch` gives to the route
    that takes no SMs. Tiny batches are all host work (10-20 us), whose order can move by a
    few % from one run to the next."""
    kern: dict[tuple[int, int], Timed] = {}
    dma: dict[tuple[int, int], Timed] = {}
    for m in ms:
        if m.direction != direction or m.stage != BATCH:
            continue
        into = kern if m.kind == "kernel" else dma if m.kind == "batch" else None
        if into is not None:
            key = (m.block_bytes, m.batch)
            if key not in into or m.seconds < into[key][0]:
                into[key] = (m.seconds, m.compared_spread, m.repeats)
    out = []
    for key in sorted(kern):
        if key not in dma:
            continue
        k, b = kern[key], dma[key]
        tie = b[0] / k[0] <= 1.0 + KERNEL_MARGIN + 2 * standard_error(k, b)
        out.append((*key, max(k[0], b[0]) if tie else k[0], b[0]))
    return out


def kernel_window(points: Iterable[tuple[int, int, float, float]]) -> Optional[tuple[int, int]]:
    """The batch sizes a kernel takes from the batch route at a block size the batch route
    wins at large batches, from ``(block, n, t_kernel, t_batch)``: ``(first, last)``
    measured sizes of the run of batch sizes that minimises the summed ``t_chosen /
    min(t_kernel, t_batch)``, or None where the kernel takes none. Ties go to the shorter
    run (fewer batches on SMs), then the earlier one."""
    pts = sorted((n, tk, tb) for _, n, tk, tb in points)
    if not pts:
        return None
    # What giving n to the kernel adds to the cost of leaving every batch on the batch route.
    gain = [(tk - tb) / min(tk, tb) for _, tk, tb in pts]
    best: tuple[float, int, int, int] = (0.0, 0, 0, 0)  # (added cost, length, start, end): no run
    for i in range(len(pts)):
        for j in range(i + 1, len(pts) + 1):
            key = (sum(gain[i:j]), j - i, i, j)
            if key[0] < best[0] - 1e-9 or (key[0] <= best[0] + 1e-9 and key[1:] < best[1:]):
                best = key
    _, length, i, j = best
    return (pts[i][0], pts[j - 1][0]) if length else None


def window_tiers(ns: list[int], window: Optional[tuple[int, int]], tiers: list[list[int]]) -> list[list[int]]:
    """The tiers row of a block size the batch route wins at large batches: 0 SMs outside
    ``window``, ``tiers`` (fitted over the window's batch sizes) inside; a boundary after
    the window at the geometric midpoint to the next measured size, as between tiers."""
    if window is None or not tiers:
        return [[1, 0]]
    first, last = window
    row = ([[1, 0]] if first > 1 else []) + [[max(first, n), k] for n, k in tiers]
    later = [n for n in ns if n > last]
    row.append([max(last + 1, round(math.sqrt(last * later[0]))) if later else last + 1, 0])
    merged: list[list[int]] = []
    for n, k in row:
        if merged and merged[-1][0] == n:
            merged[-1][1] = k
        elif not merged or merged[-1][1] != k:
            merged.append([n, k])
    return merged


def kernel_batch_times(ms: Iterable[Measurement], direction: str) -> dict[int, dict[int, dict[int, Timed]]]:
    """The fastest kernel impl's ``(seconds, spread, repeats)`` per block size, batch size
    and SM count, from the batch sweep of ``direction``."""
    out: dict[int, dict[int, dict[int, Timed]]] = defaultdict(lambda: defaultdict(dict))
    for m in ms:
        if m.direction == direction and m.stage == BATCH and m.kind == "kernel" and m.num_sms:
            row = out[m.block_bytes][m.batch]
            if m.num_sms not in row or m.seconds < row[m.num_sms][0]:
                row[m.num_sms] = (m.seconds, m.compared_spread, m.repeats)
    return {b: dict(rows) for b, rows in out.items()}


def sms_by_batch(times: dict[int, dict[int, Timed]], floor: int = 1) -> list[list[int]]:
    """SM tiers for one block size: ``[[from_batch, num_sms], ...]``.

    :param times: ``(seconds, spread, repeats)`` per batch size, then per SM count (counts
        below ``floor``, the knee, are not considered).
    :return: per measured batch size, the fewest SMs within the standard error of the two
        measurements of the fastest count there (SMs are taken for a gain the timings show,
        not for a lucky draw); then a batch size whose count differs from that of both its
        neighbours, which agree, takes theirs where that is within ``TIER_NOISE`` (and the
        noise) of the fastest; runs of one count make a tier, which starts at the geometric
        midpoint between the last batch size of the tier before and its own first.
    """
    rows = {n: {k: t for k, t in row.items() if k >= floor} for n, row in times.items()}
    ns = sorted(n for n, row in rows.items() if row)
    if not ns:
        return []

    def within(n: int, k: int, slack: float) -> bool:
        row = rows[n]
        if k not in row:
            return False
        best = min(row.values())
        return best[0] / row[k][0] >= 1.0 - slack - standard_error(best, row[k]) - 1e-12

    pick = [min(k for k in rows[n] if within(n, k, 0.0)) for n in ns]
    for i in range(1, len(ns) - 1):
        other = pick[i - 1]
        if pick[i + 1] == other != pick[i] and within(ns[i], other, TIER_NOISE):
            pick[i] = other
    tiers = [[1, pick[0]]]
    for i in range(1, len(ns)):
        if pick[i] != pick[i - 1]:
            tiers.append([max(ns[i - 1] + 1, round(math.sqrt(ns[i - 1] * ns[i]))), pick[i]])
    return tiers


def fit_direction(ms: list[Measurement], direction: str, tolerance: float = TOLERANCE,
                  host_cost: Optional[HostCost] = None) -> Decision:
    """Everything decided for one direction from its measurements (see the module doc);
    the class routes under the thread-time rule where ``host_cost`` is given."""
    table = size_table(ms, direction)
    kernel = _kernel_by_sms(table)
    batch = _best_batch(table)
    knee = peak_sms = None
    if kernel:
        sizes = sorted({b for row in kernel.values() for b in row})
        peak = {b: max(kernel[k].get(b, 0.0) for k in kernel) for b in sizes}
        winning = [b for b in sizes if peak[b] > batch.get(b, 0.0)]
        knee = sm_knee(kernel, winning or sizes, tolerance)
        peak_sms = max(kernel, key=lambda k: (sum(kernel[k].get(b, 0.0) for b in winning or sizes), -k))
    by_size = choose_routes(table, knee)
    # Staged routes take a mover's block-major host side, not raw batches: not in the ranking.
    routes = resolver_routes(curves(m for m in ms if m.direction == direction and m.kind != "staged"), direction,
                             knee, host_cost)
    uses_kernel = [r for r in by_size if r.kind == "kernel"]
    out = Decision(
        knee_tolerance=tolerance,
        by_size=by_size,
        routes=routes,
        crossover_bytes=crossover(routes),
        kernel_impl=max({r.impl for r in uses_kernel}, key=lambda i: sum(r.impl == i for r in uses_kernel),
                        default=None),
        kernel_sms=knee,
        kernel_peak_sms=peak_sms,
    )
    points = batch_points(ms, direction)
    kernel_sizes = {r.block_bytes for r in uses_kernel}
    if uses_kernel:
        out.kernel_min_batch = min_batch(p for p in points if p[0] in kernel_sizes)
        for b in sorted({p[0] for p in points} & kernel_sizes):
            out.min_batch_by_size.append([b, min_batch(p for p in points if p[0] == b)])
    kernel_from = dict(out.min_batch_by_size)
    for b, rows in sorted(kernel_batch_times(ms, direction).items()):
        if b in kernel_sizes:
            used = {n: row for n, row in rows.items() if n >= kernel_from.get(b, 1)}
            tiers = sms_by_batch(used, knee or 1)
        else:  # the batch route's size: the kernel only inside its window
            mine = [p for p in points if p[0] == b]
            window = kernel_window(mine)
            inside = {n: row for n, row in rows.items() if window and window[0] <= n <= window[1]}
            tiers = window_tiers(sorted(p[1] for p in mine), window, sms_by_batch(inside, knee or 1))
        if tiers:
            out.kernel_sms_by_batch.append([b, tiers])
    return out


def curves(ms: Iterable[Measurement]) -> list[Curve]:
    """The profile's curves: GB/s against block size per route (and SM count), size sweep."""
    rows: dict[tuple[str, str, Optional[int]], dict[int, float]] = defaultdict(dict)
    for m in ms:
        if m.stage == SIZE:
            rows[(m.direction, m.impl, m.num_sms)][m.block_bytes] = m.gbps
    return [
        Curve(impl, Direction.parse(d), tuple((b, round(g, 3)) for b, g in sorted(pts.items())), sms)
        for (d, impl, sms), pts in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0))
    ]


def ceilings(ms: Iterable[Measurement]) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in ms:
        if m.stage == CEILING:
            out[m.direction] = max(round(m.gbps, 3), out.get(m.direction, 0.0))
    return out


def carried(prior: Calibration, direction: str) -> Decision:
    """What ``prior`` decided for ``direction``, for a run that did not measure it."""
    return Decision(
        carried_from=prior.source,
        kernel_sms=prior.kernel_sms.get(direction),
        kernel_min_batch=prior.kernel_min_batch.get(direction),
        min_batch_by_size=[list(p) for p in prior.min_batch_by_size.get(direction, ())],
        kernel_sms_by_batch=[[b, [list(t) for t in tiers]] for b, tiers in prior.kernel_sms_by_batch.get(direction, ())],
    )


def profile_fields(
    ms: list[Measurement],
    interference: list[dict[str, Any]],
    directions: Iterable[str],
    prior: Optional[Calibration] = None,
    tolerance: float = TOLERANCE,
    host_cost: Optional[dict[str, HostCost]] = None,
    staged: Optional[dict[str, Any]] = None,
    served: Optional[set[str]] = None,
) -> Fitted:
    """``curves``, ``decisions``, ``ceiling_gbps``, ``slowdown_by_sms`` and ``host_cost``
    of a profile.

    :param interference: records of :func:`kvswap.calibration.step_interference.measure`.
    :param host_cost: a profile's ``host_cost`` (:func:`kvswap.calibration.host_cost.profile_field`).
    :param staged: a profile's ``staged`` section (:func:`kvswap.calibration.staged.profile_section`).

    Directions not measured in this run, and the slowdown and host cost where they were not
    measured, are carried over from ``prior`` (the calibration in force before), each saying
    so, so a partial run never leaves a direction with nothing to rank by; with ``served``,
    only the directions named there (those a usable route of the device copies).
    """
    measured = [str(Direction.parse(d)) for d in directions]
    held = host_cost if host_cost else (
        {d: {r: [a, b] for r, a, b in rows} for d, rows in prior.host_cost.items()} if prior else {})
    decisions = {d: fit_direction(ms, d, tolerance, held.get(d)) for d in measured}
    out_curves = curves(ms)
    ceiling = ceilings(ms)
    if prior is not None:
        known = {str(c.direction) for c in prior.curves} | set(prior.kernel_sms)
        for d in (str(x) for x in Direction if x.crosses_host or str(x) in known):
            if d in decisions or (served is not None and d not in served):
                continue
            out_curves += [c for c in prior.curves if str(c.direction) == d]
            decisions[d] = carried(prior, d)
            if d in prior.ceiling_gbps:
                ceiling[d] = prior.ceiling_gbps[d]
    from .step_interference import profile_rows  # the one measurement of compute slowdown

    rows = profile_rows(interference)
    if rows:
        slow_source = SLOWDOWN_MEASURED
    else:
        rows = {d: [list(r) for r in v] for d, v in prior.slowdown_by_sms.items()} if prior else {}
        slow_source = carried_from("--interference", prior if rows else None)
    host_source = HOST_COST_MEASURED if host_cost else carried_from("host-cost", prior if held else None)
    return Fitted(curves=out_curves, decisions=decisions, ceiling_gbps=ceiling, slowdown_by_sms=rows,
                  slowdown_source=slow_source, host_cost=held, host_cost_source=host_source, staged=staged or {})


SLOWDOWN_MEASURED = ("measured beside compute (bf16 GEMMs on an accelerator) started together with a BlockMover job, "
                     "as an engine runs them")
HOST_COST_MEASURED = ("measured: one call per route timed on the calling thread, the transfer stream kept busy, "
                      "over per-layer tensors on both sides (a staged route: per-layer device tensors and a "
                      "block-major host cache, called by ids as a BlockMover calls it)")


def carried_from(what: str, prior: Optional[Calibration]) -> str:
    """Where a field this run did not measure came from, in words."""
    if prior is None:
        return f"not measured (kvswap calibrate measures it: {what})"
    return f"not measured in this run; carried from {prior.source}"

