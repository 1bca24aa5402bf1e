"""``kvswap bench``: the resolved SwapFn against every candidate and a peer policy.

At each (direction, block size, batch) point, in one process and interleaved in rounds:
every available impl bound exactly as the resolver binds it, the SwapFn ``resolve()``
returns for that block size, and vLLM's policy as a peer baseline: on a CUDA device as vLLM
ships it (:mod:`.peer`: what each of its calls costs included), elsewhere on kvswap's
routes. Ratios: resolved / best candidate (1.0 = no regret) and resolved / peer, each
from the rounds in which the two were timed together (:func:`~.timing.paired`).

Then every point under a bar (:data:`BAR_BEST`; :data:`BAR_PEER` where the peer takes
another route) is timed again, on fresh draws, resolved against the same best candidate
and the peer: the worst of a hundred-odd ratios is mostly the draw that came out lowest,
and only timings taken after it was picked say whether the point is low or its draw was.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

from kvswap import Direction, Policy, resolve
from kvswap.registry.platform import detect
from kvswap.registry.plugins import PluginHost, plugin_host

from .binding import bound_at
from .peer import PEER_BATCH, PEER_KERNEL, PEER_MAX_BLOCK, PEER_MIN_BATCH, PEER_SMS, SHIPPED, on_routes, \
    peer_route, shipped
from .bench_records import (BenchFailure, BenchResult, BenchRow, CandidateTiming, Confirm, PeerTiming, Ratios,
                            ResolvedTiming, Summary)
from .progress import Progress
from .timing import in_passes, make_timer, median, on_host, paired, per_pass, pooled, rounds_for
from .workload import Batch, Pools

KiB, MiB = 1024, 1 << 20

# The peer: vLLM's Triton fast path (H100-tuned): kernel on 12 SMs for blocks under 28 KiB in
# batches of at least 16 descriptors, batch DMA otherwise; d2h always DMA.
PEER_POLICY = (f"h2d: {PEER_KERNEL} on {PEER_SMS} SMs when block < {PEER_MAX_BLOCK // KiB} KiB and batch >= "
               f"{PEER_MIN_BATCH}, else {PEER_BATCH}; d2h: always {PEER_BATCH}")


@dataclass(frozen=True)
class BenchSettings:
    block_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    pool_bytes: int
    ceiling_bytes: int
    repeats: int
    warmup: int
    seed: int = 0
    # A point whose rounds take less than this many seconds in all gets more of them, up to
    # max_repeats (timing.rounds_for).
    point_seconds: float = 0.0
    max_repeats: int = 0
    # The grid runs this many times over, each point a fresh draw of slots: a contender's
    # GB/s is the median of its passes (timing.pooled), a ratio the median over the rounds
    # of every pass (timing.paired); repeats, point_seconds and max_repeats are per point
    # in all, shared among the passes.
    passes: int = 1
    # Points under a bar are timed this many passes more after the grid (0: not at all),
    # their rounds shared among them as the grid's are.
    confirm: int = 0


def bench_settings(host_only: bool, block_sizes: Optional[Sequence[int]] = None,
                   batch_sizes: Optional[Sequence[int]] = None, repeats: Optional[int] = None,
                   passes: Optional[int] = None, confirm: Optional[int] = None) -> BenchSettings:
    if host_only:  # the host reference copies one block at a time in Python: keep it small
        blocks, batches, pool, ceiling, reps = (4 * KiB, 16 * KiB, 64 * KiB), (1, 16, 256), 16 * MiB, 8 * MiB, 3
    else:
        blocks = (1 * KiB, 2 * KiB, 4 * KiB, 8 * KiB, 16 * KiB, 24 * KiB, 32 * KiB, 48 * KiB, 64 * KiB,
                  128 * KiB, 256 * KiB, 512 * KiB)
        batches, pool, ceiling, reps = (1, 4, 16, 64, 256, 1024, 10000), 2048 * MiB, 512 * MiB, 41
    return BenchSettings(
        block_sizes=tuple(sorted(set(block_sizes or blocks))),
        batch_sizes=tuple(sorted(set(batch_sizes or batches))),
        pool_bytes=pool, ceiling_bytes=ceiling, repeats=repeats or reps, warmup=2,
        point_seconds=0.0 if host_only or repeats else 0.2, max_repeats=0 if host_only or repeats else 801,
        # Three draws of every point on a GPU: the batch route's time moves with the slots
        # drawn, and a ratio over three draws is the typical one (the host reference: one).
        passes=passes or (1 if host_only else 3),
        confirm=(1 if host_only else 3) if confirm is None else confirm,
    )


def label(impl: str, num_sms: Optional[int]) -> str:
    """``impl`` or, for a kernel, ``impl@num_sms``: a route as the tables name it."""
    return f"{impl}@{num_sms}" if num_sms else impl


def _route_label(fn: Any, batch: Batch) -> str:
    work = fn.assign(batch.src, batch.dst, batch.sizes)
    return "+".join(dict.fromkeys(label(name, sms) for name, sms, _ in work))


def _candidates(d: str, dev: Any, device: Any, host: PluginHost, resolved: dict[int, Any],
                out: BenchResult) -> dict[str, tuple[Any, Optional[int]]]:
    """Every available impl bound as the resolver binds it (``force``), and each kernel
    also at every SM count a resolved function's batch tiers use: ``label -> (fn, SMs)``."""
    base = next(iter(resolved.values()))
    tiers = {(r.impl, k) for fn in resolved.values() for r in fn.plan.routes for _, k in r.sms_by_batch if k}
    cands: dict[str, tuple[Any, Optional[int]]] = {}
    for c in base.plan.candidates:
        if not c.available:
            out.notes.append(f"{d}: candidate {c.name} not available: {c.reason}")
            continue
        try:
            fn = resolve(d, device=device, host=host, policy=Policy(force=c.name))
            sms = fn.plan.params.get(c.name, {}).get("num_sms")
            cands[label(c.name, sms)] = (fn, sms)
            for k in sorted(k for name, k in tiers if name == c.name and k != sms):
                cands[label(c.name, k)] = (bound_at(d, dev, device, host, c.name, k), k)
        except Exception as e:
            out.failures.append(BenchFailure(d, c.name, f"{type(e).__name__}: {e}"))
    return cands


