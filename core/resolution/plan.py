"""The structured result of a resolve (:class:`Plan`) and its reading in words."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from ..types import DeviceInfo, Direction, Policy
from .profiles import is_shipped


@dataclass(frozen=True)
class Candidate:
    """An implementation considered for this resolve, usable or not."""

    name: str
    kind: str
    plugin: str
    available: bool
    reason: Optional[str] = None
    constraints: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Route:
    """The decision for one range of block sizes, ``[min_bytes, max_bytes]``.

    :ivar impl: the implementation used.
    :ivar predicted: ``(impl, GB/s or None)`` for every usable candidate at ``at_bytes``,
        best first, as the ranking saw them.
    :ivar min_batch: below this many descriptors ``small_batch_impl`` is used instead.
    :ivar small_batch_impl: for a kernel ``impl``, the route that takes no SMs, for the
        batches the kernel does not win: below ``min_batch``, and in tiers of 0 SMs.
    :ivar fallbacks: where descriptors go that ``impl``'s constraints refuse (alignment).
    :ivar sms_by_batch: for a kernel ``impl``, ``((from_batch, num_sms), ...)``: a batch of
        ``n`` descriptors runs on the SMs of the last tier with ``from_batch <= n`` (the
        first below all), and a tier of 0 SMs on ``small_batch_impl``; empty: the SMs
        ``impl`` was bound with (``Plan.params``).
    :ivar host_cost: ``(impl, a_us, b_us)`` for the same candidates: one call holds the
        calling thread ``a_us + b_us * n`` microseconds for ``n`` descriptors, from the
        calibration's host cost (both None: not measured); :meth:`held_us` reads it.
    :ivar host_at: the descriptor count the thread-time rule decided at.
    :ivar excluded: ``(impl, host_us, other_us, other_impl)`` for each candidate left out
        because its call holds the thread longer (``host_us``) than the whole transfer takes
        on ``other_impl`` (``other_us``), both at ``host_at`` descriptors
        (:func:`kvswap.resolution.routing.thread_bound`).
    """

    min_bytes: int
    max_bytes: Optional[int]
    impl: str
    at_bytes: int
    predicted: tuple[tuple[str, Optional[float]], ...]
    min_batch: int = 0
    small_batch_impl: Optional[str] = None
    fallbacks: tuple[str, ...] = ()
    sms_by_batch: tuple[tuple[int, int], ...] = ()
    host_cost: tuple[tuple[str, Optional[float], Optional[float]], ...] = ()
    host_at: int = 0
    excluded: tuple[tuple[str, float, float, str], ...] = ()

    def runs(self, batch: int) -> tuple[str, Optional[int]]:
        """What a batch of ``batch`` descriptors runs on: ``(impl, num_sms)``, the SMs of
        its tier, or None for the SMs the impl was bound with (and for ``small_batch_impl``,
        below ``min_batch`` and in tiers of 0 SMs)."""
        tier = self.sms_for(batch)
        if self.small_batch_impl and (batch < self.min_batch or tier == 0):
            return self.small_batch_impl, None
        return self.impl, tier

    def held_us(self, impl: str, count: int) -> Optional[float]:
        """Microseconds a call of ``impl`` on this route's blocks is predicted to hold the
        calling thread for ``count`` descriptors (None: not measured)."""
        line = self.host_line(impl)
        return None if line is None else line[0] + line[1] * count

    def host_line(self, impl: str) -> Optional[tuple[float, float]]:
        """``(a_us, b_us)``: a call of ``impl`` holds the calling thread ``a_us + b_us * n``
        microseconds for ``n`` descriptors (None: not measured)."""
        for name, a, b in self.host_cost:
            if name == impl and a is not None and b is not None:
                return a, b
        return None

    def sms_for(self, batch: int) -> Optional[int]:
        """The SM count of ``impl`` for a batch of ``batch`` descriptors (None: as bound)."""
        tiers = self.sms_by_batch
        if not tiers:
            return None
        k = tiers[0][1]
        for start, sms in tiers:
            if batch < start:
                break
            k = sms
        return k


@dataclass(frozen=True)
class Plan:
    direction: Direction
    device: DeviceInfo
    policy: Policy
    calibration: dict[str, Any]
    candidates: tuple[Candidate, ...]
    routes: tuple[Route, ...]
    params: dict[str, dict[str, Any]]
    forced: Optional[str] = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["direction"] = str(self.direction)
        return d

    def explain(self) -> str:
        return "\n".join(_explain_lines(self))


def human_bytes(n: Optional[int]) -> str:
    if n is None:
        return "inf"
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % (size // 4 or 1) == 0:
            v = n / size
            return f"{v:g} {unit}"
    return f"{n} B"


def sizes_taken(c: Mapping[str, Any]) -> str:
    """The block sizes an implementation takes, from its constraints
    (:meth:`kvswap.CopyImpl.constraints`), in words: ``blocks of 8 B to 1 MiB, in
    multiples of 8 B``."""
    lo, hi, a = c.get("min_block_bytes", 1), c.get("max_block_bytes"), c.get("alignment", 1)
    span = f"{human_bytes(lo)} or more" if hi is None else f"{human_bytes(lo)} to {human_bytes(hi)}"
    return f"blocks of {span}" + (f", in multiples of {a} B" if a > 1 else "")


def _span(p: Plan, r: Route) -> str:
    """The block sizes route ``r`` copies: its size classes, narrowed to what its
    implementations take together (the smallest and largest block, and an alignment they
    all need)."""
    names = [n for n in (r.impl, r.small_batch_impl, *r.fallbacks) if n]
    cons = [next((c.constraints for c in p.candidates if c.name == n), {}) for n in names]
    lo = max(r.min_bytes, min(c.get("min_block_bytes", 1) for c in cons))
    tops = [c.get("max_block_bytes") for c in cons]
    hi = None if None in tops else max(tops)
    if hi is not None and (r.max_bytes is None or hi < r.max_bytes):
        upper = f" <= {human_bytes(hi)}"
    else:
        upper = "" if r.max_bytes is None else f" < {human_bytes(r.max_bytes + 1)}"
    align = min(c.get("alignment", 1) for c in cons)
    return f"{human_bytes(lo)} <= block{upper}" + (f", multiples of {align} B" if align > 1 else "")


def _us(us: float) -> str:
    """Microseconds as a person reads them: 85 us, 1.2 ms."""
    return f"{us:.0f} µs" if us < 1000 else f"{us / 1000:.3g} ms"


def _constrained(p: Plan, impl: str) -> bool:
    """Whether ``impl`` can refuse a descriptor (so its fallbacks are worth a line)."""
    c = next((c.constraints for c in p.candidates if c.name == impl), {})
    return c.get("alignment", 1) > 1 or c.get("min_block_bytes", 1) > 1 or c.get("max_block_bytes") is not None


def calibration_lines(cal: Mapping[str, Any], device: DeviceInfo) -> list[str]:
    """Where the calibration comes from and what it is worth here, in words
    (``Calibration.summary()``): what ``explain()`` and ``kvswap info`` both say."""
    state = "measured" if cal.get("calibrated") else "NOT calibrated: run `kvswap calibrate` on this device"
    if cal.get("calibrated") and is_shipped(str(cal.get("source"))):
        state = "measured on another machine of this kind, shipped with kvswap: `kvswap calibrate` measures this one"
    if cal.get("calibrated") and cal.get("host_reference"):
        state = "host reference: host memory copies timed on a machine without an accelerator, not a device calibration"
    lines = [f"calibration: {cal.get('source')} ({state})"]
    then, now = cal.get("driver_version"), device.driver_version
    if then and now and "unknown" not in (then, now) and then != now:
        lines.append(f"calibration driver: measured under driver {then}; this device runs driver {now}, so its "
                     "numbers may not hold (`kvswap calibrate` measures it under this one)")
    return lines


def _explain_lines(p: Plan) -> list[str]:
    d = p.device
    lines = [
        f"kvswap plan for {p.direction} on {d.platform} device {d.name!r} (identity {d.identity})",
        f"  device: {d.compute_units} compute units, arch {d.arch}, driver {d.driver_version}, "
        f"runtime {d.runtime_version}, link {d.link}",
        f"  policy: prefer={p.policy.prefer}, max_sms={p.policy.max_sms}, force={p.policy.force}",
    ]
    cal = p.calibration
    lines += ["  " + line for line in calibration_lines(cal, d)]
    if not p.forced and not cal.get("host_cost"):
        lines.append("  host thread time per call: unmeasured, so no route is excluded by it "
                     "(`kvswap calibrate --only host-cost --update PROFILE` measures it)")
    if p.forced:
        lines.append(f"  forced: {p.forced}")
    lines.append("  candidates:")
    width = max([len(c.name) for c in p.candidates] + [4])
    for c in p.candidates:
        mark = "+" if c.available else "-"
        status = "available" if c.available else f"rejected: {c.reason}"
        bound = p.params.get(c.name)
        extra = f", bound with {', '.join(f'{k}={v}' for k, v in bound.items())}" if bound else ""
        tiers = sorted({k for r in p.routes if r.impl == c.name for _, k in r.sms_by_batch if k}
                       - {(bound or {}).get("num_sms")})
        if tiers:
            extra += f" (and {', '.join(map(str, tiers))} SMs for the batch tiers of its routes)"
        lines.append(f"    {mark} {c.name:<{width}}  {c.kind:<6} (plugin {c.plugin}) {status}{extra}")
    lines.append("  routes by block size:")
    for r in p.routes:
        span = _span(p, r)
        pred = ", ".join(f"{n} {g:.1f}" if g is not None else f"{n} ?" for n, g in r.predicted)
        line = f"    {span:<28} -> {r.impl}"
        if pred:
            line += f"  (GB/s predicted at {human_bytes(r.at_bytes)}: {pred})"
        lines.append(line)
        if r.small_batch_impl and r.min_batch > 1:
            lines.append(f"    {'':<28}    batches under {r.min_batch} descriptors -> {r.small_batch_impl}")
        for i, (start, sms) in enumerate(r.sms_by_batch):
            lo = max(start if i else 1, r.min_batch if r.small_batch_impl else 1)
            end = r.sms_by_batch[i + 1][0] if i + 1 < len(r.sms_by_batch) else None
            if end is not None and end <= lo:
                continue
            which = f"{lo}+" if end is None else f"{lo}-{end - 1}"
            to = f"{r.impl} on {sms} SMs" if sms else r.small_batch_impl
            lines.append(f"    {'':<28}    batches of {which} descriptors -> {to}")
        held = [(n, r.held_us(n, r.host_at)) for n, _, _ in r.host_cost]
        if any(us is not None for _, us in held):
            each = ", ".join(f"{n} ~{_us(us)}" for n, us in held if us is not None)
            lines.append(f"    {'':<28}    holds the calling thread for {r.host_at} descriptors: {each}"
                         + "".join(f", {n} unmeasured" for n, us in held if us is None))
        for name, host, other_us, other in r.excluded:
            lines.append(f"    {'':<28}    {name} excluded: holds the thread {_us(host)} > {_us(other_us)} "
                         f"for the whole transfer on {other} ({r.host_at} descriptors)")
        if r.fallbacks and _constrained(p, r.impl):
            lines.append(f"    {'':<28}    descriptors {r.impl} refuses -> {', '.join(r.fallbacks)}")
    for note in p.notes:
        lines.append(f"  note: {note}")
    return lines
