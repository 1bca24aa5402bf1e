"""``resolve()``: choose, once, how a device copies batches of blocks in one direction."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Iterable, Optional, Union

from ..errors import ConfigurationError, ResolutionError, UnknownImplError
from ..registry.failures import describe
from ..registry.impl import BindContext, CopyImpl, same_addresses
from .lookup import find_calibration
from .plan import Candidate, Plan, Route, human_bytes, sizes_taken
from .routing import knee_sms, routes as build_routes, tiers_at
from ..registry.platform import detect
from ..registry.plugins import PluginHost, collect_impls, plugin_host
from .swapfn import SwapFn
from ..registry.thresholds import Calibration
from ..types import DeviceInfo, Direction, DirectionLike, Policy, as_int

FORCE_ENV = "KVSWAP_FORCE_IMPL"


def _block_sizes(block_bytes: Union[None, int, Iterable[int]]) -> tuple[int, ...]:
    if block_bytes is None:
        return ()
    one = as_int(block_bytes)
    try:
        values = (one,) if one is not None else tuple(as_int(v) for v in block_bytes)  # type: ignore[union-attr]
    except TypeError:
        values = ()
    if not values or any(v is None or v < 1 for v in values):
        raise ConfigurationError(f"block_bytes={block_bytes!r} must be a positive int or a list of them")
    return tuple(sorted(set(values)))  # type: ignore[arg-type]


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
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # a backend's sys.exit() too: a broken binding, not the end of the process
            failed.add((name, k))
            notes.append(f"{name}: could not be bound at {k} SMs for its batch tiers "
                         f"({describe(e)}); those batches use its knee")
    if failed:
        def knee(r: Route) -> Route:
            at = params.get(r.impl, {}).get("num_sms")
            return replace(r, sms_by_batch=tiers_at(((n, at if (r.impl, k) in failed else k)
                                                     for n, k in r.sms_by_batch), at))

        routes = tuple(knee(r) for r in routes)
    return routes, tiered


def _unmeasured_notes(routes: tuple[Route, ...], candidates: list[Candidate], builtin: frozenset[str],
                      cal: Calibration) -> list[str]:
    """Why another plugin's implementation took a route without a measurement: where
    nothing predicts it, it ranks below every predicted and every built-in route, so only
    where none of them can copy; where only guesses predict it, they said so."""
    known = {c.name: c for c in candidates}
    out = []
    for r in routes:
        if r.impl in builtin:
            continue
        c = known[r.impl]
        who = f"{r.impl} (plugin {c.plugin}), which takes {sizes_taken(c.constraints)},"
        if dict(r.predicted).get(r.impl) is None:
            out.append(f"{who} took {_span_words(r)} unmeasured: no calibration predicts it, and no measured or "
                       f"built-in route can copy these sizes")
        elif not cal.calibrated:
            out.append(f"{who} is ranked by numbers that are not measured ({cal.source})")
    return out


def _span_words(r: Route) -> str:
    top = "" if r.max_bytes is None else f" to {human_bytes(r.max_bytes)}"
    return f"blocks of {human_bytes(r.min_bytes)}{top or ' or more'}"


def _link_for(usable: list[CopyImpl], bound: dict[str, Any], builtin: frozenset[str],
              policy: Policy) -> tuple[Any, Optional[str]]:
    """The bound batch route a staged route moves its runs with (a built-in one first,
    then by name), or the reason there is none."""
    if policy.staging_bytes == 0:
        return None, "Policy.staging_bytes=0 allows no staged routes"
    batch = sorted((i for i in usable if i.kind == "batch"), key=lambda i: (i.name not in builtin, i.name))
    if not batch:
        return None, "needs a batch route of this direction for the link, and none is usable here"
    return bound[batch[0].name], None


def host_translator(host: PluginHost, device: DeviceInfo) -> Any:
    """The host address translation kernels on ``device`` use: the first plugin's (by
    name) that offers one, else :func:`~kvswap.registry.impl.same_addresses`."""
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
    calibration: Optional[Calibration] = None,
    profiles: bool = True,
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
    :param calibration: decide by this calibration instead of looking one up (calibration
        binds routes at exact SM counts this way).
    :param profiles: False skips measured profiles in the lookup: the backends' defaults
        decide, else the built-in fallback.
    :return: a :class:`SwapFn` with ``.plan`` and ``.explain()``.
    :raises ResolutionError: no implementation can serve the request, or a forced one
        cannot be honoured (the message names it, the reason and the valid choices).
    """
    direction = Direction.parse(direction)
    policy = Policy() if policy is None else policy
    if not isinstance(policy, Policy):
        raise ConfigurationError(f"policy={policy!r} must be a kvswap.Policy")
    if not isinstance(profiles, bool):
        raise ConfigurationError(f"profiles={profiles!r} must be True or False")
    sizes = _block_sizes(block_bytes)
    host = plugin_host() if host is None else host
    dev = detect(host, device)
    registered = collect_impls(host, dev.platform)
    if calibration is None:
        cal = find_calibration(host, dev, profiles=profiles, registered=registered)
    elif isinstance(calibration, Calibration):
        cal = calibration
    else:
        raise ConfigurationError(f"calibration={calibration!r} must be a kvswap.Calibration or None")
    num_sms = knee_sms(cal, direction, policy, dev)
    translate = host_translator(host, dev)
    notes = [] if cal.calibrated else [
        f"device {dev.identity} is not calibrated; run `kvswap calibrate` on it for measured thresholds"
    ]

    candidates, usable, bound, params = [], [], {}, {}
    builtin = frozenset(impl.name for plugin, impl in registered if host.is_builtin(plugin))
    # Staged routes are bound last: each takes a bound batch route of this direction as its link.
    registered = sorted(registered, key=lambda pi: pi[1].kind == "staged")
    for plugin, impl in registered:
        reason = impl.unavailable_reason(dev)
        if reason is None and direction not in impl.directions:
            reason = f"copies only {', '.join(map(str, impl.directions))}"
        if reason is None and impl.uses_sms and policy.max_sms == 0:
            reason = "Policy.max_sms=0 allows no kernel routes"
        link = None
        if reason is None and impl.kind == "staged":
            link, reason = _link_for(usable, bound, builtin, policy)
        if reason is None:
            p = {"num_sms": num_sms} if impl.uses_sms else {}
            if impl.kind == "staged":  # the policy's SM cap where it sets one; else the backend's choice
                p = {"staging_bytes": policy.staging_bytes, **({"num_sms": policy.max_sms} if policy.max_sms else {})}
            try:
                fn = impl.factory(BindContext(direction, dev, p, translate, link))
                if not callable(fn):
                    raise TypeError(f"factory returned {fn!r}, not a callable")
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # a backend's sys.exit() too: that route is unavailable
                reason = f"factory raised {describe(e)}"
            else:
                bound[impl.name], usable = fn, usable + [impl]
                if impl.kind == "staged" and isinstance(getattr(fn, "num_sms", None), int):
                    p["num_sms"] = fn.num_sms  # the SMs its device side was bound with
                if p:
                    params[impl.name] = p
                note = getattr(fn, "note", None)
                if note:
                    notes.append(f"{impl.name}: {note}")
        candidates.append(Candidate(impl.name, impl.kind, plugin, reason is None, reason, impl.constraints()))
    candidates.sort(key=lambda c: (not c.available, c.name))
    names = ", ".join(sorted(i.name for i in usable)) or "none"

    forced = policy.force or os.environ.get(FORCE_ENV, "").strip() or None  # read as the plugin switches are
    if forced:
        where = "Policy.force" if policy.force else FORCE_ENV
        cand = next((c for c in candidates if c.name == forced), None)
        if cand is None:
            broken = [f"{r.name} {r.status}: {r.reason}" for r in host.records.values() if r.status == "failed"]
            raise UnknownImplError(
                f"{where}={forced!r} is not registered for platform {dev.platform!r}; usable here: {names}"
                + (f"; plugins that did not load: {'; '.join(broken)}" if broken else "")
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
        # A staged route serves a BlockMover whose host side suits it (kvswap.mover.route_choice),
        # or where forced; it does not compete for raw descriptor batches.
        usable = [i for i in usable if i.kind != "staged"]
        routes = build_routes(usable, cal, direction, policy, sizes, num_sms, dev, builtin)
        if not routes:
            rejected = "; ".join(f"{c.name}: {c.reason}" for c in candidates) or "no backend registered any"
            raise ResolutionError(
                f"no implementation can copy {direction} on {dev.platform} device {dev.name!r} ({rejected})"
            )
        refused = [s for s in sizes if not any(i.accepts_size(s) for i in usable)]
        if refused:
            limits = "; ".join(f"{i.name} takes {sizes_taken(i.constraints())}" for i in usable)
            raise ResolutionError(
                f"no usable implementation can copy blocks of {', '.join(map(str, refused))} bytes "
                f"{direction} on {dev.platform} device {dev.name!r} ({limits})"
            )
        notes += _unmeasured_notes(routes, candidates, builtin, cal)
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
    return SwapFn(plan, impls, {**fns, **tiered}, calibration=cal, usable=usable)