def run_bench(device: Any, settings: BenchSettings, directions: Sequence[Any], *,
              host: Optional[PluginHost] = None, progress: Optional[Progress] = None) -> BenchResult:
    """Measure the grid (see the module doc)."""
    from kvswap import __version__

    host = plugin_host() if host is None else host
    dev = detect(host, device)
    progress = progress or Progress()
    dirs = [str(Direction.parse(d)) for d in directions]
    timer = make_timer(dev)
    out = BenchResult(
        kvswap_version=__version__, device=dev.to_dict(), directions=dirs,
        measured="host memory copies (no accelerator: host reference)" if on_host(dev)
        else f"{dev.platform} copies between pinned host memory and device memory",
        host_only=on_host(dev), timer=timer.label, settings=asdict(settings), peer_policy=PEER_POLICY,
    )
    pools = Pools(dev, settings.pool_bytes, settings.seed)
    grid = [(b, n) for b in settings.block_sizes for n in settings.batch_sizes if n <= pools.slots(b)]
    passes = max(1, settings.passes)
    progress.add(len(dirs) * (passes * len(grid) + 1))
    for d in dirs:
        t = timer.measure([pools.contiguous(d, settings.ceiling_bytes)], settings.repeats, settings.warmup)[0]
        out.ceiling_gbps[d] = round(min(settings.ceiling_bytes, pools.pool_bytes) / median(t) / 1e9, 3)
        progress.step(f"{d} ceiling")
        resolved = {b: resolve(d, device=device, host=host, block_bytes=b) for b in settings.block_sizes}
        out.calibration[d] = next(iter(resolved.values())).plan.calibration
        cands = _candidates(d, dev, device, host, resolved, out)
        # As shipped where it can run so (its calls' own costs are what it is measured by, so it
        # never does the very work resolved does), else on kvswap's routes.
        peer = shipped(d, dev, device, host, settings.block_sizes)
        same_work = peer is None
        if peer is not None:
            out.peer_policy = f"{PEER_POLICY} ({SHIPPED})"
        else:
            peer = on_routes(d, dev, device, host, {fn.plan.forced for fn, _ in cands.values()})
        if peer is None and len(cands) > 1:  # one route alone is held against nothing
            out.notes.append(f"{d}: peer baseline not applicable here: it needs {PEER_KERNEL} and {PEER_BATCH}")
        for b in settings.block_sizes:
            for n in settings.batch_sizes:
                if (b, n) not in grid:
                    out.notes.append(f"{d}: {n} x {b} B skipped: more than the {pools.pool_bytes >> 20} MiB pool")
        drawn: dict[tuple[int, int], Batch] = {}

        def time_point(point: tuple[int, int], i: int) -> dict[str, list[float]]:
            b, n = point
            progress.step(f"{d} grid" + (f" (pass {i + 1} of {passes})" if passes > 1 else ""))
            drawn[point] = batch = pools.batch(d, b, n)
            return _time_point(d, pools, timer, settings, batch, _contenders(b, n, cands, resolved[b], peer),
                               passes, out)

        times = in_passes(grid, passes, time_point)
        rows = {}
        for b, n in grid:  # a contender that failed a check at a point in any pass has no timing there
            rows[(b, n)] = _row(d, drawn[(b, n)], _passed(d, b, n, times[(b, n)], out), cands, resolved[b],
                                peer is not None, same_work, out)
        suspects = [p for p, r in rows.items() if _suspect(r)] if settings.confirm else []
        if suspects:
            progress.add(settings.confirm * len(suspects))

            def time_again(point: tuple[int, int], i: int) -> dict[str, list[float]]:
                b, n = point
                progress.step(f"{d} points under a bar, again (pass {i + 1} of {settings.confirm})")
                r = rows[point]
                who = [("resolved", resolved[b])]
                if r.best is not None:
                    who.append((r.best, cands[r.best][0]))
                if _suspect(r, best=False):
                    who.append(("peer", peer(b, n)))
                return _time_point(d, pools, timer, settings, pools.batch(d, b, n), who, settings.confirm, out)

            again = in_passes(suspects, settings.confirm, time_again)
            for (b, n) in suspects:
                rows[(b, n)].confirm = _confirm(rows[(b, n)], _passed(d, b, n, again[(b, n)], out), settings.confirm)
        out.rows += rows.values()
    for d in dirs:
        out.summary[d] = summarize(out.rows_of(d))
    return out


