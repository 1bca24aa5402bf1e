"""What ``kvswap calibrate`` and ``kvswap bench`` print: tables a person reads."""
from __future__ import annotations

from typing import Optional, Sequence

from kvswap.resolution.plan import human_bytes

from .bench import BAR_BEST, BAR_PEER
from .bench_records import BenchResult
from .decisions import Decision, Fitted
from .records import SIZE, Failure, Measurement


def gbps_text(v: Optional[float]) -> str:
    """GB/s to one decimal, or "-" where nothing was measured."""
    return "-" if v is None else f"{v:.1f}"


def text_grid(header: list[str], rows: list[list[str]]) -> list[str]:
    """Aligned plain-text columns: the first left-aligned, the rest right, a rule under the header."""
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def describe_decision(d: str, dec: Decision) -> list[str]:
    """The decisions for one direction in words."""
    if dec.carried_from is not None:
        return [f"{d}: not measured in this run; thresholds carried over from {dec.carried_from}"]
    lines = [f"{d}:"]
    for r in dec.routes:
        lo, hi = r.min_bytes, r.max_bytes
        if lo <= 1:
            span = "of every size" if hi is None else f"below {human_bytes(hi + 1)}"
        else:
            span = f"from {human_bytes(lo)}" if hi is None else f"{human_bytes(lo)} to <{human_bytes(hi + 1)}"
        sms = f" on {r.num_sms} SMs" if r.num_sms else ""
        lines.append(f"  blocks {span:<22} -> {r.impl}{sms}")
    if dec.kernel_sms:
        tolerance = f"{dec.knee_tolerance:.0%}" if dec.knee_tolerance is not None else "a few %"
        lines.append(f"  SM knee: {dec.kernel_sms} SMs (fewest within {tolerance} of the kernel's best; "
                     f"it peaks at {dec.kernel_peak_sms} SMs)")
    if dec.min_batch_by_size:
        pairs = ", ".join(f"{human_bytes(b)}: {n}" for b, n in dec.min_batch_by_size)
        lines.append(f"  kernel only for batches of at least (by block size) {pairs}; smaller ones take the batch route")
    elif dec.kernel_min_batch:
        lines.append(f"  kernel from batches of {dec.kernel_min_batch} descriptors; smaller batches take the batch route")
    tiers = [(b, t) for b, t in dec.kernel_sms_by_batch if any(k != dec.kernel_sms for _, k in t)]
    if tiers:
        lines.append("  kernel SMs by batch size, where they differ from the knee:")
        for b, t in tiers:
            if not any(k for _, k in t):
                continue  # a batch route's size the kernel takes no batch of
            steps = ", ".join((f"{k} SMs" if k else "batch route") + (f" from {n}" if n > 1 else "") for n, k in t)
            lines.append(f"    {human_bytes(b)} blocks: {steps}")
    if dec.crossover_bytes:
        lines.append(f"  crossover: batch route from {human_bytes(dec.crossover_bytes)} blocks")
    if not dec.routes:
        lines.append("  nothing measured")
    return lines


def size_table(fitted: Fitted, d: str, dec: Decision, measurements: Sequence[Measurement] = ()) -> list[str]:
    """GB/s by block size for each route of ``d`` (the profile's curves), with the batch
    each size was measured at where ``measurements`` are given, and the route chosen."""
    curves = fitted.curves_of(d)
    knee = dec.kernel_sms
    batch_impls = sorted({c.impl for c in curves if not c.num_sms})
    kernel_impls = sorted({c.impl for c in curves if c.num_sms})
    at: dict[tuple[str, Optional[int]], dict[int, float]] = {(c.impl, c.num_sms): dict(c.points) for c in curves}
    batches: dict[int, int] = {}
    for m in measurements:
        if m.direction == d and m.stage == SIZE:
            batches[m.block_bytes] = max(m.batch, batches.get(m.block_bytes, 0))
    header = ["block"] + (["n"] if batches else []) + batch_impls + [f"{k}@{knee}" for k in kernel_impls if knee] + \
        [f"{k} best (SMs)" for k in kernel_impls] + ["route"]
    chosen = {r.block_bytes: r for r in dec.by_size}
    rows = []
    for b in sorted({b for pts in at.values() for b in pts}):
        row = [human_bytes(b)] + ([str(batches.get(b, "-"))] if batches else [])
        row += [gbps_text(at.get((i, None), {}).get(b)) for i in batch_impls]
        row += [gbps_text(at.get((k, knee), {}).get(b)) for k in kernel_impls if knee]
        for k in kernel_impls:
            best = max(((pts[b], sms) for (impl, sms), pts in at.items() if impl == k and sms and b in pts), default=None)
            row.append(f"{best[0]:.1f} ({best[1]})" if best else "-")
        r = chosen.get(b)
        row.append(r.impl + (f"@{r.num_sms}" if r.num_sms else "") if r else "-")
        rows.append(row)
    return text_grid(header, rows)


