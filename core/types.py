"""The small value types engines and plugins share: Direction, DeviceInfo, Policy."""
from __future__ import annotations

import enum
import math
import numbers
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import numpy as np

from .errors import ConfigurationError


class Direction(str, enum.Enum):
    """Which way a transfer goes. Plain strings ``"h2d"``/``"d2h"``/``"d2d"`` are accepted anywhere.

    ``d2d`` copies between two allocations of one device: neither side is host memory.
    """

    H2D = "h2d"
    D2H = "d2h"
    D2D = "d2d"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: DirectionLike) -> Direction:
        if isinstance(value, Direction):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ConfigurationError(
                f"direction={value!r} is not valid; choose one of {', '.join(repr(d.value) for d in cls)}"
            ) from None

    @property
    def src_is_host(self) -> bool:
        return self is Direction.H2D

    @property
    def dst_is_host(self) -> bool:
        return self is Direction.D2H

    @property
    def crosses_host(self) -> bool:
        """True when one side is host memory: the copy crosses the host link, the one
        calibration measures by default (h2d and d2h, not d2d)."""
        return self.src_is_host or self.dst_is_host


DirectionLike = Union[Direction, str]


def as_int(value: Any) -> Optional[int]:
    """``value`` as a Python int when it is an integer (a numpy integer scalar too, never a
    bool), else None."""
    if isinstance(value, bool) or isinstance(value, np.bool_):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    return None


def whole(value: Any, name: str, minimum: int = 0) -> int:
    """``value`` as an int where it is a whole number: an int, a numpy integer or an
    integral float (``8.0``, ``4e9``, as JSON and YAML configurations write numbers), never
    a bool. Every number an engine or a command line gives kvswap is read this way.

    :raises ConfigurationError: anything else, or below ``minimum``, in one wording.
    """
    n = as_int(value)
    if (n is None and isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
            and math.isfinite(value) and float(value).is_integer()):
        n = int(value)
    if n is None or n < minimum:
        shown = f"{name}={value!r}" if name else repr(value)
        raise ConfigurationError(f"{shown} must be a whole number >= {minimum}")
    return n


_IDENTITY = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


def slug(text: str) -> str:
    """Lower-case ``text`` into the characters an identity key may hold."""
    out = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")
    return out or "unknown"


@dataclass(frozen=True)
class DeviceInfo:
    """What kvswap knows of the device it resolves for.

    ``identity`` is the key calibration profiles are looked up by: stable across runs and
    processes for the same kind of device on the same kind of link, and made only of
    ``[a-z0-9._-]``. ``compute_units`` counts SMs (CUDA), CUs (ROCm) or CPU cores.
    """

    platform: str
    name: str
    identity: str
    compute_units: int
    index: int | None = None
    arch: str = "unknown"
    driver_version: str = "unknown"
    runtime_version: str = "unknown"
    link: str = "unknown"
    pci_bus_id: str = "unknown"
    details: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.platform or not isinstance(self.platform, str):
            raise ConfigurationError(f"DeviceInfo.platform={self.platform!r} must be a non-empty string")
        if not _IDENTITY.match(self.identity or ""):
            raise ConfigurationError(
                f"DeviceInfo.identity={self.identity!r} must match {_IDENTITY.pattern}"
            )
        units = as_int(self.compute_units)
        if units is None or units < 0:
            raise ConfigurationError(
                f"DeviceInfo.compute_units={self.compute_units!r} must be a non-negative int"
            )
        object.__setattr__(self, "compute_units", units)
        if self.index is not None:
            index = as_int(self.index)
            if index is None or index < 0:
                raise ConfigurationError(f"DeviceInfo.index={self.index!r} must be None or a non-negative int")
            object.__setattr__(self, "index", index)

    @property
    def torch_device(self) -> str:
        """The torch device string for this device (``"cpu"`` or ``"cuda:N"``)."""
        if self.platform == "cpu":
            return "cpu"
        return f"{self.details.get('torch_type', 'cuda')}:{self.index or 0}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PREFERENCES = ("throughput", "low_interference")
# A staged route's device buffer per mover: two halves of 32 MiB, each crossing the link in
# about 0.6 ms at 55 GB/s while the other is gathered or scattered.
STAGING_BYTES = 64 << 20


@dataclass(frozen=True)
class Policy:
    """What the engine is willing to give for speed.

    :param max_sms: the most SMs (CUs) a kernel route may occupy; ``0`` forbids kernel
        routes, ``None`` lets calibration decide. Numbers are whole numbers, an integral
        float (``8.0``) included (:func:`whole`).
    :param prefer: ``"throughput"`` ranks by predicted bandwidth alone and runs a kernel
        on more SMs than its knee for the batch sizes where calibration found that faster;
        ``"low_interference"`` discounts each route by the compute slowdown it causes and
        keeps kernels on their knee.
    :param force: an implementation name to use for every transfer; resolution fails if
        it cannot be honoured.
    :param require_pinned: a BlockMover refuses pageable host tensors
        (:class:`~kvswap.UnpinnedMemoryError`) instead of staging them through pinned
        buffers, the slower route it takes by default.
    :param coalesce: merge descriptors that are contiguous on both sides into one where
        that shortens a batch by a quarter or more (a batch copy pays per descriptor).
    :param staging_bytes: device memory a staged route may hold per mover (allocated once,
        reused by every job; a job larger than it moves in slices). ``0`` turns staged
        routes off.
    """

    max_sms: int | None = None
    prefer: str = "throughput"
    force: str | None = None
    require_pinned: bool = False
    coalesce: bool = True
    staging_bytes: int = STAGING_BYTES

    def __post_init__(self) -> None:
        if self.max_sms is not None:
            object.__setattr__(self, "max_sms", whole(self.max_sms, "Policy.max_sms"))
        if not isinstance(self.coalesce, bool):
            raise ConfigurationError(f"Policy.coalesce={self.coalesce!r} must be True or False")
        if self.prefer not in PREFERENCES:
            raise ConfigurationError(
                f"Policy.prefer={self.prefer!r} is not valid; choose one of {', '.join(map(repr, PREFERENCES))}"
            )
        if self.force is not None and (not isinstance(self.force, str) or not self.force):
            raise ConfigurationError(f"Policy.force={self.force!r} must be None or an impl name")
        if not isinstance(self.require_pinned, bool):
            raise ConfigurationError(f"Policy.require_pinned={self.require_pinned!r} must be True or False")
        object.__setattr__(self, "staging_bytes", whole(self.staging_bytes, "Policy.staging_bytes"))