# The bar a resolved route is held to: at least this fraction of the best candidate, and of the peer.
BAR_BEST, BAR_PEER = 0.97, 1.0


def _best_ratio(r: Ratios) -> tuple[Optional[float], Optional[float]]:
    return r.over_best


def _peer_ratio(r: Ratios) -> tuple[Optional[float], Optional[float]]:
    return r.over_peer


def summarize(rows: Sequence[BenchRow]) -> Summary:
    """Worst ratios, and the points under each bar: all of them, and those under it by more
    than two standard errors of the ratio (what the timings show, not a draw of their noise);
    where points were timed again after the grid, how many of them stayed under each bar."""
    best_below, best_beyond = under_in(rows, _best_ratio, BAR_BEST)
    peer_below, peer_beyond = under_in(rows, _peer_ratio, BAR_PEER)
    same = same_work(rows)
    again = [r.confirm for r in rows if r.confirm is not None]
    confirmed: dict[str, int] = {}
    if again:
        best_again, best_again_beyond = under_in(again, _best_ratio, BAR_BEST)
        peer_again, peer_again_beyond = under_in(again, _peer_ratio, BAR_PEER)
        confirmed = dict(confirmed_points=len(again),
                         confirmed_under_best_bar=len(best_again),
                         confirmed_under_best_bar_beyond_noise=len(best_again_beyond),
                         confirmed_under_peer=len(peer_again),
                         confirmed_under_peer_beyond_noise=len(peer_again_beyond))
    return Summary(
        points=len(rows),
        min_resolved_over_best=min((r.resolved_over_best for r in rows if r.resolved_over_best), default=None),
        min_resolved_over_peer=min((r.resolved_over_peer for r in rows if r.resolved_over_peer), default=None),
        under_best_bar=len(best_below), under_best_bar_beyond_noise=len(best_beyond),
        under_peer=len(peer_below), under_peer_beyond_noise=len(peer_beyond),
        under_peer_same_route=sum(bool(r.peer and r.peer.same_route) for r in peer_below),
        same_work_pairs=len(same), same_work_min=min(same, default=None), same_work_max=max(same, default=None),
        **confirmed,
    )


R = TypeVar("R", bound=Ratios)


def under_in(rows: Sequence[R], ratio: Callable[[R], tuple[Optional[float], Optional[float]]],
             bar: float) -> tuple[list[R], list[R]]:
    """The rows whose ``ratio`` (value, standard error) is under ``bar``, and those under it
    by more than two standard errors."""
    below = [r for r in rows if ratio(r)[0] is not None and ratio(r)[0] < bar]
    return below, [r for r in below if ratio(r)[0] + 2 * (ratio(r)[1] or 0.0) < bar]


def _suspect(row: BenchRow, best: bool = True) -> bool:
    """Whether a grid row is under a bar: the best candidate's (``best``), or the peer's
    where the peer takes another route (on its own route it is identical work)."""
    peer = row.peer
    under_peer = bool(peer and not peer.same_route and row.resolved_over_peer is not None
                      and row.resolved_over_peer < BAR_PEER)
    under_best = row.resolved_over_best is not None and row.resolved_over_best < BAR_BEST
    return under_peer or (best and under_best)


def _passed(d: str, b: int, n: int, times: dict[str, Any], out: BenchResult) -> dict[str, Any]:
    """``times`` less the contenders that failed a check at this point in any pass."""
    failed = {f.route for f in out.failures if f.direction == d and (f.block_bytes, f.batch) == (b, n)}
    return {k: t for k, t in times.items() if k not in failed}