def calibration_report(fitted: Fitted, measurements: Sequence[Measurement] = (),
                       interference: Sequence[dict] = (), failures: Sequence[Failure] = ()) -> str:
    """Per direction, GB/s by block size for each route, then the decisions, the compute
    slowdown beside each route and each route's host cost per call."""
    out = []
    for d, dec in fitted.decisions.items():
        if dec.carried_from is not None or not fitted.curves_of(d):
            continue
        out.append(f"{d}: GB/s by block size (contiguous ceiling {gbps_text(fitted.ceiling_gbps.get(d))} GB/s)")
        out += ["  " + line for line in size_table(fitted, d, dec, measurements)]
        out.append("")
    out.append("decisions:")
    for d, dec in fitted.decisions.items():
        out += ["  " + line for line in describe_decision(d, dec)]
    out += ["  " + line for line in slowdown_lines(fitted, interference)]
    out += ["  " + line for line in host_cost_lines(fitted)]
    grouped: dict[tuple[str, str, str], list[int]] = {}
    for f in failures:  # one line per route and cause, however many SM counts
        grouped.setdefault((f.direction, f.impl, f.error), []).extend([f.num_sms] if f.num_sms else [])
    for (d, impl, error), sms in grouped.items():
        on = f" on {', '.join(map(str, sms))} SMs" if sms else ""
        out.append(f"  skipped {d} {impl}{on}: {error}")
    return "\n".join(out)


def _ratio(ratio: tuple[Optional[float], Optional[float]], missing: str) -> str:
    """A bench ratio with twice its standard error, where it has one that shows at three
    decimals (the host's few rounds, or identical timings, give none worth printing)."""
    value, se = ratio
    if not value:
        return missing
    return f"{value:.3f}" + (f" ±{2 * se:.3f}" if se is not None and round(2 * se, 3) > 0 else "")


def contiguous_text(result: BenchResult, d: str) -> str:
    """The direction's contiguous copy, called a ceiling only where no measurement beat it
    (host memory copies of a small pool, say, which the CPU's caches serve)."""
    gbps = result.ceiling_gbps.get(d)
    rows = result.rows_of(d)
    top = max([c.gbps for r in rows for c in r.candidates.values() if c.gbps is not None]
              + [r.resolved.gbps for r in rows if r.resolved.gbps is not None], default=None)
    if gbps is None or top is None or top <= gbps:
        return f"contiguous ceiling {gbps_text(gbps)} GB/s"
    return f"a contiguous copy {gbps_text(gbps)} GB/s, beaten at {gbps_text(top)}: not a ceiling here"


def one_route(result: BenchResult) -> Optional[str]:
    """The route, where every point had only it to measure (the host reference on a machine
    without an accelerator, say): nothing to rank it against."""
    names = {n for r in result.rows for n in r.candidates} | {r.resolved.route for r in result.rows}
    return next(iter(names)) if len(names) == 1 and not any(r.peer for r in result.rows) else None


def one_route_report(result: BenchResult, name: str) -> str:
    """The one route's GB/s per point, nothing ranked."""
    out = []
    for d in result.directions:
        rows = result.rows_of(d)
        if not rows:
            continue
        out.append(f"{d}: GB/s of {name}, the one route here ({contiguous_text(result, d)})")
        table = [[human_bytes(r.block_bytes), str(r.batch), gbps_text(r.resolved.gbps)] for r in rows]
        out += ["  " + line for line in text_grid(["block", "n", name], table)]
        out.append("")
    return "\n".join(out)


