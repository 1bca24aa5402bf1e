"""What a conformance run certifies: one registered CopyImpl on the present device, and the
cases (block sizes, constraint violations) its declaration implies."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..cli.inventory import KNOWN_PLATFORMS
from ..errors import ConfigurationError
from ..registry.impl import CopyImpl
from ..registry.platform import detect
from ..registry.plugins import PluginHost, plugin_host
from ..resolution.resolver import collect_impls
from ..types import DeviceInfo
from .memory import round_up

KiB, MiB = 1 << 10, 1 << 20
# Largest block copied when an impl declares no maximum, and the bytes one call moves at
# most: on an accelerator, past every tiling boundary we know of; on a host-only device
# (where a Triton kernel runs in its interpreter at well under 1 GB/s) small enough to
# keep the whole suite to seconds.
CAP = {"host": 256 * KiB, "accelerator": 4 * MiB}
BUDGET = {"host": 512 * KiB, "accelerator": 16 * MiB}
# A refused size above this is not allocated (a backend that wrongly copies it would need
# that much memory); the violation is then reported as skipped.
REFUSAL_CAP = 16 * MiB
THOUSANDS = 3000  # not a power of two: grid and tile tails must be handled
THOUSANDS_BUDGET = 64 * MiB  # fewer blocks when the smallest accepted one is large
# The odd-size case: this many descriptors of odd sizes at odd addresses, up to this size.
ODD_COUNT = 1200
ODD_SPAN = 3 * KiB


class KitUsageError(Exception):
    """The run cannot start: no such impl for this device, or a device that is not there."""


@dataclass(frozen=True)
class Violation:
    """One way to break a declared constraint, and the descriptor that does it."""

    label: str
    size: int
    src_shift: int = 0
    dst_shift: int = 0


@dataclass(frozen=True)
class Target:
    """The implementation under test, the plugin that registered it, and the device.

    :ivar unavailable: the impl's own reason it cannot run on ``device``, or None.
    """

    impl: CopyImpl
    plugin: str
    device: DeviceInfo
    device_spec: Optional[str]
    host: PluginHost
    unavailable: Optional[str]

    @property
    def torch_device(self) -> str:
        """``"cpu"`` for a host-only device (both sides of a transfer are host memory)."""
        spec = self.device.torch_device
        return "cpu" if spec.split(":")[0] == "cpu" else spec

    def describe(self) -> str:
        i, d = self.impl, self.device
        state = "available" if self.unavailable is None else f"UNAVAILABLE: {self.unavailable}"
        return (f"kvswap conformance kit: {i.name} ({i.kind}, plugin {self.plugin!r}, "
                f"{', '.join(map(str, i.directions))}) on {d.platform} device {d.name!r} "
                f"[{self.torch_device}] -- {state}")

    @property
    def memory(self) -> str:
        """``"host"`` (both sides host memory) or ``"accelerator"``: sets the size budgets."""
        return "host" if self.torch_device == "cpu" else "accelerator"

    def sizes(self) -> list[int]:
        """Block sizes across the declared range: both ends where they can be allocated,
        odd sizes when no alignment is declared, and the powers of two engines use."""
        impl, a, cap = self.impl, self.impl.alignment, CAP[self.memory]
        lo = int(round_up(impl.min_block_bytes, a))
        # An impl whose smallest block exceeds the cap is still tested, at its smallest.
        top = max(cap if impl.max_block_bytes is None else min(impl.max_block_bytes, cap), lo)
        wanted = [lo, lo + a, 1, 3, 8, 100, 1001, 4 * KiB, 4 * KiB + 8, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, cap, top]
        picked = {int(round_up(v, a)) for v in wanted}
        picked.add(top // a * a)
        return sorted(v for v in picked if 0 < v <= top and impl.accepts_size(v))

    def odd_sizes(self, rng: Any) -> list[int]:
        """:data:`ODD_COUNT` block sizes that are odd multiples of the alignment (odd byte
        counts where none is declared), spread over the accepted range up to a few KiB."""
        a, impl = self.impl.alignment, self.impl
        lo = int(round_up(impl.min_block_bytes, a)) // a
        hi = max(lo, min(ODD_SPAN // a, (impl.max_block_bytes or ODD_SPAN) // a))
        units = rng.integers(lo, hi + 1, ODD_COUNT) | 1
        units = np.where(units > hi, units - 2, units).clip(lo, None)
        return [int(u) * a for u in units]

    def count(self, size: int) -> int:
        return max(2, min(33, BUDGET[self.memory] // size))

    def small_size(self) -> int:
        """The smallest accepted size of at least 64 bytes (the thousands-of-blocks case)."""
        sizes = self.sizes()
        return next((s for s in sizes if s >= 64), sizes[-1])

    def thousands(self) -> int:
        """How many blocks of :meth:`small_size` the many-descriptors cases copy."""
        return max(2, min(THOUSANDS, THOUSANDS_BUDGET // self.small_size()))

    def violations(self) -> list[Violation]:
        """A descriptor breaking each constraint the impl declares."""
        impl, a, small = self.impl, self.impl.alignment, self.small_size()
        out = []
        if a > 1:
            out += [Violation("src-misaligned", small, src_shift=1),
                    Violation("dst-misaligned", small, dst_shift=1),
                    Violation("size-misaligned", small + 1)]
        if impl.min_block_bytes > 1:
            out.append(Violation("below-min", impl.min_block_bytes - 1))
        if impl.max_block_bytes is not None:
            out.append(Violation("above-max", int(round_up(impl.max_block_bytes + 1, a))))
        return out


def _registered_elsewhere(host: PluginHost, name: str, platform: str) -> list[str]:
    out = []
    for other in KNOWN_PLATFORMS:
        if other != platform and any(i.name == name for _, i in collect_impls(host, other)):
            out.append(other)
    return out


def not_loaded(host: PluginHost) -> str:
    """``; plugins not loaded: ...`` naming each with its reason, or nothing."""
    idle = [f"{r.name} ({r.status}: {r.reason})" for r in host.records.values() if r.status != "loaded"]
    return f"; plugins not loaded: {'; '.join(idle)}" if idle else ""


def registered_here(device: Optional[str]) -> str:
    """What ``--kvswap-impl`` may name on ``device``, in words (a usage error's advice)."""
    host = plugin_host()
    try:
        dev = detect(host, device)
    except ConfigurationError as e:
        return f"--kvswap-device={device!r}: {e}{not_loaded(host)}"
    names = sorted(i.name for _, i in collect_impls(host, dev.platform))
    return (f"registered for {dev.platform} device {dev.name!r}: {', '.join(names) or 'none'} (pass "
            f"--kvswap-device for a device of another platform){not_loaded(host)}")


def find_target(name: str, device: Optional[str]) -> Target:
    """The impl called ``name`` on ``device`` (None: the current accelerator, else the CPU).

    :raises KitUsageError: the device is not there, or no plugin registers ``name`` for
        its platform; the message says what is registered and which plugins did not load.
    """
    host = plugin_host()
    try:
        dev = detect(host, device)
    except ConfigurationError as e:
        raise KitUsageError(f"--kvswap-device={device!r}: {e}{not_loaded(host)}") from None
    registered = collect_impls(host, dev.platform)
    found = [(plugin, impl) for plugin, impl in registered if impl.name == name]
    if not found:
        msg = (f"--kvswap-impl={name!r} is not a registered implementation for platform "
               f"{dev.platform!r} (device {dev.name!r})")
        elsewhere = _registered_elsewhere(host, name, dev.platform)
        if elsewhere:
            msg += f"; it is registered for {', '.join(elsewhere)}: pass --kvswap-device for such a device"
        else:
            msg += "; if it serves another platform, pass --kvswap-device with a device of that platform"
        msg += f"; registered for {dev.platform}: {', '.join(sorted(i.name for _, i in registered)) or 'none'}"
        raise KitUsageError(msg + not_loaded(host))
    plugin, impl = found[0]
    return Target(impl, plugin, dev, device, host, impl.unavailable_reason(dev))
