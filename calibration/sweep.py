"""The measurement grid of ``kvswap calibrate``, run on the present device.

Stages, per direction: the contiguous ceiling; every available route over block sizes at
a large batch (kernels at several SM counts); then, at the block sizes where the kernel
wins at its SM knee, and at those where the batch route wins, the kernel at the knee and at
a few multiples of it (``tier_sms``) against the best batch route over batch sizes (the
minimum batch and the SM tiers by batch size; where the batch route wins, the batch sizes
the kernel still takes); last, the ceiling again, with a note where it moved (:meth:`Sweep.steady`). Routes are bound
through ``kvswap.resolve(..., policy=Policy(force=name))`` exactly as an engine gets them,
given a calibration that binds kernels at exactly the SM count being measured
(:mod:`.binding`). A route that raises or copies the wrong bytes is recorded as a failure
and left out; the run goes on.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from kvswap import DeviceInfo, Direction, KvSwapError, resolve
from kvswap.registry.platform import detect
from kvswap.registry.plugins import PluginHost, plugin_host

from . import fit
from .binding import Bound, Failures, bound_at
from .progress import Progress
from .records import BATCH, CEILING, SIZE, Failure, Measurement
from .timing import HostTimer, in_passes, make_timer, median, on_host, per_pass, pooled, round_ratios, rounds_for, spread
from .workload import Batch, Pools

KiB, MiB = 1024, 1 << 20


def grid_sizes(lo: int = KiB, hi: int = 512 * KiB, midpoints: bool = True) -> tuple[int, ...]:
    """Powers of two from ``lo`` to ``hi`` and, with ``midpoints``, 1.5x each of them."""
    out = set()
    b = lo
    while b <= hi:
        out.add(b)
        if midpoints and 3 * b // 2 <= hi:
            out.add(3 * b // 2)
        b *= 2
    return tuple(sorted(out))


@dataclass(frozen=True)
class Settings:
    """The grid and effort of a run (see :func:`settings_for` for the defaults)."""

    block_sizes: tuple[int, ...]
    sm_counts: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    batch_sweep_blocks: Optional[int]  # how many of the kernel's block sizes; None: all
    size_sweep_bytes: int
    max_batch: int
    pool_bytes: int
    ceiling_bytes: int
    repeats: int
    warmup: int
    tier_counts: int = 1  # SM counts the batch sweep measures: the knee and multiples (TIER_FACTORS)
    batch_repeats: Optional[int] = None  # timed rounds per batch-sweep point (None: repeats)
    # More rounds for short batch-sweep points, up to about this many seconds each and
    # batch_max_repeats rounds (timing.rounds_for); 0: exactly batch_repeats.
    batch_point_seconds: float = 0.0
    batch_max_repeats: int = 0
    # The batch sweep runs its whole grid this many times, each point a fresh draw of
    # slots; the rounds and seconds above are shared among the passes. A slow spell of the
    # machine (about a second, every route slowed unevenly) or an unlucky draw of slots (the
    # batch route's time moves with the slots by a few %) can set one point off; passes
    # outvote it, with routes compared round by round (Sweep.record).
    batch_passes: int = 1
    # The size sweep likewise, with ``repeats`` shared among its passes. Its calls are long
    # (milliseconds), so a point gets one or two rounds a pass, and a slow spell that catches
    # some of a size's routes and not the others can set them 10-40% off, enough to move the
    # knee where it sits near the edge of its tolerance.
    size_passes: int = 1
    knee_tolerance: float = fit.TOLERANCE
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# A point whose timings stray by more than this (the median over its routes of the MAD as a
# fraction of the median) was most likely disturbed while it ran: timed once more, and the
# steadier of the two kept. Undisturbed GPU points stray by a few %; a disturbed one can put
# a route 20% off and hand its batch size to the wrong route.
RETRY_SPREAD = 0.08

# The SM counts of the batch sweep, as multiples of the knee: the knee, then ever wider
# steps (medium batches can gain up to several times the knee's SMs; 12 is a count engines
# commonly run a copy kernel on).
TIER_FACTORS = (1, 2, 3, 4, 6, 8, 12)
# How far apart a direction's ceiling may come out at its start and its end before the run
# says the machine was not steady (a PCIe link's contiguous copy repeats within a few %).
CEILING_DRIFT = 0.05


def tier_sms(sm_counts: Sequence[int], knee: int, count: int) -> list[int]:
    """``count`` of ``sm_counts``: the knee and those nearest to its multiples in
    ``TIER_FACTORS`` (over log SMs), never below the knee."""
    above = [k for k in sm_counts if k >= knee]
    out: list[int] = []
    for f in TIER_FACTORS:
        if len(out) >= count or not above:
            break
        k = min(above, key=lambda c: (abs(math.log(c / (knee * f))), c))
        if k not in out:
            out.append(k)
    return sorted(out)


def _sm_counts(base: Sequence[int], device: DeviceInfo, max_sms: Optional[int]) -> tuple[int, ...]:
    cap = device.compute_units or max(base)
    if max_sms is not None:
        cap = min(cap, max_sms)
    counts = {k for k in base if k <= cap}
    if cap >= 1:
        counts.add(cap)  # the whole budget: the peak the knee is measured against
    return tuple(sorted(counts))


def settings_for(device: DeviceInfo, quick: bool = False, max_sms: Optional[int] = None,
                 knee_tolerance: float = fit.TOLERANCE) -> Settings:
    """Defaults: ``quick`` about a minute on a GPU, the full grid under ten; on a CPU-only
    machine small pools and batches, since the host reference copies one block at a time."""
    if on_host(device):
        return Settings(
            block_sizes=grid_sizes(midpoints=not quick),
            sm_counts=_sm_counts((1, 2, 4, 8), device, max_sms),
            batch_sizes=(1, 4, 16, 64, 256) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
            batch_sweep_blocks=4 if quick else None,
            tier_counts=2 if quick else 3,
            size_sweep_bytes=(4 if quick else 32) * MiB,
            max_batch=256 if quick else 2048,
            pool_bytes=(16 if quick else 64) * MiB,
            ceiling_bytes=(8 if quick else 32) * MiB,
            repeats=3 if quick else 5,
            warmup=1,
            knee_tolerance=knee_tolerance,
        )
    return Settings(
        block_sizes=grid_sizes(midpoints=not quick),
        # 1 SM is left out: a kernel that slow would spend most of the run's time and is
        # never the knee of a kernel worth having (2 SMs already come near a PCIe link).
        sm_counts=_sm_counts((2, 4, 8, 16, 32) if quick else (2, 4, 6, 8, 12, 16, 24, 32, 48), device, max_sms),
        batch_sizes=(1, 4, 16, 64, 256, 1024, 4096) if quick
        else (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 10000),
        batch_sweep_blocks=4 if quick else None,
        # Medium batches can want several times the knee's SMs (tier_sms).
        tier_counts=3 if quick else 5,
        # Batch-sweep calls are short (10 us-1 ms) and stray by 3-7% from call to call: more
        # rounds, so a gain of 1% stands out of the noise (the fit weighs the spread).
        batch_repeats=15 if quick else 41,
        batch_point_seconds=0.01 if quick else 0.04,
        batch_max_repeats=101 if quick else 601,
        batch_passes=1 if quick else 3,
        size_passes=1 if quick else 3,
        size_sweep_bytes=(64 if quick else 256) * MiB,
        max_batch=10000,
        pool_bytes=(512 if quick else 1024) * MiB,
        ceiling_bytes=(128 if quick else 512) * MiB,
        repeats=5 if quick else 10,
        warmup=2 if quick else 3,
        knee_tolerance=knee_tolerance,
    )


@dataclass
class SweepResult:
    device: DeviceInfo
    settings: Settings
    directions: list[str]
    timer: str
    measurements: list[Measurement] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def host_only(self) -> bool:
        return on_host(self.device)


class Sweep:
    """One calibration run on one device, ready to run once constructed: the device
    detected, the pools filled, every route bound (:attr:`bounds`); :meth:`run` measures
    them stage by stage into :attr:`result`.

    :param timer: what times the copies (default: :func:`~.timing.make_timer` for the device).
    """

    def __init__(self, device: Any, settings: Settings, directions: Sequence[Any], *,
                 host: Optional[PluginHost] = None, progress: Optional[Progress] = None,
                 timer: Any = None) -> None:
        self.spec = device
        self.host = plugin_host() if host is None else host
        self.dev = detect(self.host, device)
        self.settings = settings
        self.directions = [Direction.parse(d) for d in directions]
        self.progress = progress or Progress()
        self.timer = make_timer(self.dev) if timer is None else timer
        self.result = SweepResult(self.dev, settings, [str(d) for d in self.directions], self.timer.label)
        self.failures = Failures(self.result.failures)
        self.bounds: dict[Direction, list[Bound]] = {d: self.bind(d) for d in self.directions}
        self.pools = Pools(self.dev, settings.pool_bytes, settings.seed)

    # -- binding -------------------------------------------------------------------------
    def bind(self, direction: Direction) -> list[Bound]:
        """Every usable route for ``direction``; kernels once per SM count."""
        try:
            plan = resolve(direction, device=self.spec, host=self.host, profiles=False).plan
        except KvSwapError as e:
            self.failures.add(direction, "resolve", None, None, e)
            return []
        out = []
        for c in plan.candidates:
            if not c.available:
                self.result.notes.append(f"{direction}: {c.name} not measured: {c.reason}")
                continue
            if c.kind == "staged":  # measured by chunk size on the block-major host it serves (.staged)
                continue
            counts: Sequence[Optional[int]] = self.settings.sm_counts if c.kind == "kernel" else (None,)
            if c.kind == "kernel" and not counts:
                self.result.notes.append(f"{direction}: {c.name} not measured: no SM budget (--max-sms 0)")
            for k in counts:
                try:
                    fn = bound_at(direction, self.dev, self.spec, self.host, c.name, k)
                    got = fn.plan.params.get(c.name, {}).get("num_sms")
                    if k is not None and got != k:
                        raise KvSwapError(f"resolve bound it with num_sms={got!r}, not {k}")
                except Exception as e:
                    self.failures.add(direction, c.name, k, None, e)
                    continue
                out.append(Bound(c.name, c.kind, k, fn, dict(c.constraints)))
        return out

    # -- measuring -----------------------------------------------------------------------
    def _checked(self, bound: Bound, batch: Batch) -> bool:
        """Copy once into poisoned destinations and compare; a failure retires the route."""
        try:
            self.pools.verify(self.timer, bound.call(batch.src, batch.dst, batch.sizes), batch)
        except Exception as e:
            self.failures.add(batch.direction, bound.impl, bound.num_sms, batch.block_bytes, e)
            return False
        return True

    def record(self, stage: str, batch: Batch, runs: Sequence[tuple[Bound, list[list[float]]]]) -> list[Measurement]:
        """One measurement per route of its timings, taken side by side with the other
        routes' in one pass or several, at ``batch``'s direction, block size and batch size.

        What the fit reads is how the routes compare, so their seconds are put on one
        footing: a reference route's own (:func:`~.timing.pooled`; the first batch route,
        else the first route) times the median of each route's ratio to it, round by round
        (:func:`~.timing.round_ratios`). Routes timed in the same rounds met the same state
        of the machine, which can move every route by 10-40%, unevenly, from one minute to
        the next. ``spread`` stays each route's own;
        ``paired_spread`` is that of its ratio to the reference, which the fit weighs
        comparisons by (0 for the reference)."""
        d = str(batch.direction)
        ref = next((p for b, p in runs if b.kind == "batch"), runs[0][1] if runs else None)
        ref_seconds = pooled(ref)[0] if ref is not None else 0.0
        out = []
        for b, passes in runs:
            seconds, spread_, repeats = pooled(passes)
            ratios = round_ratios(passes, ref) if ref is not None and passes is not ref else []
            if ratios:
                seconds = ref_seconds * median(ratios)
            out.append(Measurement(d, stage, b.impl, b.kind, b.num_sms, batch.block_bytes, batch.n, seconds, repeats,
                                   round(spread_, 5), round(spread(ratios), 5) if ratios else 0.0))
        self.result.measurements.extend(out)
        return out

    def timings(self, bounds: Sequence[Bound], batch: Batch, repeats: Optional[int] = None,
                point_seconds: float = 0.0, max_repeats: int = 0) -> list[tuple[Bound, list[float]]]:
        """Seconds per call of every route in ``bounds`` on ``batch``, interleaved
        (``repeats`` rounds, default the settings', or more for short calls:
        :func:`~.timing.rounds_for`); retired routes skipped, failing ones retired."""
        d = str(batch.direction)
        live = [b for b in bounds if not self.failures.retired(d, b) and b.accepts(batch.block_bytes)]
        live = [b for b in live if self._checked(b, batch)]
        if not live:
            return []
        s = self.settings
        calls = [b.call(batch.src, batch.dst, batch.sizes) for b in live]
        repeats = repeats or s.repeats
        try:
            repeats = rounds_for(self.timer, calls, repeats, point_seconds, max_repeats, s.warmup)
            times = self.timer.measure(calls, repeats, s.warmup)
            if median([spread(t) for t in times]) > RETRY_SPREAD:  # disturbed: once more, the steadier kept
                again = self.timer.measure(calls, repeats, s.warmup)
                if median([spread(t) for t in again]) < median([spread(t) for t in times]):
                    times = again
        except Exception:
            times = []  # one of them failed mid-run: time them one by one to find which
            for b in list(live):
                try:
                    times.append(self.timer.measure([b.call(batch.src, batch.dst, batch.sizes)], repeats, s.warmup)[0])
                except Exception as e:
                    self.failures.add(batch.direction, b.impl, b.num_sms, batch.block_bytes, e)
                    live.remove(b)
        return list(zip(live, times))

    def ceiling(self, direction: Direction) -> float:
        """The contiguous copy's GB/s, recorded (the profile's ceiling is the best of a
        direction's)."""
        nbytes = min(self.settings.ceiling_bytes, self.pools.pool_bytes)
        t = self.timer.measure([self.pools.contiguous(direction, nbytes)], self.settings.repeats, self.settings.warmup)[0]
        m = Measurement(str(direction), CEILING, "contiguous", "ceiling", None, nbytes, 1, median(t), len(t))
        self.result.measurements.append(m)
        return m.gbps

    def steady(self, direction: Direction, start: float, end: float) -> None:
        """A note when the contiguous copy ran more than ``CEILING_DRIFT`` apart at the start
        and the end of a direction: the machine changed under the run, and decisions fitted
        while it was slow may not hold once it is not. Not where the host clock times host
        copies (the host reference): a memcpy of a few MiB moves with the caches from one
        call to the next, and nothing is decided by it there."""
        if not isinstance(self.timer, HostTimer) and min(start, end) < (1.0 - CEILING_DRIFT) * max(start, end):
            self.result.notes.append(
                f"{direction}: the contiguous copy ran at {start:.1f} GB/s at the start and {end:.1f} GB/s at the "
                f"end of this direction's run: the machine was not steady, so the decisions fitted from it may "
                f"not hold; calibrate again when it is idle")

    def sweep_points(self, stage: str, direction: Direction, contenders_at: dict[tuple[int, int], list[Bound]],
                     passes: int, repeats: int, seconds: float = 0.0, most: int = 0) -> None:
        """Time each ``(block, batch)`` point's contenders ``passes`` times over, the whole
        grid before any point again and a fresh draw of slots every time, and record them
        (:meth:`record`); a route retired in a later pass keeps none of its passes."""
        d, what = str(direction), "block sizes" if stage == SIZE else "batch sizes"
        drawn: dict[tuple[int, int], Batch] = {}

        def time_point(point: tuple[int, int], i: int) -> dict[str, list[float]]:
            drawn[point] = batch = self.pools.batch(direction, *point)
            got = self.timings(contenders_at[point], batch, repeats, seconds, most)
            self.progress.step(f"{direction} {what}" + (f" (pass {i + 1} of {passes})" if passes > 1 else ""))
            return {bound.label: t for bound, t in got}

        routes = {x.label: x for contenders in contenders_at.values() for x in contenders}
        for point, got in in_passes(list(contenders_at), passes, time_point).items():
            self.record(stage, drawn[point], [(routes[label], t) for label, t in got.items()
                                              if not self.failures.retired(d, routes[label])])

    def size_sweep(self, direction: Direction, bounds: list[Bound]) -> None:
        """Every route at every block size, a batch of ``size_sweep_bytes`` (up to
        ``max_batch``), ``size_passes`` times over."""
        s = self.settings
        passes = max(1, s.size_passes)
        points = {(b, min(s.max_batch, max(1, s.size_sweep_bytes // b), self.pools.slots(b))): bounds
                  for b in s.block_sizes}
        self.sweep_points(SIZE, direction, points, passes, per_pass(s.repeats, 0.0, 0, passes)[0])

    def batch_sweep(self, direction: Direction, bounds: list[Bound]) -> None:
        """The kernel at its knee and at ``tier_counts - 1`` multiples of it (:func:`tier_sms`)
        against the best batch route, over batch sizes up to the size sweep's bytes per call:
        at the block sizes where the kernel is the route (or ``batch_sweep_blocks`` of them,
        evenly spread), and at every one where the batch route is (its small batches may still
        go to the kernel: :func:`~.fit.kernel_window`). The grid runs ``batch_passes`` times
        over, a fresh draw of each point every time; the rounds and seconds per point are
        shared among the passes."""
        d, s = str(direction), self.settings
        decision = fit.fit_direction(self.result.measurements, d, s.knee_tolerance)
        table = fit.size_table(self.result.measurements, d)
        knee = decision.kernel_sms
        kernel_at = decision.uses_kernel
        if not knee:
            return
        k = self.settings.batch_sweep_blocks or len(kernel_at)
        picks = [kernel_at[round(i * (len(kernel_at) - 1) / max(k - 1, 1))] for i in range(min(k, len(kernel_at)))]
        picks = list({r.block_bytes: r for r in picks}.values())  # evenly spread, ends included
        picks += [r for r in decision.by_size if r.kind == "batch"]
        plan = []
        for r in picks:
            b = r.block_bytes
            dma = [(row[b], impl) for (impl, kind, _), row in table.items() if kind == "batch" and b in row]
            kern = [(row[b], impl) for (impl, kind, sms), row in table.items() if kind == "kernel" and sms == knee and b in row]
            if not dma or not kern:
                continue
            best, kernel = max(dma)[1], max(kern)[1]
            tiers = tier_sms(self.settings.sm_counts, knee, self.settings.tier_counts)
            contenders = [x for x in bounds if (x.impl == kernel and x.num_sms in tiers) or (x.impl, x.num_sms) == (best, None)]
            most = min(self.pools.slots(b), max(1, s.size_sweep_bytes // b))
            ns = [n for n in self.settings.batch_sizes if n <= most]
            plan.append((b, contenders, ns))
        passes = max(1, s.batch_passes)
        repeats, seconds, most = per_pass(s.batch_repeats or s.repeats, s.batch_point_seconds, s.batch_max_repeats, passes)
        self.progress.add(passes * sum(len(ns) for _, _, ns in plan))
        contenders_at = {(b, n): contenders for b, contenders, ns in plan for n in ns}
        self.sweep_points(BATCH, direction, contenders_at, passes, repeats, seconds, most)

    # -- the whole run -------------------------------------------------------------------
    def run(self) -> SweepResult:
        s = self.settings
        bounds = self.bounds
        self.progress.add(sum(1 + (1 + len(s.block_sizes) * max(1, s.size_passes)) * bool(bounds[d]) for d in self.directions))
        for d in self.directions:
            start = self.ceiling(d)
            self.progress.step(f"{d} ceiling")
            if not bounds[d]:
                continue
            self.size_sweep(d, bounds[d])
            self.batch_sweep(d, bounds[d])
            self.steady(d, start, self.ceiling(d))
            self.progress.step(f"{d} ceiling again")
        return self.result
