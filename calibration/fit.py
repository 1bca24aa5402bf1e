"""Turn measurements into decisions: pure functions, no device, no I/O.

Per direction:

* **SM knee**: the fewest SMs at which the kernel stays within ``tolerance`` of its own
  peak (over every SM count measured), on the geometric mean of its fraction of that peak
  over the block sizes where, at the peak, it beats the best batch route. A mean, not
  every size: one noisy point, or the 1 KiB blocks that need many SMs, would otherwise
  buy the whole range its SMs (seen on the H200: a knee of 48 SMs for a 3% shortfall at
  one size). Fewer SMs leave more for compute (FACTS.md: a copy kernel on 8 SMs cost a
  GEMM up to 57%), so nothing beyond the knee is worth taking.
* **Route per block size**: the fastest of the batch routes and the kernel *at the knee*,
  where the kernel must be faster by more than ``KERNEL_MARGIN`` (the resolver's rule:
  ties, and near-ties, go to the route that takes no SMs). ``by_size`` says it for each
  measured size;
  ``routes`` for each of the resolver's block-size classes, ranked from the curves the
  profile holds exactly as the resolver ranks them, so ``explain()`` shows what the fit
  decided.
* **Minimum batch**: the batch-size threshold under which the batch route is used
  instead of the kernel, chosen to minimise the summed slowdown against the faster of
  the two over the measured batch sizes; ties go to the larger threshold. A batch size
  where the kernel wins by less than ``KERNEL_MARGIN`` and the timings' noise counts as
  a tie. One noisy point cannot move it the way "first batch where the kernel won" would. It is fitted per
  measured block size (``min_batch_by_size``, which the resolver interpolates: the
  threshold moves with the block size by an order of magnitude) and over all of them
  (``kernel_min_batch``, for readers that take one number).
* **SM tiers by batch size**: the knee is fitted where the batch is large enough to fill
  the link; a medium batch (the H200: 1-16 KiB blocks, 0.5-16 MiB per transfer) finishes
  up to 30% sooner on more SMs. Per measured block size, over the batch sizes the kernel
  is used for, a step function from batch size to SM count (``kernel_sms_by_batch``): the
  fewest SMs the timings cannot tell from the fastest count measured at each batch size,
  where one noisy batch size cannot open a tier of its own (see :func:`sms_by_batch`).
* **The kernel's batch window where the batch route is the route**: the route per block
  size is fitted at a large batch, where the batch route can win a block size whose small
  batches a kernel on more SMs still copies sooner (the H100: 512 KiB blocks in batches of
  1-64 took up to 1.6x as long on the batch route as on the kernel on 24 SMs). Per such
  measured size, the batch sizes the kernel takes (:func:`kernel_window`, a tie going to
  the batch route), with their SM tiers, and 0 SMs (the batch route) for the others: the
  row ``[[1, 0], [4, 24], [181, 0]]`` gives batches of 4-180 to the kernel on 24 SMs. A
  size where the kernel takes no batch gets ``[[1, 0]]``.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Optional

from kvswap.routing import KERNEL_MARGIN, SIZE_CLASSES
from kvswap.thresholds import Calibration, Curve
from kvswap.types import Direction

from .records import BATCH, CEILING, SIZE, Interference, Measurement
from .timing import standard_error

# "Within a few % of peak": what the knee may give up for fewer SMs, on the geometric mean
# over the kernel's block sizes (:func:`sm_knee`), so one size may fall further behind.
TOLERANCE = 0.05

# A batch-size tier takes the fewest SMs the timings cannot tell from the fastest count
# measured there (their standard error), and gives up nothing more for fewer SMs. Tiers are
# the throughput policy's (``Policy(prefer="low_interference")`` keeps the knee). A slack of
# 1% (session 5) kept medium batches 1-1.5% behind the peer's kernel on 12 SMs; one of 0.5%
# (sessions 6-8) kept the H100's host-to-device 8 KiB x 256 on 24 SMs, 3-5% behind 32 in
# three benches, and device-to-host 8 KiB x 10000 on 16, 5% behind 24 when timed again.
# Without a slack the shipped profiles resolve those on the faster count, and fewer points
# under 0.97 x the best in two of the four H100 benches of sessions 7-8 (as many in the
# other two and in both H200 benches), for 0.9-1.5 more SMs a call on average over the
# bench's points (docs/results/session8/tier-slack.txt).
#
# A batch size whose fewest SMs differ from both neighbours' takes theirs when that count is
# within TIER_NOISE of the fastest there: one tier for one batch size is more likely the
# run-to-run noise of short calls than a feature. At 2%, this gave the H100 two points
# 3.4-3.8% behind the best count in the bench (device->host 8 KiB x 64 on 6 SMs where 12 were
# 1% behind 16; session 6): the slack now stays within a sixth of the bench's 3% bar, and the
# timings' standard error still counts beside it.
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


def choose_routes(table: dict[Key, dict[int, float]], knee: Optional[int]) -> list[dict[str, Any]]:
    """The route per measured block size: batch routes and kernels bound at ``knee``."""
    sizes = sorted({b for row in table.values() for b in row})
    out = []
    for b in sizes:
        rows = [
            (-(g / (1.0 + KERNEL_MARGIN) if kind == "kernel" else g), kind == "kernel", impl, kind, sms, g)
            for (impl, kind, sms), row in table.items()
            if (g := row.get(b)) is not None and (kind == "batch" or (kind == "kernel" and sms == knee))
        ]
        if not rows:
            continue
        _, _, impl, kind, sms, g = min(rows)
        out.append({"block_bytes": b, "impl": impl, "kind": kind, "num_sms": sms, "gbps": round(g, 3)})
    return out


def resolver_routes(curve_docs: list[dict[str, Any]], direction: str, knee: Optional[int]) -> list[dict[str, Any]]:
    """The route per block-size class exactly as the resolver will rank ``curve_docs``
    (its classes, its representative size per class, its interpolation, its tie-break:
    no SMs first, then the name), kernels at ``knee`` SMs; runs of one route merged."""
    mine = [c for c in curve_docs if c["direction"] == direction]
    if not mine:
        return []
    cal = Calibration(source="fit", platform="*", curves=tuple(
        Curve(c["impl"], direction, tuple(map(tuple, c["points"])), c.get("num_sms")) for c in mine))
    routes = {(c["impl"], "kernel" if c.get("num_sms") else "batch") for c in mine}
    out: list[dict[str, Any]] = []
    for lo, hi, rep in SIZE_CLASSES:
        ranked = []
        for impl, kind in routes:
            sms = knee if kind == "kernel" else None
            if kind == "kernel" and not knee:
                continue
            g = cal.predict(impl, kind, Direction.parse(direction), rep, sms)
            if g is not None:
                rank = g / (1.0 + KERNEL_MARGIN) if kind == "kernel" else g
                ranked.append((-rank, kind == "kernel", impl, kind, sms))
        if not ranked:
            continue
        _, _, impl, kind, sms = min(ranked)
        if out and (out[-1]["impl"], out[-1]["num_sms"]) == (impl, sms):
            out[-1]["max_bytes"] = hi
        else:
            out.append({"min_bytes": lo, "max_bytes": hi, "impl": impl, "kind": kind, "num_sms": sms})
    return out


def crossover(routes: list[dict[str, Any]]) -> Optional[int]:
    """The smallest block size from which a batch route is used at every larger size,
    when a kernel is used below it; None when one kind is used throughout."""
    kinds = [r["kind"] for r in routes]
    if "kernel" not in kinds or kinds[-1] == "kernel":
        return None
    last_kernel = max(i for i, k in enumerate(kinds) if k == "kernel")
    return routes[last_kernel + 1]["min_bytes"]


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
    that takes no SMs. Tiny batches are all host work (10-20 us), and their order moved by
    up to 5% between two runs on the H200."""
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


