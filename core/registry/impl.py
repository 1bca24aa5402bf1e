"""CopyImpl: the frozen, self-checking description of one way to copy a batch of blocks."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol

import numpy as np

from ..addressing.descriptors import misaligned
from ..errors import InvalidImplError
from ..types import DeviceInfo, Direction, as_int
from .failures import describe

KINDS = ("batch", "kernel", "staged")
_NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z0-9_]+)+$")


class TransferFn(Protocol):
    """What a CopyImpl's factory returns; called per transfer with validated descriptors.

    ``src``, ``dst`` and ``sizes`` are 1-D, C-contiguous int64 numpy arrays of equal length
    (addresses and byte counts); ``stream`` is what the caller passed (None: the current one).
    Core has validated the whole batch (:func:`kvswap.addressing.descriptors.validate`): every size is
    at least 1, no address is null or negative, no range ends past ``2**63 - 1``, no two
    destinations overlap and no destination overlaps a source; and every descriptor meets
    the impl's declared constraints. An implementation need not check any of it again.
    """

    def __call__(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any) -> None: ...


class Launch(Protocol):
    """What :meth:`ByIdsFn.pack` returns: ``launch(stream)`` enqueues the copy on
    ``stream``; ``launch.cancel()`` releases what was packed where the launch never comes."""

    def __call__(self, stream: Any) -> Any: ...

    def cancel(self) -> None: ...


class ByIdsFn:
    """A transfer bound to a BlockMover's descriptor template, which copies blocks by id: what
    ``fn.by_ids(template)`` returns where the implementation declares :attr:`CopyImpl.by_ids`
    (or None where the template does not suit it). Backends subclass it and implement
    ``__call__``; :meth:`pack` and :meth:`launch_only` have defaults.

    ``template`` has 1-D int64 arrays ``src_base``, ``src_stride``, ``dst_base``,
    ``dst_stride`` and ``sizes``, one entry per piece. A call copies, for every ``i`` and
    piece ``p``, ``sizes[p]`` bytes from ``src_base[p] + src_ids[i] * src_stride[p]`` to
    ``dst_base[p] + dst_ids[i] * dst_stride[p]``, enqueued on ``stream`` like a TransferFn.
    The caller has validated the template once and the ids per call (in range, no
    destination repeated): the same whole-batch guarantee a TransferFn gets. The id arrays
    are the caller's only during the call.
    """

    def __call__(self, src_ids: np.ndarray, dst_ids: np.ndarray, stream: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(src_ids, dst_ids, stream)")

    def pack(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> Launch:
        """The host half of a call: the ids copied where the launch reads them (pinned
        memory, say), and the rest returned as a :class:`Launch`. BlockMover packs a job's
        ids before it records the job's start marker, so that a job's time is the device's.
        The default copies the ids and leaves the whole call to the launch."""
        return _WholeCall(self, src_ids.copy(), dst_ids.copy())

    def launch_only(self, n: int) -> bool:
        """Whether the launch of ``n`` packed id pairs only enqueues launches (no stream
        switch, no host-side copy to the device): a device BlockMover may then make it in
        ``submit`` on the engine's thread. The default says no."""
        return False


class _WholeCall:
    __slots__ = ("fn", "src", "dst")

    def __init__(self, fn: ByIdsFn, src: np.ndarray, dst: np.ndarray) -> None:
        self.fn, self.src, self.dst = fn, src, dst

    def __call__(self, stream: Any) -> Any:
        return self.fn(self.src, self.dst, stream)

    def cancel(self) -> None:
        pass


def same_addresses(addrs: np.ndarray) -> np.ndarray:
    """The host address translation where host and device share addresses: none."""
    return addrs


@dataclass(frozen=True)
class BindContext:
    """Everything a factory may use to bind tuned parameters once, at resolve time.

    :ivar params: tuned parameters chosen by the resolver for this route (``num_sms`` for
        kernels), already capped by the policy.
    :ivar translate_host: maps host addresses to addresses the device can dereference in a
        kernel; :func:`same_addresses` (compare with ``is`` to skip the work) where host and
        device share addresses.
    :ivar link: for a ``"staged"`` implementation, the bound transfer of a batch route of
        the same direction (the copy engines), which moves its contiguous runs over the
        link; None for the other kinds.
    """

    direction: Direction
    device: DeviceInfo
    params: Mapping[str, Any] = field(default_factory=dict)
    translate_host: Callable[[np.ndarray], np.ndarray] = same_addresses
    link: Optional[TransferFn] = None


def _always(device: DeviceInfo) -> Optional[str]:
    return None


