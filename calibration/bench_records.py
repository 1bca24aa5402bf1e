"""What ``kvswap bench`` records: one row per point, a summary per direction, the run.

Dataclasses; :meth:`BenchResult.to_dict` is the JSON ``kvswap bench --json`` writes (ratios
are resolved over another contender in GB/s, each with its standard error, ``_se``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional


@dataclass(frozen=True)
class BenchFailure:
    """A contender that could not be bound, or copied the wrong bytes at a point."""

    direction: str
    route: str
    error: str
    block_bytes: Optional[int] = None
    batch: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None or k in ("direction", "route", "error")}

    def describe(self) -> str:
        at = f" at {self.batch} x {self.block_bytes} B" if self.block_bytes else ""
        return f"{self.direction} {self.route}{at}: {self.error}"


@dataclass(frozen=True)
class CandidateTiming:
    """One candidate at a point: its GB/s, the SMs it ran on, resolved over it."""

    impl: str
    gbps: float
    num_sms: Optional[int]
    resolved_over: Optional[float]
    resolved_over_se: Optional[float]


@dataclass(frozen=True)
class ResolvedTiming:
    gbps: Optional[float]
    route: str  # what the resolved function ran at this point, as the tables name routes


@dataclass(frozen=True)
class PeerTiming:
    gbps: float
    route: str
    same_route: bool  # the peer runs the very route resolved does: identical work


@dataclass
class Ratios:
    """Resolved over the best candidate and over the peer, each with its standard error."""

    resolved_over_best: Optional[float] = None
    resolved_over_best_se: Optional[float] = None
    resolved_over_peer: Optional[float] = None
    resolved_over_peer_se: Optional[float] = None

    @property
    def over_best(self) -> tuple[Optional[float], Optional[float]]:
        return self.resolved_over_best, self.resolved_over_best_se

    @property
    def over_peer(self) -> tuple[Optional[float], Optional[float]]:
        return self.resolved_over_peer, self.resolved_over_peer_se


@dataclass
class Confirm(Ratios):
    """A point under a bar timed again after the grid: ``passes`` more, against ``best``."""

    passes: int = 0
    best: Optional[str] = None


@dataclass
class BenchRow(Ratios):
    """One point of the grid."""

    direction: str = ""
    block_bytes: int = 0
    batch: int = 0
    ceiling_gbps: float = 0.0
    candidates: dict[str, CandidateTiming] = field(default_factory=dict)
    best: Optional[str] = None
    resolved: ResolvedTiming = ResolvedTiming(None, "")
    peer: Optional[PeerTiming] = None
    repeats: int = 0
    confirm: Optional[Confirm] = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.confirm is None:
            del d["confirm"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchRow:
        peer, confirm = d.get("peer"), d.get("confirm")
        return cls(
            d.get("resolved_over_best"), d.get("resolved_over_best_se"), d.get("resolved_over_peer"),
            d.get("resolved_over_peer_se"), direction=d["direction"], block_bytes=d["block_bytes"], batch=d["batch"],
            ceiling_gbps=d.get("ceiling_gbps", 0.0),
            candidates={k: CandidateTiming(**v) for k, v in d.get("candidates", {}).items()},
            best=d.get("best"), resolved=ResolvedTiming(**d["resolved"]),
            peer=PeerTiming(**peer) if peer else None, repeats=d.get("repeats", 0),
            confirm=Confirm(**confirm) if confirm else None,
        )


@dataclass(frozen=True)
class Summary:
    """A direction's rows in numbers: the worst ratios, the points under each bar (all, and
    those under it by more than two standard errors), identical work's range, and where
    points were timed again (``confirmed_*``, None where none were) how many stayed under."""

    points: int
    min_resolved_over_best: Optional[float]
    min_resolved_over_peer: Optional[float]
    under_best_bar: int
    under_best_bar_beyond_noise: int
    under_peer: int
    under_peer_beyond_noise: int
    under_peer_same_route: int
    same_work_pairs: int
    same_work_min: Optional[float]
    same_work_max: Optional[float]
    confirmed_points: Optional[int] = None
    confirmed_under_best_bar: Optional[int] = None
    confirmed_under_best_bar_beyond_noise: Optional[int] = None
    confirmed_under_peer: Optional[int] = None
    confirmed_under_peer_beyond_noise: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)
                if not (f.name.startswith("confirmed_") and getattr(self, f.name) is None)}


@dataclass
class BenchResult:
    """A whole ``kvswap bench`` run."""

    kvswap_version: str
    device: dict[str, Any]
    directions: list[str]
    measured: str
    host_only: bool
    timer: str
    settings: dict[str, Any]
    peer_policy: str
    calibration: dict[str, dict[str, Any]] = field(default_factory=dict)
    ceiling_gbps: dict[str, float] = field(default_factory=dict)
    rows: list[BenchRow] = field(default_factory=list)
    summary: dict[str, Summary] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    failures: list[BenchFailure] = field(default_factory=list)

    def rows_of(self, direction: str) -> list[BenchRow]:
        return [r for r in self.rows if r.direction == direction]

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(rows=[r.to_dict() for r in self.rows], summary={k: s.to_dict() for k, s in self.summary.items()},
                 failures=[f.to_dict() for f in self.failures])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchResult:
        """A result read back from ``kvswap bench --json`` (tables redrawn from a file)."""
        return cls(
            kvswap_version=d.get("kvswap_version", ""), device=d.get("device", {}), directions=list(d["directions"]),
            measured=d.get("measured", ""), host_only=d.get("host_only", False), timer=d.get("timer", ""),
            settings=d.get("settings", {}), peer_policy=d.get("peer_policy", ""),
            calibration=d.get("calibration", {}), ceiling_gbps=d.get("ceiling_gbps", {}),
            rows=[BenchRow.from_dict(r) for r in d.get("rows", [])],
            summary={k: Summary(**v) for k, v in d.get("summary", {}).items()},
            notes=list(d.get("notes", [])), failures=[BenchFailure(**f) for f in d.get("failures", [])],
        )
