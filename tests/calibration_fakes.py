"""A modelled platform for calibration tests: real host copies, modelled costs.

``ModelPlatform`` is a throwaway plugin for a platform ``modelplat`` whose "device memory"
is host memory. Its routes really copy (through the host reference), so the sweep's
poisoned-destination checks are real, and each call also adds what it *would* cost on a
device to a ledger. ``LedgerTimer`` stands in for the timer and reports those modelled
costs, so decisions come out of the real sweep, fit and resolver without any wall clock.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from kvswap import CopyImpl, DeviceInfo, Direction, hookimpl
from kvswap.registry.reference import host_copy

KiB = 1024
BOTH = (Direction.H2D, Direction.D2H)


def batch_gbps(b: int) -> float:
    """A copy engine with the small-block cliff of docs/design.md: slow below 32 KiB."""
    return 3.0 if b < 4 * KiB else 4.0 if b < 32 * KiB else 45.0 if b < 128 * KiB else 52.0


def kernel_gbps(b: int, sms: int) -> float:
    """A kernel: 6.5 GB/s per SM below 16 KiB, 13 below 64 KiB, 26 above; 50 GB/s cap."""
    per_sm = 6.5 if b < 16 * KiB else 13.0 if b < 64 * KiB else 26.0
    return min(50.0, per_sm * sms)


KERNEL_LAUNCH_S = 5e-6  # fixed cost of a kernel launch; the batch route has none
FILL_BYTES = 2 << 20  # ModelPlatform(fill_s=...): calls this large fill the link as soon on any SM count


def batch_cost(direction: str, b: int, n: int, sms: Optional[int]) -> float:
    return n * b / (batch_gbps(b) * 1e9)


def kernel_cost(direction: str, b: int, n: int, sms: Optional[int]) -> float:
    return KERNEL_LAUNCH_S + n * b / (kernel_gbps(b, sms or 1) * 1e9)


class Ledger(list):
    """Modelled seconds of the calls made since the last clear()."""


class LedgerTimer:
    label = "modelled costs (test)"
    stream = None

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def once(self, call: Callable[[Any], None]) -> None:
        call(None)

    def measure(self, calls: list, repeats: int, warmup: int = 1) -> list[list[float]]:
        out = []
        for call in calls:
            times = []
            for _ in range(repeats):
                self.ledger.clear()
                call(None)
                times.append(sum(self.ledger) or 1e-3)  # the contiguous ceiling is not modelled
            out.append(times)
        return out


class SpellTimer(LedgerTimer):
    """The ledger's costs, with a slow spell of the machine: the ``length`` measurements
    from the ``start``-th (counting from 0) take ``factor`` times as long, every route
    alike, or only the ``only``-th call of each (the spell caught that route's block of
    calls and not the others'). ``start=None``: no spell."""

    def __init__(self, ledger: Ledger, start: Optional[int] = None, length: int = 1, factor: float = 1.5,
                 only: Optional[int] = None) -> None:
        super().__init__(ledger)
        self.start, self.length, self.factor, self.only, self.count = start, length, factor, only, 0

    def measure(self, calls: list, repeats: int, warmup: int = 1) -> list[list[float]]:
        out = super().measure(calls, repeats, warmup)
        slow = self.start is not None and self.start <= self.count < self.start + self.length
        self.count += 1
        if not slow:
            return out
        return [[t * self.factor for t in row] if self.only in (None, i) else row for i, row in enumerate(out)]


class ModeTimer(LedgerTimer):
    """The ledger's costs through a machine that switches, round by round of
    :func:`~kvswap.calibration.timing.schedule`, between a fast mode and one ``slow`` times
    as slow. A call's block in a round is mostly in the round's mode, but one in ``flip``
    lands in the other (the switch came between two calls of the round), and each timed
    call is also off by up to ``jitter`` of its own: a median taken over all of a call's
    rounds lands in either mode."""

    def __init__(self, ledger: Ledger, seed: int = 0, slow: float = 1.4, flip: float = 0.1,
                 jitter: float = 0.005) -> None:
        import random

        super().__init__(ledger)
        self.rng, self.slow, self.flip, self.jitter = random.Random(seed), slow, flip, jitter

    def measure(self, calls: list, repeats: int, warmup: int = 1) -> list[list[float]]:
        from kvswap.calibration.timing import KEEP

        rng, out = self.rng, super().measure(calls, repeats, warmup)
        rounds = [rng.random() < 0.5 for _ in range(0, repeats, KEEP)]
        for row in out:
            modes = [self.slow if slow != (rng.random() < self.flip) else 1.0 for slow in rounds]
            row[:] = [t * modes[i // KEEP] * (1 + rng.uniform(-self.jitter, self.jitter)) for i, t in enumerate(row)]
        return out


class ModelPlatform:
    """Plugin: detects ``modelplat:0`` and registers ``model.batch`` and ``model.kernel``
    (or other ``names``; plus, on request, routes that raise, copy nothing, or refuse
    large blocks). With ``fill_s``, the kernel pays a per-call cost that shrinks with its
    SM count in calls under ``FILL_BYTES``, so medium batches want more SMs than the knee.
    With ``batch_setup_s``, each batch call pays a fixed cost, so small batches of large
    blocks go faster on the kernel."""

    IDENTITY = "modelplat-model-device-16cu"

    def __init__(self, ledger: Ledger, broken: bool = False,
                 names: tuple[str, str] = ("model.batch", "model.kernel"), fill_s: float = 0.0,
                 batch_setup_s: float = 0.0) -> None:
        self.ledger = ledger
        self.broken = broken
        self.fill_s = fill_s
        self.batch_setup_s = batch_setup_s
        self.batch_name, self.kernel_name = names
        self.bound_sms: list[int] = []

    @hookimpl
    def kvswap_detect_platform(self, device: Optional[str]) -> Optional[DeviceInfo]:
        if device is None or not device.startswith("modelplat"):
            return None
        return DeviceInfo(platform="modelplat", name="Model device", identity=self.IDENTITY,
                          compute_units=16, index=0, details={"torch_type": "cpu"})

    def _route(self, cost: Callable[..., float], sms: Optional[int]) -> Callable[..., None]:
        def fn(src: Any, dst: Any, sizes: Any, stream: Any) -> None:
            host_copy(src, dst, sizes)
            self.ledger.append(cost("", int(sizes[0]), len(sizes), sms))
        return fn

    def _kernel(self, ctx: Any) -> Callable[..., None]:
        self.bound_sms.append(ctx.params["num_sms"])
        if not self.fill_s:
            return self._route(kernel_cost, ctx.params["num_sms"])
        # The link fills sooner with more programs: fill_s at 16 SMs, twice that at 8, in a
        # call of under FILL_BYTES; with more in flight every count fills it as soon.
        fill = self.fill_s * 16 / ctx.params["num_sms"]
        return self._route(lambda d, b, n, sms: kernel_cost(d, b, n, sms) + fill * (n * b < FILL_BYTES),
                           ctx.params["num_sms"])

    @hookimpl
    def kvswap_register_copy_impls(self, platform: str, register: Callable[[CopyImpl], None]) -> None:
        if platform != "modelplat":
            return
        setup = self.batch_setup_s  # a fixed cost per batch call: small batches of large blocks pay it
        register(CopyImpl(self.batch_name, "batch", ("modelplat",), BOTH,
                          lambda ctx: self._route(lambda d, b, n, s: batch_cost(d, b, n, s) + setup, None)))
        register(CopyImpl(self.kernel_name, "kernel", ("modelplat",), BOTH, self._kernel))
        if not self.broken:
            return

        def raises(ctx: Any) -> Callable[..., None]:
            def fn(src: Any, dst: Any, sizes: Any, stream: Any) -> None:
                raise RuntimeError("model.raises: device fell off the bus")
            return fn

        register(CopyImpl("model.raises", "batch", ("modelplat",), BOTH, raises))
        register(CopyImpl("model.nothing", "kernel", ("modelplat",), BOTH,
                          lambda ctx: lambda src, dst, sizes, stream: self.ledger.append(1e-9)))
        register(CopyImpl("model.small", "batch", ("modelplat",), BOTH,
                          lambda ctx: self._route(lambda d, b, n, s: n * b / 1e9, None),
                          max_block_bytes=8 * KiB))


def modelled_host_cost(monkeypatch: Any) -> None:
    """A modelled device's calls hold the calling thread for no time: its host-cost
    measurement must not time the real host copies behind the model (which are the whole
    copy, not host work) against modelled transfers."""
    from kvswap.calibration import host_cost

    monkeypatch.setattr(host_cost, "clock", lambda: 0)