@dataclass(frozen=True)
class CopyImpl:
    """One implementation a backend offers.

    :param name: dotted, lower-case, unique (``"cuda.batch"``, ``"triton.kernel"``).
    :param kind: ``"batch"`` (copy engine; uses no SMs), ``"kernel"`` (occupies SMs) or
        ``"staged"`` (a short device-side gather or scatter on SMs between the scattered
        blocks and a staging buffer, and the copy engines over the link; bound with
        :attr:`BindContext.link`).
    :param platforms: platforms it serves (``"cuda"``, ``"rocm"``, ``"cpu"``, …).
    :param directions: the directions it copies (strings or :class:`Direction`).
    :param factory: ``factory(BindContext) -> TransferFn``, called once per resolve.
    :param availability: ``availability(DeviceInfo) -> None | reason``; a reason says why not.
    :param alignment: addresses and sizes must be multiples of this (power of two).
    :param min_block_bytes: smallest descriptor size it accepts.
    :param max_block_bytes: largest descriptor size it accepts (None: unbounded).
    :param requires_pinned: host memory must be page-locked (and mapped for kernels).
    :param mixed_sizes: whether one call may mix descriptor sizes.
    :param by_ids: its bound transfers offer ``fn.by_ids(template) -> ByIdsFn | None``: a
        BlockMover then sends block ids, not descriptors (:class:`ByIdsFn`).
    :param description: one line for ``kvswap info``.
    """

    name: str
    kind: str
    platforms: tuple[str, ...]
    directions: tuple[Direction, ...]
    factory: Callable[[BindContext], TransferFn]
    availability: Callable[[DeviceInfo], Optional[str]] = _always
    alignment: int = 1
    min_block_bytes: int = 1
    max_block_bytes: Optional[int] = None
    requires_pinned: bool = False
    mixed_sizes: bool = True
    by_ids: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        def bad(msg: str) -> InvalidImplError:
            return InvalidImplError(f"CopyImpl {self.name!r}: {msg}")

        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise bad(f"name must look like 'platform.route' and match {_NAME.pattern}")
        if self.kind not in KINDS:
            raise bad(f"kind={self.kind!r} is not valid; choose one of {KINDS}")
        platforms = (self.platforms,) if isinstance(self.platforms, str) else tuple(self.platforms)
        if not platforms or not all(isinstance(p, str) and p for p in platforms):
            raise bad(f"platforms={self.platforms!r} must be a non-empty tuple of names")
        object.__setattr__(self, "platforms", platforms)
        raw = (self.directions,) if isinstance(self.directions, (str, Direction)) else self.directions
        try:
            directions = tuple(Direction.parse(d) for d in raw)
        except Exception as e:
            raise bad(str(e)) from e
        if not directions or len(set(directions)) != len(directions):
            raise bad(f"directions={self.directions!r} must be non-empty without repeats")
        object.__setattr__(self, "directions", directions)
        if not callable(self.factory):
            raise bad("factory must be callable: factory(BindContext) -> TransferFn")
        if not callable(self.availability):
            raise bad("availability must be callable: availability(DeviceInfo) -> None | reason")
        for name in ("alignment", "min_block_bytes", "max_block_bytes"):
            value = getattr(self, name)
            if value is not None and as_int(value) is not None:
                object.__setattr__(self, name, as_int(value))
        a, lo, hi = self.alignment, self.min_block_bytes, self.max_block_bytes
        if as_int(a) is None or a < 1 or a & (a - 1):
            raise bad(f"alignment={a!r} must be a power of two >= 1")
        if as_int(lo) is None or lo < 1:
            raise bad(f"min_block_bytes={lo!r} must be an int >= 1")
        if hi is not None and (as_int(hi) is None or hi < lo):
            raise bad(f"max_block_bytes={hi!r} must be None or an int >= min_block_bytes ({lo})")
        if hi is not None and -(-lo // a) * a > hi:
            raise bad(f"accepts no block size: no multiple of alignment={a} lies between "
                      f"min_block_bytes={lo} and max_block_bytes={hi}")
        for name in ("requires_pinned", "mixed_sizes", "by_ids"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise bad(f"{name}={value!r} must be True or False")
            object.__setattr__(self, name, bool(value))
        if not isinstance(self.description, str):
            raise bad(f"description={self.description!r} must be a str (one line for `kvswap info`)")

    @property
    def uses_sms(self) -> bool:
        return self.kind == "kernel"

    def unavailable_reason(self, device: DeviceInfo) -> Optional[str]:
        """None when usable on ``device``, else the reason (:meth:`own_reason` where the
        device is of a platform it serves)."""
        if device.platform not in self.platforms:
            return f"serves platforms {', '.join(self.platforms)}, not {device.platform}"
        return self.own_reason(device)

    def own_reason(self, device: DeviceInfo) -> Optional[str]:
        """What the availability check says of ``device``: None, or a non-empty reason; a
        check that raises, or answers anything else, counts as unavailable, saying so."""
        try:
            reason = self.availability(device)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # a broken check must not break resolution
            return f"availability check raised {describe(e)}"
        if reason is not None and (not isinstance(reason, str) or not reason.strip()):
            return f"availability check returned {reason!r} instead of None or a reason"
        return reason

    def accepts_size(self, block_bytes: int) -> bool:
        if block_bytes < self.min_block_bytes or block_bytes % self.alignment:
            return False
        return self.max_block_bytes is None or block_bytes <= self.max_block_bytes

    def accepts_range(self, block_bytes: int) -> bool:
        """Whether the size bounds (not the alignment) admit ``block_bytes``."""
        if block_bytes < self.min_block_bytes:
            return False
        return self.max_block_bytes is None or block_bytes <= self.max_block_bytes

    def refused(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Boolean mask of the descriptors this implementation's constraints refuse."""
        bad = misaligned(src, dst, sizes, self.alignment)
        if self.min_block_bytes > 1:
            bad |= sizes < self.min_block_bytes
        if self.max_block_bytes is not None:
            bad |= sizes > self.max_block_bytes
        return bad

    def why_refused(self, src: int, dst: int, size: int) -> str:
        a = self.alignment
        if (src | dst | size) & (a - 1):
            return f"addresses and size must be multiples of {a} bytes"
        if size < self.min_block_bytes:
            return f"size must be >= {self.min_block_bytes} bytes"
        return f"size must be <= {self.max_block_bytes} bytes"

    def constraints(self) -> dict[str, Any]:
        return {
            "alignment": self.alignment,
            "min_block_bytes": self.min_block_bytes,
            "max_block_bytes": self.max_block_bytes,
            "requires_pinned": self.requires_pinned,
            "mixed_sizes": self.mixed_sizes,
        }
