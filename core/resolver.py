"""``resolve()``: choose, once, how a device copies batches of blocks in one direction."""
from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any, Iterable, Optional, Union

from .errors import ConfigurationError, ResolutionError
from .impl import BindContext, CopyImpl, same_addresses
from .lookup import find_calibration
from .plan import Candidate, Plan, Route
from .platform import detect
from .plugins import PluginHost, plugin_host
from .swapfn import SwapFn
from .thresholds import Calibration
from .types import DeviceInfo, Direction, DirectionLike, Policy

FORCE_ENV = "KVSWAP_FORCE_IMPL"
KiB = 1024
# Block-size classes the plan decides for: powers of two and their midpoints, 1 KiB-4 MiB.
EDGES = (1,) + tuple(
    sorted({KiB << i for i in range(13)} | {3 * (KiB << i) // 2 for i in range(12)})
)


# ``(min_bytes, max_bytes or None, at_bytes)`` per class: from one edge to the next, decided
# at its lower edge. The edges are the sizes calibration measures, and the block sizes of KV
# caches are powers of two and their midpoints too, so a block of exactly an edge's size gets
# the decision of its own measurements, not of a size between two of them (whose nearest row
# of SM tiers can be the next edge's). The class under 1 KiB, below every measurement, is
# decided at its geometric middle.
SIZE_CLASSES: tuple[tuple[int, Optional[int], int], ...] = tuple(
    (lo, hi, lo if lo >= KiB else int(math.sqrt(lo * (hi + 1))))
    for lo, hi in zip(EDGES, [e - 1 for e in EDGES[1:]] + [None])
)

# A route that takes SMs takes a block size, or a batch size, from one that takes none only
# when it is predicted (measured) faster by more than this: its SMs are taken from compute,
# and routes this close can swap places between two runs. A guard against measurement
# noise, so it applies to measured calibrations only: thresholds that are published or
# guessed (``calibrated=False``) are taken as they are drawn. Its size centres the tie on
# the 3% of regret issue 6 allows: a tie given to the batch route gives up at most the
# margin plus two standard errors plus the drift between runs (about 1% on the H200 once
# calls were timed in blocks, calibration.timing); at 2% that sum passed 3% at two points
# of the H200 bench (device->host 32 KiB x 16 and 256 KiB x 256, where the kernel led by
# 2.1% in calibration and by 3-11% in the bench).
KERNEL_MARGIN = 0.01


def collect_impls(host: PluginHost, platform: str) -> list[tuple[str, CopyImpl]]:
    """``(plugin, impl)`` registered for ``platform``; a name registered twice keeps the
    registration of the plugin first by name, and the other plugin is warned about."""
    seen: dict[str, str] = {}
    out = []
    for plugin, impl in host.collect("kvswap_register_copy_impls", CopyImpl, platform=platform):
        if impl.name in seen:
            if seen[impl.name] != plugin:
                host.warn(plugin, f"registers {impl.name!r}, already registered by {seen[impl.name]!r}; ignored")
            continue
        seen[impl.name] = plugin
        out.append((plugin, impl))
    return out


def _block_sizes(block_bytes: Union[None, int, Iterable[int]]) -> tuple[int, ...]:
    if block_bytes is None:
        return ()
    values = (block_bytes,) if isinstance(block_bytes, int) else tuple(block_bytes)
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
        raise ConfigurationError(f"block_bytes={block_bytes!r} must be a positive int or a list of them")
    return tuple(sorted(set(values)))


def _sm_cap(n: int, policy: Policy, device: DeviceInfo) -> int:
    """``n`` SMs within the policy's budget and the device's count."""
    if policy.max_sms is not None:
        n = min(n, policy.max_sms)
    if device.compute_units and device.platform != "cpu":  # CPU cores are not SMs
        n = min(n, device.compute_units)
    return max(n, 1)


def _num_sms(cal: Calibration, direction: Direction, policy: Policy, device: DeviceInfo) -> int:
    return _sm_cap(cal.sms(direction), policy, device)


def _tiers_at(tiers: Iterable[tuple[int, int]], knee: Optional[int]) -> tuple[tuple[int, int], ...]:
    """``tiers`` with equal neighbours merged; empty when every tier runs on ``knee``, the
    SMs the kernel is bound with (no tiers: the knee for every batch)."""
    out: list[tuple[int, int]] = []
    for start, k in tiers:
        if not out or out[-1][1] != k:
            out.append((start, k))
    return () if all(k == knee for _, k in out) else tuple(out)


def _sms_by_batch(cal: Calibration, direction: Direction, policy: Policy, device: DeviceInfo,
                  size: int, num_sms: int) -> tuple[tuple[int, int], ...]:
    """The calibration's SM tiers at ``size``, capped like the knee (0, the route that
    takes no SMs, stays 0): :func:`_tiers_at` the knee ``num_sms``."""
    return _tiers_at(((start, _sm_cap(k, policy, device) if k else 0)
                      for start, k in cal.sms_tiers(direction, size)), num_sms)


def _rank(
    usable: list[CopyImpl], cal: Calibration, direction: Direction, policy: Policy,
    size: int, exact: bool, num_sms: int,
) -> list[tuple[CopyImpl, Optional[float]]]:
    """Usable impls that can take ``size``, best first, with predicted GB/s.

    Unknown predictions rank last; a route that takes SMs ranks above one that takes none
    only when faster by more than ``KERNEL_MARGIN`` (on a measured calibration); ties go to
    the route that takes no SMs, then by name, so registration order never decides.
    """
    margin = KERNEL_MARGIN if cal.calibrated else 0.0
    rows = []
    for impl in usable:
        if not (impl.accepts_size(size) if exact else impl.accepts_range(size)):
            continue
        g = cal.predict(impl.name, impl.kind, direction, size, num_sms if impl.uses_sms else None)
        score = None if g is None else g
        if score is not None and policy.prefer == "low_interference":
            score *= 1.0 - cal.slowdown_of(impl.name, impl.kind)
        if score is not None and impl.uses_sms:
            score /= 1.0 + margin
        rows.append((score is None, -(score or 0.0), impl.uses_sms, impl.name, impl, g))
    rows.sort(key=lambda r: r[:4])
    return [(r[4], r[5]) for r in rows]


def _routes(
    usable: list[CopyImpl], cal: Calibration, direction: Direction, policy: Policy,
    sizes: tuple[int, ...], num_sms: int, device: DeviceInfo,
) -> tuple[Route, ...]:
    routes: list[Route] = []
    for lo, hi, at in SIZE_CLASSES:
        given = [s for s in sizes if s >= lo and (hi is None or s <= hi)]
        rep = given[0] if given else at
        ranked = _rank(usable, cal, direction, policy, rep, bool(given), num_sms)
        if not ranked:
            continue
        best = ranked[0][0]
        # Tiers buy throughput with SMs: a low-interference policy keeps the knee.
        tiers = _sms_by_batch(cal, direction, policy, device, rep, num_sms) if policy.prefer == "throughput" else ()
        if best.uses_sms:
            small = next((impl for impl, _ in ranked[1:] if not impl.uses_sms), None)
            min_batch = cal.min_batch(direction, block_bytes=rep) if small else 0
        else:
            # Ranked at a large batch, a route without SMs can still lose the small batches
            # of this size to a kernel: a tier of 0 SMs says the calibration measured where.
            kernel = next((impl for impl, _ in ranked[1:] if impl.uses_sms), None)
            if kernel is not None and any(k == 0 for _, k in tiers) and any(k for _, k in tiers):
                best, small, min_batch = kernel, best, 0
            else:
                small, min_batch, tiers = None, 0, ()
        if small is None:  # no route without SMs to give 0-SM tiers to: they keep the knee
            tiers = _tiers_at(((n, k or num_sms) for n, k in tiers), num_sms)
        route = Route(
            min_bytes=lo,
            max_bytes=hi,
            impl=best.name,
            at_bytes=rep,
            predicted=tuple((impl.name, None if g is None else round(g, 2)) for impl, g in ranked),
            min_batch=min_batch,
            small_batch_impl=small.name if small else None,
            fallbacks=tuple(impl.name for impl, _ in ranked if impl is not best),
            sms_by_batch=tiers,
        )
        prev = routes[-1] if routes else None
        decided = ("impl", "small_batch_impl", "min_batch", "fallbacks", "sms_by_batch")
        same = prev and prev.max_bytes == lo - 1 and all(getattr(prev, a) == getattr(route, a) for a in decided)
        if same:
            keep = route if given and prev.at_bytes not in sizes else prev
            routes[-1] = replace(prev, max_bytes=hi, at_bytes=keep.at_bytes, predicted=keep.predicted)
        else:
            routes.append(route)
    return tuple(routes)


def _bind_tiers(
    routes: tuple[Route, ...], usable: list[CopyImpl], params: dict[str, dict[str, Any]],
    direction: Direction, dev: DeviceInfo, translate: Any, notes: list[str],
) -> tuple[tuple[Route, ...], dict[tuple[str, int], Any]]:
    """Bind each kernel once more per SM count its routes' batch tiers name besides the
    one it is bound with. A tier whose binding fails runs on the SMs the kernel is bound
    with (its knee), with a note."""
    impls = {i.name: i for i in usable}
    tiered: dict[tuple[str, int], Any] = {}
    failed: set[tuple[str, int]] = set()
    wanted = {(r.impl, k) for r in routes for _, k in r.sms_by_batch if k}
    for name, k in sorted(wanted):
        if params.get(name, {}).get("num_sms") == k:
            continue
        try:
            fn = impls[name].factory(BindContext(direction, dev, {"num_sms": k}, translate))
            if not callable(fn):
                raise TypeError(f"factory returned {fn!r}, not a callable")
            tiered[(name, k)] = fn
        except Exception as e:
            failed.add((name, k))
            notes.append(f"{name}: could not be bound at {k} SMs for its batch tiers "
                         f"({type(e).__name__}: {e}); those batches use its knee")
    if failed:
        def knee(r: Route) -> Route:
            at = params.get(r.impl, {}).get("num_sms")
            return replace(r, sms_by_batch=_tiers_at(((n, at if (r.impl, k) in failed else k)
                                                      for n, k in r.sms_by_batch), at))

        routes = tuple(knee(r) for r in routes)
    return routes, tiered


def _translator(host: PluginHost, device: DeviceInfo) -> Any:
    for plugin, fn in host.call_each("kvswap_host_address_translator", device=device):
        if fn is None:
            continue
        if not callable(fn):
            host.drop(plugin, f"kvswap_host_address_translator returned {fn!r}, not a callable")
            continue
        return fn
    return same_addresses


def resolve(
    direction: DirectionLike,
    *,
    device: Any = None,
    block_bytes: Union[None, int, Iterable[int]] = None,
    policy: Optional[Policy] = None,
    host: Optional[PluginHost] = None,
) -> SwapFn:
    """Choose how to copy batches of blocks in ``direction`` on ``device``, once.

    :param direction: ``"h2d"`` or ``"d2h"``.
    :param device: ``None`` (the current accelerator, else the CPU), ``"cpu"``,
        ``"cuda:N"``, a ``torch.device``, an index, or a device a plugin recognises.
    :param block_bytes: the block (chunk) sizes the caller will copy, if known; the plan is
        then decided at exactly those sizes (others still work).
    :param policy: SM budget, throughput vs low interference, a forced implementation.
        ``KVSWAP_FORCE_IMPL`` forces one when the policy does not.
    :param host: a plugin host (tests); default the process's, loaded on first use.
    :return: a :class:`SwapFn` with ``.plan`` and ``.explain()``.
    :raises ResolutionError: no implementation can serve the request, or a forced one
        cannot be honoured (the message names it, the reason and the valid choices).
    """
    direction = Direction.parse(direction)
    policy = Policy() if policy is None else policy
    if not isinstance(policy, Policy):
        raise ConfigurationError(f"policy={policy!r} must be a kvswap.Policy")
    sizes = _block_sizes(block_bytes)
    host = plugin_host() if host is None else host
    dev = detect(host, device)
    cal = find_calibration(host, dev)
    num_sms = _num_sms(cal, direction, policy, dev)
    translate = _translator(host, dev)
    notes = [] if cal.calibrated else [
        f"device {dev.identity} is not calibrated; run `kvswap calibrate` on it for measured thresholds"
    ]

    candidates, usable, bound, params = [], [], {}, {}
    for plugin, impl in collect_impls(host, dev.platform):
        reason = impl.unavailable_reason(dev)
        if reason is None and direction not in impl.directions:
            reason = f"copies only {', '.join(map(str, impl.directions))}"
        if reason is None and impl.uses_sms and policy.max_sms == 0:
            reason = "Policy.max_sms=0 allows no kernel routes"
        if reason is None:
            p = {"num_sms": num_sms} if impl.uses_sms else {}
            try:
                fn = impl.factory(BindContext(direction, dev, p, translate))
                if not callable(fn):
                    raise TypeError(f"factory returned {fn!r}, not a callable")
            except Exception as e:
                reason = f"factory raised {type(e).__name__}: {e}"
            else:
                bound[impl.name], usable = fn, usable + [impl]
                if p:
                    params[impl.name] = p
                note = getattr(fn, "note", None)
                if note:
                    notes.append(f"{impl.name}: {note}")
        candidates.append(Candidate(impl.name, impl.kind, plugin, reason is None, reason, impl.constraints()))
    candidates.sort(key=lambda c: (not c.available, c.name))
    names = ", ".join(sorted(i.name for i in usable)) or "none"

    forced = policy.force or os.environ.get(FORCE_ENV) or None
    if forced:
        where = "Policy.force" if policy.force else FORCE_ENV
        cand = next((c for c in candidates if c.name == forced), None)
        if cand is None:
            raise ResolutionError(
                f"{where}={forced!r} is not registered for platform {dev.platform!r}; usable here: {names}"
            )
        if not cand.available:
            raise ResolutionError(f"{where}={forced!r} cannot be honoured: {cand.reason}; usable here: {names}")
        impl = next(i for i in usable if i.name == forced)
        refused = [s for s in sizes if not impl.accepts_size(s)]
        if refused:
            raise ResolutionError(
                f"{where}={forced!r} cannot be honoured: it refuses block_bytes {refused} "
                f"({impl.why_refused(0, 0, refused[0])}); usable here: {names}"
            )
        routes = (Route(1, None, forced, sizes[0] if sizes else 0, ()),)
        usable = [impl]
        notes.append(f"forced by {where}")
    else:
        routes = _routes(usable, cal, direction, policy, sizes, num_sms, dev)
        if not routes:
            rejected = "; ".join(f"{c.name}: {c.reason}" for c in candidates) or "no backend registered any"
            raise ResolutionError(
                f"no implementation can copy {direction} on {dev.platform} device {dev.name!r} ({rejected})"
            )
    routes, tiered = _bind_tiers(routes, usable, params, direction, dev, translate, notes)
    used = {n for r in routes for n in (r.impl, r.small_batch_impl, *r.fallbacks) if n}
    plan = Plan(
        direction=direction,
        device=dev,
        policy=policy,
        calibration=cal.summary(),
        candidates=tuple(candidates),
        routes=routes,
        params={k: v for k, v in params.items() if k in used},
        forced=forced,
        notes=tuple(notes),
    )
    impls = {i.name: i for i in usable if i.name in used}
    fns = {(k, params.get(k, {}).get("num_sms")): v for k, v in bound.items() if k in used}
    return SwapFn(plan, impls, {**fns, **tiered})
