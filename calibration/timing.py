"""How kvswap times a copy: CUDA events on an accelerator, ``perf_counter`` on the host.

Every measurement goes through :meth:`Timer.measure`: warm-up calls first (a Triton kernel
compiles on its first launch; the driver sets up on its first batch), then rounds in which
each call runs a block of its own: ``SETTLE`` untimed calls, then up to ``KEEP`` timed ones.
Interleaving the calls of a comparison in rounds spreads clock and thermal drift over all of
them instead of biasing the last one.

The block is there because a short call's time depends on what ran before it, even a few
calls back: after another route, a route's small batch can take 10-20% longer than after
itself. Timed one call per contender per round, a route's time would depend on which other
contenders a harness compares it with, and the calibration and the bench would disagree. Timed in blocks, each route is timed as an engine
sees it when it calls that route step after step, whatever else is being compared.
"""
from __future__ import annotations

import gc
import math
import random
import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence, TypeVar

from kvswap.types import DeviceInfo

Call = Callable[[Any], None]  # call(stream): enqueue one copy on ``stream`` (None on the host)
P, K = TypeVar("P"), TypeVar("K")  # a grid point, a contender's key
# The standard error of a median of r samples is about this x their MAD / sqrt(r) (normal
# samples: 1.2533 x sigma / sqrt(r), and sigma = 1.4826 x MAD).
MEDIAN_SE = 1.86


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def spread(values: Sequence[float], mid: Optional[float] = None) -> float:
    """The median absolute deviation of ``values`` around ``mid`` (default: their median)
    as a fraction of ``mid``."""
    mid = median(values) if mid is None else mid
    return float(statistics.median(abs(v - mid) for v in values)) / mid if mid > 0 else 0.0


def pooled(passes: Sequence[Sequence[float]]) -> tuple[float, float, int]:
    """One contender's timings from several passes over a grid, each pass a fresh random
    draw of the point's slots at another moment of the run: ``(seconds, spread, repeats)``.
    ``seconds`` is the median of the passes' medians: of three passes, one through a slow
    spell of the machine, or through slots the copy engine handles slowly, is outvoted by
    the other two. ``spread`` is that of all the timings around it, so the standard error
    counts the passes' disagreement too."""
    kept = [p for p in passes if p]
    if not kept:
        raise ValueError("no timings to pool")
    mid = median([median(p) for p in kept])
    every = [t for p in kept for t in p]
    return mid, spread(every, mid), len(every)


def round_ratios(num: Sequence[Sequence[float]], den: Sequence[Sequence[float]]) -> list[float]:
    """The ratio of ``num``'s median to ``den``'s in every round of every pass: timings
    taken together, one list per pass for each, as :meth:`DeviceTimer.measure` returned
    them in the same measurement (each round gives every call up to ``KEEP`` timed calls,
    so the two lists split into the same rounds)."""
    ratios = []
    for a, b in zip(num, den):
        for i in range(0, min(len(a), len(b)), KEEP):
            ra, rb = median(a[i:i + KEEP]), median(b[i:i + KEEP])
            if ra > 0 and rb > 0:
                ratios.append(ra / rb)
    return ratios


def paired(num: Sequence[Sequence[float]], den: Sequence[Sequence[float]]) -> tuple[float, float]:
    """How many times as long the calls timed in ``num`` took as those in ``den``, timed
    together (:func:`round_ratios`): ``(ratio, standard error)``, the median over the
    rounds.

    A ratio of medians taken over a whole point is thrown off by whatever changes during
    it: a slow spell of the machine (20-30% for about a second) or timings with two modes,
    where a median lands in either: identical work timed that way can come out a few %
    apart. Within a round the two calls ran a few
    microseconds apart, in the same state of the machine, so the ratio of each round
    keeps only what tells the calls apart."""
    ratios = round_ratios(num, den)
    if not ratios:
        raise ValueError("no rounds timed together to pair")
    mid = median(ratios)
    return mid, MEDIAN_SE * spread(ratios, mid) * mid / math.sqrt(len(ratios))