def fit_direction(ms: list[Measurement], direction: str, tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Everything decided for one direction from its measurements (see the module doc)."""
    table = size_table(ms, direction)
    kernel = _kernel_by_sms(table)
    batch = _best_batch(table)
    out: dict[str, Any] = {"knee_tolerance": tolerance}
    knee = peak_sms = None
    if kernel:
        sizes = sorted({b for row in kernel.values() for b in row})
        peak = {b: max(kernel[k].get(b, 0.0) for k in kernel) for b in sizes}
        winning = [b for b in sizes if peak[b] > batch.get(b, 0.0)]
        knee = sm_knee(kernel, winning or sizes, tolerance)
        peak_sms = max(kernel, key=lambda k: (sum(kernel[k].get(b, 0.0) for b in winning or sizes), -k))
    by_size = choose_routes(table, knee)
    routes = resolver_routes(curves(m for m in ms if m.direction == direction), direction, knee)
    uses_kernel = [r for r in by_size if r["kind"] == "kernel"]
    out.update(
        by_size=by_size,
        routes=routes,
        crossover_bytes=crossover(routes),
        kernel_impl=max(
            {r["impl"] for r in uses_kernel}, key=lambda i: sum(r["impl"] == i for r in uses_kernel), default=None
        ),
        kernel_sms=knee,
        kernel_peak_sms=peak_sms,
        kernel_min_batch=None,
        min_batch_by_size=[],
        kernel_sms_by_batch=[],
    )
    points = batch_points(ms, direction)
    kernel_sizes = {r["block_bytes"] for r in uses_kernel}
    if uses_kernel:
        out["kernel_min_batch"] = min_batch(p for p in points if p[0] in kernel_sizes)
        for b in sorted({p[0] for p in points} & kernel_sizes):
            out["min_batch_by_size"].append([b, min_batch(p for p in points if p[0] == b)])
    kernel_from = dict(out["min_batch_by_size"])
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
            out["kernel_sms_by_batch"].append([b, tiers])
    return out


def curves(ms: Iterable[Measurement]) -> list[dict[str, Any]]:
    """The profile's curves: GB/s against block size per route (and SM count), size sweep."""
    rows: dict[tuple[str, str, Optional[int]], dict[int, float]] = defaultdict(dict)
    for m in ms:
        if m.stage == SIZE:
            rows[(m.direction, m.impl, m.num_sms)][m.block_bytes] = m.gbps
    return [
        {"impl": impl, "direction": d, "num_sms": sms, "points": [[b, round(g, 3)] for b, g in sorted(pts.items())]}
        for (d, impl, sms), pts in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0))
    ]


