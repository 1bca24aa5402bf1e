"""What a calibration run records: timings and failures. Plain data, JSON-ready."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Optional

# Stages of a run: the contiguous ceiling, every route over block sizes at a large batch,
# and the kernel against the batch route over batch sizes (for the minimum batch).
CEILING, SIZE, BATCH = "ceiling", "size", "batch"


@dataclass(frozen=True)
class Measurement:
    """The median time of one route copying ``batch`` blocks of ``block_bytes``.

    ``kind`` is the impl's kind (``"batch"``, ``"kernel"``) or ``"ceiling"`` for the
    contiguous copy; ``num_sms`` is what a kernel was bound with (None otherwise);
    ``spread`` is the median absolute deviation of the timed repeats as a fraction of
    their median (0 where not recorded): how far one call strays. ``paired_spread`` is
    that of the route's round-by-round ratio to the reference route timed beside it
    (:meth:`~.sweep.Sweep.record`; 0 for the reference itself, None in profiles written
    before it was recorded): how far the comparison strays, without what the machine did
    to both routes at once.
    """

    direction: str
    stage: str
    impl: str
    kind: str
    num_sms: Optional[int]
    block_bytes: int
    batch: int
    seconds: float
    repeats: int
    spread: float = 0.0
    paired_spread: Optional[float] = None

    @property
    def compared_spread(self) -> float:
        """The spread to weigh a comparison with other routes of the same point by."""
        return self.spread if self.paired_spread is None else self.paired_spread

    @property
    def nbytes(self) -> int:
        return self.block_bytes * self.batch

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["gbps"] = round(self.gbps, 4)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurement:
        # Fields added since a profile was written take their defaults.
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


@dataclass(frozen=True)
class Failure:
    """A route that could not be measured, and why; the run goes on without it."""

    direction: str
    impl: str
    num_sms: Optional[int]
    block_bytes: Optional[int]
    error: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        sms = f" on {self.num_sms} SMs" if self.num_sms else ""
        at = f" at {self.block_bytes} B blocks" if self.block_bytes else ""
        return f"{self.direction} {self.impl}{sms}{at}: {self.error}"