def bench_report(result: BenchResult) -> str:
    """One table per direction: ceiling, each candidate, resolved, peer, and the ratios
    (± two standard errors; "=" where resolved takes the peer's own route); where only one
    route could be measured, :func:`one_route_report`."""
    name = one_route(result)
    if name is not None:
        return one_route_report(result, name)
    out = []
    for d in result.directions:
        rows = result.rows_of(d)
        if not rows:
            continue
        names = sorted({n for r in rows for n in r.candidates})
        header = ["block", "n"] + names + ["resolved", "route", "peer", "res/best", "res/peer"]
        table = []
        for r in rows:
            line = [human_bytes(r.block_bytes), str(r.batch)]
            line += [gbps_text(r.candidates[n].gbps if n in r.candidates else None) for n in names]
            res, peer = r.resolved, r.peer
            line += [gbps_text(res.gbps), res.route, gbps_text(peer.gbps) if peer else "n/a", _ratio(r.over_best, "-"),
                     _ratio(r.over_peer, "n/a") + (" =" if peer and peer.same_route else "")]
            table.append(line)
        out.append(f"{d}: GB/s ({contiguous_text(result, d)})")
        out += ["  " + line for line in text_grid(header, table)]
        s = result.summary.get(d)
        if s is None:
            out.append("")
            continue
        worst = ["n/a" if v is None else f"{v:.3f}" for v in (s.min_resolved_over_best, s.min_resolved_over_peer)]
        out.append(f"  worst resolved/best-candidate (regret): {worst[0]}; worst resolved/peer: {worst[1]}")
        out.append(f"  of {s.points} points: {s.under_best_bar} under {BAR_BEST} x the best candidate "
                   f"({s.under_best_bar_beyond_noise} by more than 2 standard errors); "
                   f"{s.under_peer} under {BAR_PEER} x the peer ({s.under_peer_beyond_noise} by more than "
                   f"2 standard errors; {s.under_peer_same_route} on the peer's own route)")
        again = [r for r in rows if r.confirm is not None]
        if again:
            k = again[0].confirm.passes if again[0].confirm else 0
            out.append(f"  timed again after the grid, on fresh draws ({k} pass{'es' if k != 1 else ''} each; "
                       "resolved against the same best candidate, and the peer where it takes another route):")
            for r in again:
                c = r.confirm
                assert c is not None
                line = (f"    {human_bytes(r.block_bytes)} x {r.batch}: res/best {_ratio(r.over_best, '-')}"
                        f" -> {_ratio(c.over_best, '-')} ({c.best})")
                if c.resolved_over_peer is not None and r.peer is not None:
                    line += (f"; res/peer {_ratio(r.over_peer, 'n/a')} -> "
                             f"{_ratio(c.over_peer, 'n/a')} ({r.peer.route})")
                out.append(line)
            out.append(f"  of those {s.confirmed_points}: {s.confirmed_under_best_bar} still under {BAR_BEST} x the "
                       f"best candidate ({s.confirmed_under_best_bar_beyond_noise} by more than 2 standard errors); "
                       f"{s.confirmed_under_peer} still under {BAR_PEER} x the peer on another route "
                       f"({s.confirmed_under_peer_beyond_noise} by more than 2 standard errors)")
        if s.same_work_pairs:
            out.append(f"  identical work timed {s.same_work_min:.3f}-{s.same_work_max:.3f} x apart "
                       f"({s.same_work_pairs} pairs of resolved and a candidate or the peer on its very route): "
                       "the run's noise floor")
        out.append("")
    return "\n".join(out)


def bench_markdown(doc: dict, command: str = "") -> str:
    """The JSON of ``kvswap bench`` (the grid) as markdown: the device, the command that
    measured it, and the tables as the run printed them."""
    name = (doc.get("device") or {}).get("name", "unknown device")
    head = f"**{name}**" + (f" — `{command}`" if command else "")
    return "\n".join([head, "", "```text", bench_report(BenchResult.from_dict(doc)).rstrip(), "```", ""])


def slowdown_lines(fitted: Fitted, interference: Sequence[dict] = ()) -> list[str]:
    """The compute slowdown per direction, route and SM count, and where it came from."""
    out = []
    for d, rows in fitted.slowdown_by_sms.items():
        items = ", ".join(f"{r[0]}{f'@{r[1]}' if r[1] else ''}{f' at {r[3] // 1024} KiB' if len(r) > 3 else ''} "
                          f"{r[2]:.0%}" for r in rows if "." in r[0])
        out.append(f"{d}: compute slowdown beside each route: {items or '-'}")
    for r in interference:
        if r.get("error"):
            out.append(f"interference not measured for {r['direction']} {r['route']}@{r['num_sms']}: {r['error']}")
    out.append(f"compute slowdown: {fitted.slowdown_source}")
    return out


def host_cost_lines(fitted: Fitted, at: Sequence[int] = (2048, 32768)) -> list[str]:
    """Each route's host cost per call, and where it came from."""
    from .host_cost import describe

    return describe(fitted.host_cost, at) + [f"host cost per call: {fitted.host_cost_source}"]
