"""Routes bound for measurement: an impl forced through ``kvswap.resolve()``, exactly as an
engine gets it, at an exact SM count, and what a route that failed leaves behind.

Shared by the sweep, the host-cost measurement and the bench.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from kvswap import Calibration, DeviceInfo, Direction, Policy, resolve
from kvswap.registry.plugins import PluginHost

from .records import Failure


def measurement_calibration(device: DeviceInfo, num_sms: Optional[int]) -> Calibration:
    """What the resolver decides by while a route is bound for measurement: the kernel at
    exactly ``num_sms`` SMs, and nothing from a profile this run may be about to replace."""
    sms = {str(d): num_sms for d in Direction} if num_sms else {}
    return Calibration(
        source=f"kvswap calibrate: bound at {num_sms or 'no'} SMs for measurement",
        platform=device.platform, scope="device", kernel_sms=sms, identity=device.identity,
    )


def bound_at(direction: Any, dev: DeviceInfo, device: Any, host: Optional[PluginHost], impl: str,
             num_sms: Optional[int]) -> Any:
    """``impl`` forced through ``resolve()`` and bound at exactly ``num_sms`` SMs."""
    return resolve(direction, device=device, host=host, policy=Policy(force=impl, max_sms=num_sms),
                   calibration=measurement_calibration(dev, num_sms), profiles=False)


@dataclass
class Bound:
    """One route as measured: an impl forced through resolve(), bound at ``num_sms``."""

    impl: str
    kind: str
    num_sms: Optional[int]
    fn: Any
    constraints: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.impl}@{self.num_sms}" if self.num_sms else self.impl

    def accepts(self, block_bytes: int) -> bool:
        c = self.constraints
        if block_bytes < c.get("min_block_bytes", 1) or block_bytes % c.get("alignment", 1):
            return False
        return c.get("max_block_bytes") is None or block_bytes <= c["max_block_bytes"]

    def call(self, src: Any, dst: Any, sizes: Any) -> Any:
        """``call(stream)``: one copy of these descriptors on ``stream``."""
        fn = self.fn
        return lambda stream: fn(src, dst, sizes, stream=stream)


@dataclass
class Failures:
    """Routes that failed, and why; a failed route is retired for the rest of the run."""

    records: list[Failure] = field(default_factory=list)
    dead: set[tuple[str, str, Optional[int]]] = field(default_factory=set)

    def add(self, direction: Any, impl: str, sms: Optional[int], block: Optional[int], e: BaseException) -> None:
        self.dead.add((str(direction), impl, sms))
        self.records.append(Failure(str(direction), impl, sms, block, f"{type(e).__name__}: {e}"))

    def retired(self, direction: Any, bound: Bound) -> bool:
        return (str(direction), bound.impl, bound.num_sms) in self.dead