def _confirm(row: BenchRow, times: dict[str, list[list[float]]], passes: int) -> Confirm:
    """A suspect point's ratios from its timings after the grid alone: resolved over the
    grid's best candidate, and over the peer where it was timed again."""
    best, peer = _over(times, row.best), _over(times, "peer")
    return Confirm(*(best or (None, None)), *(peer or (None, None)), passes=passes, best=row.best)


def _over(times: dict[str, list[list[float]]], other: Optional[str]) -> Optional[tuple[float, float]]:
    """resolved / ``other`` in GB/s from the rounds they were timed in together, and its
    standard error, rounded (None where either was not timed)."""
    if "resolved" not in times or other not in times:
        return None
    ratio, se = paired(times[other], times["resolved"])
    return round(ratio, 4), round(se, 4)


def same_work(rows: Sequence[BenchRow]) -> list[float]:
    """Resolved over a contender doing the very same work (the candidate bound to its
    route, or the peer on its own route), at every point that has one: 1.0 but for the
    noise, so their range is how far apart this run timed identical copies."""
    out = []
    for r in rows:
        twin = r.candidates.get(r.resolved.route)
        if twin and twin.resolved_over:
            out.append(twin.resolved_over)
        if r.peer and r.peer.same_route and r.resolved_over_peer:
            out.append(r.resolved_over_peer)
    return out


def _contenders(block_bytes: int, n: int, cands: dict[str, tuple[Any, Any]], resolved: Any,
                peer: Optional[Callable[[int, int], Any]]) -> list[tuple[str, Any]]:
    """What one point times: every candidate, the resolved function and the peer's route."""
    out: list[tuple[str, Any]] = [(name, fn) for name, (fn, _) in sorted(cands.items())]
    out.append(("resolved", resolved))
    if peer is not None:
        out.append(("peer", peer(block_bytes, n)))
    return out


def _time_point(d: str, pools: Pools, timer: Any, s: BenchSettings, batch: Batch,
                contenders: list[tuple[str, Any]], passes: int, out: BenchResult) -> dict[str, list[float]]:
    """One of ``passes`` passes of one point: each contender's copy checked byte for byte
    into poisoned destinations (a failure is recorded and the contender left out), then all
    of them timed interleaved; seconds per call by contender."""
    ok = []
    for key, fn in contenders:
        call = (lambda f: lambda stream: f(batch.src, batch.dst, batch.sizes, stream=stream))(fn)
        try:
            pools.verify(timer, call, batch)
            ok.append((key, call))
        except Exception as e:
            out.failures.append(BenchFailure(d, key, f"{type(e).__name__}: {e}", batch.block_bytes, batch.n))
    if not ok:
        return {}
    calls = [c for _, c in ok]
    repeats, seconds, most = per_pass(s.repeats, s.point_seconds, s.max_repeats, passes)
    repeats = rounds_for(timer, calls, repeats, seconds, most, s.warmup)
    return dict(zip([k for k, _ in ok], timer.measure(calls, repeats, 0)))


def _row(d: str, batch: Batch, times: dict[str, list[list[float]]], cands: dict[str, tuple[Any, Any]],
         resolved: Any, has_peer: bool, same_work: bool, out: BenchResult) -> BenchRow:
    """A point's row from its contenders' timings over the passes (``batch``: its last draw).
    GB/s from each contender's own timings (:func:`~.timing.pooled`); every ratio to the
    resolved function from the rounds they were timed in together (:func:`~.timing.paired`),
    and the best candidate is the one resolved is slowest against."""
    block_bytes, n, nbytes = batch.block_bytes, batch.n, batch.nbytes
    gbps = {k: round(nbytes / pooled(t)[0] / 1e9, 3) for k, t in times.items()}

    cand = {}
    for name, (fn, sms) in cands.items():
        if name in gbps:
            ratio = _over(times, name)
            cand[name] = CandidateTiming(fn.plan.forced, gbps[name], sms, *(ratio or (None, None)))
    rated = [k for k in cand if cand[k].resolved_over is not None]
    best = (min(rated, key=lambda k: cand[k].resolved_over) if rated
            else max(cand, key=lambda k: cand[k].gbps, default=None))
    route = _route_label(resolved, batch)
    peer_key = peer_route(d, block_bytes, n) if has_peer else None
    over_best = (cand[best].resolved_over, cand[best].resolved_over_se) if best in rated else (None, None)
    over_peer = _over(times, "peer") or (None, None)
    return BenchRow(
        *over_best, *over_peer,
        direction=d, block_bytes=block_bytes, batch=n, ceiling_gbps=out.ceiling_gbps[d], candidates=cand, best=best,
        resolved=ResolvedTiming(gbps.get("resolved"), route),
        peer=PeerTiming(gbps["peer"], label(*peer_key), same_work and label(*peer_key) == route)
        if peer_key and "peer" in gbps else None,
        repeats=sum(map(len, times["resolved"])) if "resolved" in times else 0,
    )