def in_passes(points: Sequence[P], passes: int, time_point: Callable[[P, int], dict[K, list[float]]]
              ) -> dict[P, dict[K, list[list[float]]]]:
    """Time every point ``passes`` times over, the whole grid before any point again (so a
    point's passes lie apart in time): ``time_point(point, pass)`` gives its timings by
    contender; the result holds, per point and contender, one list per pass, for
    :func:`pooled` and :func:`round_ratios`."""
    out: dict[P, dict[K, list[list[float]]]] = {p: defaultdict(list) for p in points}
    for i in range(max(1, passes)):
        for p in points:
            for key, t in time_point(p, i).items():
                out[p][key].append(t)
    return out


def per_pass(repeats: int, point_seconds: float, max_repeats: int, passes: int) -> tuple[int, float, int]:
    """A point's ``repeats``, ``point_seconds`` and ``max_repeats`` (what it gets in all)
    shared among ``passes``: what each pass asks :func:`rounds_for` for."""
    passes = max(1, passes)
    each = max(1, -(-repeats // passes))
    return each, point_seconds / passes, max(each, max_repeats // passes) if max_repeats else 0


def standard_error(a: tuple[float, float, int], b: tuple[float, float, int]) -> float:
    """The standard error of the ratio of two medians, each given as ``(median, spread,
    repeats)``: that of a median of r samples is about ``MEDIAN_SE`` x MAD / sqrt(r)."""
    (_, sa, ra), (_, sb, rb) = a, b
    return MEDIAN_SE * math.sqrt(sa * sa / max(ra, 1) + sb * sb / max(rb, 1))


def rounds_for(timer: Any, calls: Sequence[Call], repeats: int, point_seconds: float, max_repeats: int,
               warmup: int) -> int:
    """How many timed calls of each of ``calls`` to take: ``repeats``, or more, up to
    ``max_repeats``, so that the timed calls together take about ``point_seconds`` (the
    untimed ones of :func:`schedule` add SETTLE/KEEP of that). Short calls stray by a few %
    from call to call (host work of 10-20 us): more of them make their medians steady enough
    to tell apart gains of 1%. Probes three of each (median)."""
    if not point_seconds or not calls or max_repeats <= repeats:
        return repeats
    probe = sum(median(t) for t in timer.measure(calls, 3, warmup))
    return max(repeats, min(max_repeats, int(point_seconds / max(probe, 1e-9))))


# Per contender and round: this many untimed calls, then this many timed (fewer in the last
# round). The first timed call of a block still shows a trace of what ran before it (about
# 0.5 us at 8 KiB x 4); the later ones do not.
SETTLE, KEEP = 3, 5


def schedule(count: int, repeats: int, rng: random.Random) -> list[tuple[int, bool]]:
    """The calls of one measurement in order, as ``(index, timed)``: rounds in a fresh
    random order of the ``count`` calls (``rng``: the timer's, see :class:`_Shuffled`), each
    call a block of ``SETTLE`` untimed calls then up to ``KEEP`` timed, until each call has
    ``repeats`` timed ones."""
    out: list[tuple[int, bool]] = []
    order = _Shuffled(count, rng)
    for done in range(0, repeats, KEEP):
        for i in order.next():
            out += [(i, False)] * SETTLE + [(i, True)] * min(KEEP, repeats - done)
    return out


def held_us(call: Callable[[], Any], stream: Any = None, busy_cycles: int = 0,
            clock: Optional[Callable[[], int]] = None, spin: bool = False) -> float:
    """Microseconds ``call()`` holds the calling thread (``time.perf_counter_ns``, or
    ``clock``), garbage collection off. With a torch ``stream``, a sleep kernel of
    ``busy_cycles`` is queued on it first, so the stream is still busy when the call returns
    and only host work counts; the stream is waited for after the timing, blocking (the
    thread sleeps, and the next call starts cold, as after an engine's wait) or, with
    ``spin``, polled (the thread stays busy, as an engine's between its calls)."""
    if stream is not None:
        import torch

        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(busy_cycles))
    clock = clock or time.perf_counter_ns
    was = gc.isenabled()
    gc.disable()
    try:
        t0 = clock()
        call()
        t1 = clock()
    finally:
        if was:
            gc.enable()
    if stream is not None:
        if spin:
            while not stream.query():
                pass
        else:
            stream.synchronize()
    return (t1 - t0) / 1e3


def on_host(device: DeviceInfo) -> bool:
    """Whether both sides of a copy on ``device`` are host memory (no accelerator to time)."""
    return device.torch_device.split(":")[0] == "cpu"


class _Shuffled:
    """A fresh order of the calls for every round: what ran before a call's block can still
    change its time a little, and a fixed order would give that advantage to the same
    contender every round. ``rng`` is the timer's, seeded once (runs repeat) and
    carried from one measurement to the next: restarting it per measurement replayed the
    same orders at every point of a bench, which biases one contender at all the short
    calls alike."""

    def __init__(self, count: int, rng: random.Random) -> None:
        self._rng = rng
        self._indices = list(range(count))

    def next(self) -> list[int]:
        self._rng.shuffle(self._indices)
        return list(self._indices)


class HostTimer:
    """Wall-clock time of synchronous host copies."""

    label = "perf_counter around each synchronous call"
    stream = None

    def __init__(self) -> None:
        self._rng = random.Random(0)

    def measure(self, calls: Sequence[Call], repeats: int, warmup: int = 1) -> list[list[float]]:
        """Seconds per call: one list of ``repeats`` timings per entry of ``calls``."""
        for _ in range(warmup):
            for call in calls:
                call(None)
        out: list[list[float]] = [[] for _ in calls]
        clock = time.perf_counter
        for i, timed in schedule(len(calls), repeats, self._rng):
            call = calls[i]
            t0 = clock()
            call(None)
            if timed:
                out[i].append(max(clock() - t0, 1e-9))
        return out

    def once(self, call: Call) -> None:
        """Run ``call`` once and wait for it (checking a route's result, not timing it)."""
        call(None)


class DeviceTimer:
    """GPU time between two events recorded on a dedicated stream around each call.

    Each timed call starts on an idle stream, so the interval is what one transfer costs
    the stream from the moment it is asked for: the host work of enqueueing it (which
    dominates tiny batches) plus the copy. Calls timed back to back instead let one
    call's leftover GPU work hide the next one's host work, which made the same function
    measure far apart depending on what ran before it.
    The stream is a fresh non-default one: the batch-copy API rejects the legacy stream.
    """

    label = "CUDA events on a dedicated stream"

    def __init__(self, device: DeviceInfo) -> None:
        import torch

        self._torch = torch
        self.index = device.index or 0
        self.stream = torch.cuda.Stream(device=self.index)
        self._rng = random.Random(0)

    def once(self, call: Call) -> None:
        """Run ``call`` once on the timer's stream and wait for it."""
        torch = self._torch
        with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
            try:
                call(self.stream)
            finally:
                self.stream.synchronize()

    def measure(self, calls: Sequence[Call], repeats: int, warmup: int = 1) -> list[list[float]]:
        torch = self._torch
        pairs: list[list[tuple[Any, Any]]] = [[] for _ in calls]
        with torch.cuda.device(self.index), torch.cuda.stream(self.stream):
            try:
                for _ in range(warmup):
                    for call in calls:
                        call(self.stream)
                self.stream.synchronize()
                for i, timed in schedule(len(calls), repeats, self._rng):
                    call = calls[i]
                    if not timed:
                        self.stream.synchronize()
                        call(self.stream)
                        continue
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    self.stream.synchronize()
                    start.record(self.stream)
                    call(self.stream)
                    end.record(self.stream)
                    pairs[i].append((start, end))
            finally:
                # Never leave copies in flight into buffers the caller may free or reuse.
                self.stream.synchronize()
        return [[max(s.elapsed_time(e) / 1e3, 1e-9) for s, e in row] for row in pairs]


def make_timer(device: DeviceInfo) -> Any:
    return HostTimer() if on_host(device) else DeviceTimer(device)
