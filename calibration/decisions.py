"""What a fit decides, as dataclasses that serialise to and from a profile's JSON.

A profile (``kvswap.profile/1``, read by :mod:`kvswap.resolution.profiles`) holds, besides the device
and how it was measured, the fields of :class:`Fitted`: ``curves`` (GB/s against block size
per route, the size sweep's), ``decisions`` (one :class:`Decision` per direction),
``ceiling_gbps``, ``slowdown_by_sms`` and ``host_cost``, each with its ``*_source`` in
words, and ``staged`` where the staged route was measured. ``to_dict()`` writes each as the
profile's JSON has it; ``from_dict()`` reads it back (fields a profile lacks take their
defaults).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from kvswap import Curve, Direction

Tiers = list[list[int]]  # [[from_batch, num_sms], ...]


@dataclass(frozen=True)
class SizeRoute:
    """The route at one measured block size: the fastest at the size sweep's batch."""

    block_bytes: int
    impl: str
    kind: str
    num_sms: Optional[int]
    gbps: float

    def to_dict(self) -> dict[str, Any]:
        return {"block_bytes": self.block_bytes, "impl": self.impl, "kind": self.kind, "num_sms": self.num_sms,
                "gbps": self.gbps}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SizeRoute:
        return cls(d["block_bytes"], d["impl"], d["kind"], d.get("num_sms"), d["gbps"])


@dataclass(frozen=True)
class ClassRoute:
    """The route for block sizes ``[min_bytes, max_bytes]`` (None: no upper end), as the
    resolver ranks the profile's curves (:mod:`kvswap.resolution.routing`); what ``explain()`` shows."""

    min_bytes: int
    max_bytes: Optional[int]
    impl: str
    kind: str
    num_sms: Optional[int]

    def to_dict(self) -> dict[str, Any]:
        return {"min_bytes": self.min_bytes, "max_bytes": self.max_bytes, "impl": self.impl, "kind": self.kind,
                "num_sms": self.num_sms}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClassRoute:
        return cls(d["min_bytes"], d.get("max_bytes"), d["impl"], d["kind"], d.get("num_sms"))


# What a direction carried over from the calibration in force keeps: the resolver's inputs.
CARRIED = ("kernel_sms", "kernel_min_batch", "min_batch_by_size", "kernel_sms_by_batch")


