"""Calibration: predicted bandwidth per route and the thresholds the resolver decides by.

A Calibration comes from a measured profile, a backend's defaults for a known device, or
the conservative built-in fallback below; the resolver never guesses outside one.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from ..errors import InvalidImplError
from ..types import Direction, as_int

SCOPES = ("device", "family", "platform")  # most specific first


def at_log_size(points: Sequence[tuple[int, float]], block_bytes: int, log_values: bool = False) -> float:
    """The value of ``points`` (``(block_bytes, value)``, ascending) at ``block_bytes``:
    linear in log block size between neighbours (and in log value with ``log_values``),
    the end value beyond either end."""
    if block_bytes <= points[0][0]:
        return points[0][1]
    if block_bytes >= points[-1][0]:
        return points[-1][1]
    x = math.log(block_bytes)
    for (b0, v0), (b1, v1) in zip(points, points[1:]):
        if block_bytes <= b1:
            t = (x - math.log(b0)) / (math.log(b1) - math.log(b0))
            if log_values:
                return math.exp(math.log(v0) + t * (math.log(v1) - math.log(v0)))
            return v0 + t * (v1 - v0)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Curve:
    """Bandwidth of one route against block size, in GB/s (1e9 bytes per second).

    :param impl: an impl name, or ``"*batch"`` / ``"*kernel"`` for any impl of that kind.
    :param num_sms: SMs the kernel ran on when measured (None for batch routes).
    :param points: ``(block_bytes, gbps)`` pairs; interpolated over log(block_bytes) and
        held flat past either end.
    """

    impl: str
    direction: Direction
    points: tuple[tuple[int, float], ...]
    num_sms: Optional[int] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "direction", Direction.parse(self.direction))
        where = f"Curve {self.impl!r} {self.direction}"
        try:
            pts = tuple(sorted((int(b), float(g)) for b, g in self.points))
        except (TypeError, ValueError):
            pts = ()
        if not pts or any(b <= 0 or not (g >= 0) or math.isinf(g) for b, g in pts):
            raise InvalidImplError(f"{where}: points must be (bytes > 0, finite GB/s >= 0)")
        if self.num_sms is not None:
            sms = as_int(self.num_sms)
            if sms is None or sms < 0:
                raise InvalidImplError(f"{where}: num_sms={self.num_sms!r} must be None or an int >= 0")
            object.__setattr__(self, "num_sms", sms)
        if len({b for b, _ in pts}) != len(pts):
            raise InvalidImplError(f"{where}: repeated block size")
        object.__setattr__(self, "points", pts)

    def gbps(self, block_bytes: int) -> float:
        return at_log_size(self.points, block_bytes)


def _slowdown_row(row: Sequence[Any]) -> tuple:
    """One ``slowdown_by_sms`` row, typed: ``(route, num_sms, fraction)``, with
    ``block_bytes`` last where the row names one."""
    if len(row) not in (3, 4):
        raise ValueError(row)
    r, n, v = str(row[0]), int(row[1]), float(row[2])
    return (r, n, v) if len(row) == 3 else (r, n, v, int(row[3]))


def _over_sms(pts: list[tuple[int, float]], num_sms: Optional[int]) -> float:
    """A slowdown at ``num_sms`` from ``(num_sms, fraction)`` points sorted by SMs: linear
    between measured counts, the nearest end beyond (the first point without a count)."""
    if num_sms is None or len(pts) == 1 or num_sms <= pts[0][0]:
        return pts[0][1]
    for (n0, v0), (n1, v1) in zip(pts, pts[1:]):
        if num_sms <= n1:
            return v0 + (v1 - v0) * (num_sms - n0) / (n1 - n0)
    return pts[-1][1]


@dataclass(frozen=True)
class Calibration:
    """Tuned numbers for one device (or a family, or a whole platform).

    :param source: where the numbers come from, in words a person can check
        (``"profile /path/x.json"``, ``"cuda defaults: published H100 thresholds"``).
    :param platform: the platform it applies to.
    :param scope: ``"device"`` (one identity), ``"family"`` or ``"platform"``; the most
        specific registered calibration wins.
    :param curves: predicted bandwidth per route.
    :param kernel_sms: per direction, the SM knee: fewest SMs within a few % of the peak.
    :param kernel_min_batch: per direction, the smallest batch from which a kernel wins.
    :param min_batch_by_size: per direction, ``(block_bytes, min_batch)`` pairs where the
        threshold was measured per block size (it grows with the block: a kernel's fixed
        launch cost is repaid sooner where its per-block advantage is larger); between them
        interpolated over log sizes, held flat past either end. Overrides ``kernel_min_batch``.
    :param kernel_sms_by_batch: per direction, SM tiers measured per block size:
        ``(block_bytes, ((from_batch, num_sms), ...))``. A kernel copying ``n`` blocks runs
        on the SMs of the last tier whose ``from_batch <= n`` (the first tier below its
        ``from_batch``): medium batches finish sooner on more SMs than the knee, which is
        fitted where the link is already full. A tier of 0 SMs sends its batches to the
        route that takes no SMs: where that route wins a block size at large batches but the
        kernel wins its small ones, a row such as ``((1, 24), (181, 0))`` gives batches under
        181 to the kernel on 24 SMs (rows without a 0 tier apply only where the kernel is
        the block size's route). A block size between measured ones takes the tiers of the
        nearest (over log sizes). Without tiers: ``kernel_sms`` for all.
    :param slowdown: fraction of compute throughput lost while a route runs, keyed by impl
        name or by kind (``"batch"``, ``"kernel"``); used by ``prefer="low_interference"``.
    :param slowdown_by_sms: per direction, the same fraction measured the way an engine sees
        it (compute launched, the transfer submitted right after, beside it):
        ``((route, num_sms, fraction), ...)`` with ``route`` an impl name or a kind and
        ``num_sms`` 0 for routes that take no SMs. A row may name a fourth item, the block
        size it was measured at (``(route, num_sms, fraction, block_bytes)``): a route with
        such rows is judged at a block size by those of the nearest measured size (over
        log sizes); rows without one apply at every size. Where it has rows for a route,
        it is what :meth:`slowdown_at` answers (over SM counts: linear between measured
        ones, the nearest end beyond); otherwise ``slowdown`` is.
    :param host_cost: per direction, how long one call of a route holds the calling thread,
        fitted as ``host_us(n) = a_us + b_us * n`` over ``n`` descriptors spread across many
        per-layer tensors (an engine's layout), with the transfer stream busy so only host
        work counts: ``((route, a_us, b_us), ...)`` with ``route`` an impl name or a kind.
        :meth:`host_us` answers from it; the resolver excludes a route whose call holds the
        thread longer than the whole transfer takes on another (:mod:`kvswap.resolution.routing`).
    :param staged_chunks: the chunks a host run held where the staged route's curves (GB/s by
        chunk size, named by its implementation) were measured (a block-major host: a block's
        every chunk); 0 where not known. A host run of fewer is predicted slower by what the
        batch route loses on the shorter run (:mod:`kvswap.mover.route_choice`).
    :param ceiling_gbps: per direction, the contiguous copy ceiling when measured.
    :param calibrated: False for guesses; ``explain()`` then says how to calibrate.
    :param host_reference: measured host memory copies (the host reference, on a machine
        without an accelerator), not a device: ``explain()`` says so.
    :param driver_version: the driver the numbers were measured under, where known;
        ``explain()`` and ``kvswap info`` say so when the device runs another.
    """

    source: str
    platform: str
    scope: str = "platform"
    curves: tuple[Curve, ...] = ()
    kernel_sms: Mapping[str, int] = field(default_factory=dict)
    kernel_min_batch: Mapping[str, int] = field(default_factory=dict)
    min_batch_by_size: Mapping[str, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    kernel_sms_by_batch: Mapping[str, tuple[tuple[int, tuple[tuple[int, int], ...]], ...]] = field(default_factory=dict)
    slowdown: Mapping[str, float] = field(default_factory=dict)
    slowdown_by_sms: Mapping[str, tuple[tuple, ...]] = field(default_factory=dict)
    ceiling_gbps: Mapping[str, float] = field(default_factory=dict)
    host_cost: Mapping[str, tuple[tuple[str, float, float], ...]] = field(default_factory=dict)
    staged_chunks: int = 0
    calibrated: bool = True
    identity: Optional[str] = None
    host_reference: bool = False
    driver_version: Optional[str] = None

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidImplError:
            return InvalidImplError(f"Calibration {self.source!r}: {msg}")

        if not self.source or not isinstance(self.source, str):
            raise bad("source must say where the numbers come from")
        if self.scope not in SCOPES:
            raise bad(f"scope={self.scope!r} is not valid; choose one of {SCOPES}")
        try:
            object.__setattr__(self, "curves", tuple(self.curves))
        except TypeError:
            raise bad(f"curves={self.curves!r} must be a sequence of Curve objects") from None
        if not all(isinstance(c, Curve) for c in self.curves):
            raise bad("curves must be Curve objects")
        for name in ("kernel_sms", "kernel_min_batch", "ceiling_gbps"):
            value = {str(Direction.parse(k)): v for k, v in dict(getattr(self, name)).items()}
            if any(isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v < math.inf
                   for v in value.values()):
                raise bad(f"{name} values must be finite numbers >= 0")
            object.__setattr__(self, name, value)
        for name, value, rule in (
            ("min_batch_by_size", _batch, "(block_bytes >= 1, batch >= 1) pairs, one per size"),
            ("kernel_sms_by_batch", _tiers, "(block_bytes >= 1, ((from_batch, num_sms), ...)) rows, one per block "
             "size, each with tiers of distinct from_batch >= 1 and num_sms >= 0"),
        ):
            table = {}
            for k, rows in dict(getattr(self, name)).items():
                try:
                    per_block = _per_block(rows, value)
                except (TypeError, ValueError):
                    raise bad(f"{name} values must be {rule}") from None
                table[str(Direction.parse(k))] = per_block
            object.__setattr__(self, name, table)
        if isinstance(self.staged_chunks, bool) or not isinstance(self.staged_chunks, int) or self.staged_chunks < 0:
            raise bad(f"staged_chunks={self.staged_chunks!r} must be an int >= 0")
        if any(not 0 <= v < 1 for v in self.slowdown.values()):
            raise bad("slowdown values are fractions in [0, 1)")
        by_sms = {}
        for k, rows in dict(self.slowdown_by_sms).items():
            try:
                checked = tuple(sorted(_slowdown_row(r) for r in rows))
            except (TypeError, ValueError):
                raise bad("slowdown_by_sms values must be (route, num_sms, fraction[, block_bytes]) rows") from None
            if any(r[1] < 0 or not 0 <= r[2] < 1 or (len(r) > 3 and r[3] < 1) for r in checked):
                raise bad("slowdown_by_sms rows need num_sms >= 0, a fraction in [0, 1) and block_bytes >= 1")
            by_sms[str(Direction.parse(k))] = checked
        object.__setattr__(self, "slowdown_by_sms", by_sms)
        host = {}
        for k, rows in dict(self.host_cost).items():
            try:
                checked = tuple(sorted(host_cost_row(r) for r in rows))
            except (TypeError, ValueError) as e:
                raise bad(f"host_cost: {e}") from None
            if len({r for r, _, _ in checked}) != len(checked):
                raise bad("host_cost: one row per route and direction")
            host[str(Direction.parse(k))] = checked
        object.__setattr__(self, "host_cost", host)

    def curve_for(self, impl: str, kind: str, direction: Direction, num_sms: Optional[int]) -> tuple[Optional[Curve], float]:
        """The curve that predicts ``impl``, and the factor to scale it by for ``num_sms``.

        Kernel curves measured at several SM counts: the largest count not above
        ``num_sms``; below every measured count, the smallest, scaled down linearly.
        """
        for key in (impl, "*" + kind):
            found = [c for c in self.curves if c.impl == key and c.direction == direction]
            if not found:
                continue
            if kind != "kernel" or num_sms is None:
                return found[0], 1.0
            sized = sorted((c for c in found if c.num_sms), key=lambda c: c.num_sms)
            if not sized:
                return found[0], 1.0
            below = [c for c in sized if c.num_sms <= num_sms]
            if below:
                return below[-1], 1.0
            return sized[0], num_sms / sized[0].num_sms
        return None, 1.0

    def predict(self, impl: str, kind: str, direction: Direction, block_bytes: int, num_sms: Optional[int] = None) -> Optional[float]:
        curve, scale = self.curve_for(impl, kind, direction, num_sms)
        return None if curve is None else curve.gbps(block_bytes) * scale

    def sms(self, direction: Direction, default: int = 8) -> int:
        return int(self.kernel_sms.get(str(direction), default))

    def sms_tiers(self, direction: Direction, block_bytes: int) -> tuple[tuple[int, int], ...]:
        """``((from_batch, num_sms), ...)`` for a kernel copying ``block_bytes`` blocks;
        empty where none were measured (the knee, :meth:`sms`, applies)."""
        table = self.kernel_sms_by_batch.get(str(direction))
        if not table:
            return ()
        x = math.log(max(block_bytes, 1))
        return min(table, key=lambda row: (abs(math.log(row[0]) - x), row[0]))[1]

    def min_batch(self, direction: Direction, default: int = 16, block_bytes: Optional[int] = None) -> int:
        pts = self.min_batch_by_size.get(str(direction))
        if not pts or block_bytes is None:
            return int(self.kernel_min_batch.get(str(direction), default))
        return max(1, round(at_log_size(pts, block_bytes, log_values=True)))

    def slowdown_of(self, impl: str, kind: str) -> float:
        return float(self.slowdown.get(impl, self.slowdown.get(kind, 0.0)))

    def slowdown_at(self, impl: str, kind: str, direction: Direction, num_sms: Optional[int] = None,
                    size: Optional[int] = None) -> float:
        """The compute slowdown of ``impl`` copying blocks of ``size`` bytes in ``direction``
        on ``num_sms`` SMs: from :attr:`slowdown_by_sms` where it has rows for the impl
        (else its kind), else :meth:`slowdown_of`. Rows measured at several block sizes
        answer by the nearest of them to ``size``; without a size, by the size whose rows
        say the most (the cautious answer)."""
        rows = self.slowdown_by_sms.get(str(Direction.parse(direction)), ())
        for key in (impl, kind):
            mine = [r for r in rows if r[0] == key]
            if not mine:
                continue
            sizes = sorted({r[3] for r in mine if len(r) > 3})
            if not sizes:
                return _over_sms([(r[1], r[2]) for r in mine], num_sms)

            def at(b: int) -> float:  # the rows measured at block size b
                return _over_sms([(r[1], r[2]) for r in mine if len(r) > 3 and r[3] == b], num_sms)

            if size is None or size < 1:
                return max(at(b) for b in sizes)
            return at(min(sizes, key=lambda b: abs(math.log2(b / size))))
        return self.slowdown_of(impl, kind)

    def host_line(self, impl: str, kind: str, direction: Direction) -> Optional[tuple[float, float]]:
        """``(a_us, b_us)`` of ``impl`` in ``direction`` from :attr:`host_cost` (the impl's
        row, else its kind's); None where it was not measured."""
        rows = self.host_cost.get(str(Direction.parse(direction)), ())
        for key in (impl, kind):
            for route, a, b in rows:
                if route == key:
                    return a, b
        return None

    def host_us(self, impl: str, kind: str, direction: Direction, n: int) -> Optional[float]:
        """Microseconds one call of ``impl`` holds the calling thread for ``n`` descriptors
        in ``direction`` (:meth:`host_line`); None where it was not measured."""
        line = self.host_line(impl, kind, direction)
        return None if line is None else line[0] + line[1] * n

    def summary(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "platform": self.platform,
            "scope": self.scope,
            "calibrated": self.calibrated,
            "identity": self.identity,
            "host_reference": self.host_reference,
            "host_cost": bool(self.host_cost),
            "driver_version": self.driver_version,
        }


def host_cost_row(row: Any) -> tuple[str, float, float]:
    """A checked ``(route, a_us, b_us)`` row of :attr:`Calibration.host_cost`: a route name
    and two finite numbers >= 0 (raises ValueError naming what is wrong)."""
    route, a, b = row
    if not isinstance(route, str) or not route:
        raise ValueError(f"route {route!r} must be a name")
    for name, v in (("a_us", a), ("b_us", b)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v < math.inf:
            raise ValueError(f"{route}: {name}={v!r} must be a finite number >= 0")
    return route, float(a), float(b)


def _per_block(rows: Any, value: Any) -> tuple[tuple[int, Any], ...]:
    """Checked ``(block_bytes, value(v))`` rows, sorted, one per block size >= 1."""
    out = tuple(sorted((int(b), value(v)) for b, v in rows))
    if not out or any(b < 1 for b, _ in out) or len({b for b, _ in out}) != len(out):
        raise ValueError("bad rows")
    return out


def _batch(n: Any) -> int:
    """A checked batch size: an int >= 1."""
    if int(n) < 1:
        raise ValueError("bad batch")
    return int(n)


def _tiers(steps: Any) -> tuple[tuple[int, int], ...]:
    """Checked SM tiers: ``(from_batch, num_sms)`` pairs, sorted, distinct, batches >= 1,
    SMs >= 0 (0: the route that takes no SMs)."""
    out = tuple(sorted((int(n), int(k)) for n, k in steps))
    if not out or any(n < 1 or k < 0 for n, k in out) or len({n for n, _ in out}) != len(out):
        raise ValueError("bad tiers")
    return out


def _kind_curves(batch: list[tuple[int, float]], kernel: list[tuple[int, float]], sms: int) -> tuple[Curve, ...]:
    out = []
    for d in Direction:
        out.append(Curve("*batch", d, tuple(batch)))
        out.append(Curve("*kernel", d, tuple(kernel), num_sms=sms))
    return tuple(out)


KiB = 1024

# Conservative guesses for an uncalibrated accelerator: the batch copy pays per descriptor
# and falls far below the link under ~32 KiB blocks (docs/design.md, "Two ways to copy, and
# neither wins"), while a kernel on 8 SMs is assumed to reach only ~60% of a PCIe Gen5 link.
# The slowdowns are guesses on the low side of what a copy beside compute costs
# (docs/benchmarks.md).
FALLBACK = Calibration(
    source="built-in conservative fallback (no profile, no backend defaults)",
    platform="*",
    scope="platform",
    curves=_kind_curves(
        batch=[(4 * KiB, 4.0), (16 * KiB, 6.0), (32 * KiB, 25.0), (64 * KiB, 35.0), (256 * KiB, 45.0)],
        kernel=[(4 * KiB, 20.0), (16 * KiB, 28.0), (64 * KiB, 30.0), (256 * KiB, 30.0)],
        sms=8,
    ),
    kernel_sms={"h2d": 8, "d2h": 8},
    kernel_min_batch={"h2d": 16, "d2h": 16},
    slowdown={"batch": 0.08, "kernel": 0.25},
    calibrated=False,
)