def ceilings(ms: Iterable[Measurement]) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in ms:
        if m.stage == CEILING:
            out[m.direction] = max(round(m.gbps, 3), out.get(m.direction, 0.0))
    return out


def slowdown(records: Iterable[Interference], decisions: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Slowdown per impl, and per kind, as the resolver reads them: a kernel at the SM
    count the resolver binds it with (the knee), a batch route as measured; the worse
    direction counts (the resolver has one number per impl)."""
    out: dict[str, float] = {}
    for r in records:
        if r.kind not in ("batch", "kernel"):
            continue
        if r.kind == "kernel" and r.num_sms != decisions.get(r.direction, {}).get("kernel_sms"):
            continue
        v = min(max(r.slowdown, 0.0), 0.99)
        for key in (r.impl, r.kind):
            out[key] = round(max(v, out.get(key, 0.0)), 4)
    return out


def profile_fields(
    ms: list[Measurement],
    records: list[Interference],
    directions: Iterable[str],
    prior: Optional[Calibration] = None,
    tolerance: float = TOLERANCE,
) -> dict[str, Any]:
    """``curves``, ``decisions``, ``ceiling_gbps`` and ``slowdown`` of a profile.

    Directions not measured in this run, and the slowdown when interference was not
    measured, are carried over from ``prior`` (the calibration in force before), each
    saying so, so a partial run never leaves a direction with nothing to rank by.
    """
    measured = [str(Direction.parse(d)) for d in directions]
    decisions = {d: fit_direction(ms, d, tolerance) for d in measured}
    out_curves = curves(ms)
    ceiling = ceilings(ms)
    fields: dict[str, Any] = {}
    if prior is not None:
        carried = {str(c.direction) for c in prior.curves} | set(prior.kernel_sms)
        for d in (str(x) for x in Direction if x.crosses_host or str(x) in carried):
            if d in decisions:
                continue
            out_curves += [
                {"impl": c.impl, "direction": d, "num_sms": c.num_sms, "points": [list(p) for p in c.points]}
                for c in prior.curves if str(c.direction) == d
            ]
            decisions[d] = {
                "carried_from": prior.source,
                "kernel_sms": prior.kernel_sms.get(d),
                "kernel_min_batch": prior.kernel_min_batch.get(d),
                "min_batch_by_size": [list(p) for p in prior.min_batch_by_size.get(d, ())],
                "kernel_sms_by_batch": [[b, [list(t) for t in tiers]] for b, tiers in prior.kernel_sms_by_batch.get(d, ())],
            }
            if d in prior.ceiling_gbps:
                ceiling[d] = prior.ceiling_gbps[d]
    measured_slowdown = slowdown(records, decisions)
    if records:
        fields["slowdown_source"] = "measured beside a reference GEMM in this run"
        fields["slowdown"] = measured_slowdown
    else:
        fields["slowdown_source"] = f"not measured (run with --interference); carried from {prior.source}" if prior else "not measured"
        fields["slowdown"] = dict(prior.slowdown) if prior else {}
    fields.update(curves=out_curves, decisions=decisions, ceiling_gbps=ceiling)
    return fields