@dataclass
class Decision:
    """Everything decided for one direction (see :mod:`kvswap.calibration.fit`).

    ``carried_from`` names the calibration a direction this run did not measure was
    carried over from; such a decision holds only the resolver's inputs (:data:`CARRIED`).
    """

    knee_tolerance: Optional[float] = None
    by_size: list[SizeRoute] = field(default_factory=list)
    routes: list[ClassRoute] = field(default_factory=list)
    crossover_bytes: Optional[int] = None
    kernel_impl: Optional[str] = None
    kernel_sms: Optional[int] = None
    kernel_peak_sms: Optional[int] = None
    kernel_min_batch: Optional[int] = None
    min_batch_by_size: list[list[int]] = field(default_factory=list)
    kernel_sms_by_batch: list[list[Any]] = field(default_factory=list)  # [[block_bytes, Tiers], ...]
    carried_from: Optional[str] = None

    @property
    def uses_kernel(self) -> list[SizeRoute]:
        return [r for r in self.by_size if r.kind == "kernel"]

    def tiers(self) -> dict[int, Tiers]:
        return {b: t for b, t in self.kernel_sms_by_batch}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kernel_sms": self.kernel_sms, "kernel_min_batch": self.kernel_min_batch,
            "min_batch_by_size": [list(p) for p in self.min_batch_by_size],
            "kernel_sms_by_batch": [[b, [list(t) for t in tiers]] for b, tiers in self.kernel_sms_by_batch],
        }
        if self.carried_from is not None:
            return {"carried_from": self.carried_from, **out}
        return {
            "knee_tolerance": self.knee_tolerance, "by_size": [r.to_dict() for r in self.by_size],
            "routes": [r.to_dict() for r in self.routes], "crossover_bytes": self.crossover_bytes,
            "kernel_impl": self.kernel_impl, "kernel_peak_sms": self.kernel_peak_sms, **out,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Decision:
        return cls(
            knee_tolerance=d.get("knee_tolerance"),
            by_size=[SizeRoute.from_dict(r) for r in d.get("by_size", ())],
            routes=[ClassRoute.from_dict(r) for r in d.get("routes", ())],
            crossover_bytes=d.get("crossover_bytes"), kernel_impl=d.get("kernel_impl"),
            kernel_sms=d.get("kernel_sms"), kernel_peak_sms=d.get("kernel_peak_sms"),
            kernel_min_batch=d.get("kernel_min_batch"),
            min_batch_by_size=[list(p) for p in d.get("min_batch_by_size") or ()],
            kernel_sms_by_batch=[[b, [list(t) for t in tiers]] for b, tiers in d.get("kernel_sms_by_batch") or ()],
            carried_from=d.get("carried_from"),
        )


def curve_to_dict(c: Curve) -> dict[str, Any]:
    return {"impl": c.impl, "direction": str(c.direction), "num_sms": c.num_sms, "points": [list(p) for p in c.points]}


def curve_from_dict(d: Mapping[str, Any]) -> Curve:
    return Curve(d["impl"], Direction.parse(d["direction"]), tuple(map(tuple, d["points"])), d.get("num_sms"))


@dataclass
class Fitted:
    """The fields of a profile that a fit yields: what the resolver reads, and in words
    where the slowdown and the host cost came from."""

    curves: list[Curve] = field(default_factory=list)
    decisions: dict[str, Decision] = field(default_factory=dict)
    ceiling_gbps: dict[str, float] = field(default_factory=dict)
    # per direction, [route, num_sms, fraction] rows (kvswap.Calibration.slowdown_by_sms)
    slowdown_by_sms: dict[str, list[list[Any]]] = field(default_factory=dict)
    slowdown_source: str = "not measured"
    # per direction and route, [a_us, b_us] (kvswap.Calibration.host_cost)
    host_cost: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    host_cost_source: str = "not measured"
    # the staged route on a block-major host: curves by chunk size and how (kvswap.calibration.staged)
    staged: dict[str, Any] = field(default_factory=dict)

    def staged_curves(self, direction: str) -> list[Curve]:
        return [c for c in map(curve_from_dict, self.staged.get("curves", ())) if str(c.direction) == direction]

    def curves_of(self, direction: str) -> list[Curve]:
        return [c for c in self.curves if str(c.direction) == direction]

    def to_dict(self) -> dict[str, Any]:
        return {
            "curves": [curve_to_dict(c) for c in self.curves],
            "decisions": {d: dec.to_dict() for d, dec in self.decisions.items()},
            "ceiling_gbps": dict(self.ceiling_gbps),
            "slowdown_by_sms": {d: [list(r) for r in rows] for d, rows in self.slowdown_by_sms.items()},
            "slowdown_source": self.slowdown_source,
            "host_cost": {d: {r: list(v) for r, v in routes.items()} for d, routes in self.host_cost.items()},
            "host_cost_source": self.host_cost_source,
            **({"staged": self.staged} if self.staged else {}),  # absent where not measured: older profiles' shape
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> Fitted:
        """The fitted fields of a profile document (its other fields are ignored)."""
        return cls(
            curves=[curve_from_dict(c) for c in doc.get("curves", ())],
            decisions={d: Decision.from_dict(v) for d, v in doc.get("decisions", {}).items()},
            ceiling_gbps=dict(doc.get("ceiling_gbps", {})),
            slowdown_by_sms={d: [list(r) for r in rows] for d, rows in doc.get("slowdown_by_sms", {}).items()},
            slowdown_source=doc.get("slowdown_source", "not measured"),
            host_cost={d: dict(v) for d, v in doc.get("host_cost", {}).items()},
            host_cost_source=doc.get("host_cost_source", "not measured"),
            staged=dict(doc.get("staged") or {}),
        )
