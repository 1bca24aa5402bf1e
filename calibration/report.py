"""What ``kvswap calibrate`` and ``kvswap bench`` print: tables a person reads."""
from __future__ import annotations

from typing import Any, Optional

from kvswap.plan import human_bytes

from .bench import BAR_BEST, BAR_PEER
from .records import SIZE, Measurement


def _gb(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.1f}"


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def describe_decision(d: str, dec: dict[str, Any]) -> list[str]:
    """The decisions for one direction in words."""
    if "carried_from" in dec:
        return [f"{d}: not measured in this run; thresholds carried over from {dec['carried_from']}"]
    lines = [f"{d}:"]
    for r in dec.get("routes", []):
        lo, hi = r["min_bytes"], r["max_bytes"]
        if lo <= 1:
            span = "of every size" if hi is None else f"below {human_bytes(hi + 1)}"
        else:
            span = f"from {human_bytes(lo)}" if hi is None else f"{human_bytes(lo)} to <{human_bytes(hi + 1)}"
        sms = f" on {r['num_sms']} SMs" if r.get("num_sms") else ""
        lines.append(f"  blocks {span:<22} -> {r['impl']}{sms}")
    if dec.get("kernel_sms"):
        lines.append(
            f"  SM knee: {dec['kernel_sms']} SMs (fewest within {dec['knee_tolerance']:.0%} of the kernel's best; "
            f"it peaks at {dec['kernel_peak_sms']} SMs)"
        )
    if dec.get("min_batch_by_size"):
        pairs = ", ".join(f"{human_bytes(b)}: {n}" for b, n in dec["min_batch_by_size"])
        lines.append(f"  kernel only for batches of at least (by block size) {pairs}; smaller ones take the batch route")
    elif dec.get("kernel_min_batch"):
        lines.append(f"  kernel from batches of {dec['kernel_min_batch']} descriptors; smaller batches take the batch route")
    tiers = [(b, t) for b, t in dec.get("kernel_sms_by_batch", []) if any(k != dec.get("kernel_sms") for _, k in t)]
    if tiers:
        lines.append("  kernel SMs by batch size, where they differ from the knee:")
        for b, t in tiers:
            if not any(k for _, k in t):
                continue  # a batch route's size the kernel takes no batch of
            steps = ", ".join((f"{k} SMs" if k else "batch route") + (f" from {n}" if n > 1 else "") for n, k in t)
            lines.append(f"    {human_bytes(b)} blocks: {steps}")
    if dec.get("crossover_bytes"):
        lines.append(f"  crossover: batch route from {human_bytes(dec['crossover_bytes'])} blocks")
    if not dec.get("routes"):
        lines.append("  nothing measured")
    return lines


def calibration_report(doc: dict[str, Any]) -> str:
    """Per direction, GB/s by block size for each route, then the decisions."""
    ms = [Measurement.from_dict(m) for m in doc.get("measurements", [])]
    out = []
    for d, dec in doc.get("decisions", {}).items():
        size = [m for m in ms if m.direction == d and m.stage == SIZE]
        if not size:
            continue
        knee = dec.get("kernel_sms")
        batch_impls = sorted({m.impl for m in size if m.kind == "batch"})
        kernel_impls = sorted({m.impl for m in size if m.kind == "kernel"})
        header = ["block", "n"] + batch_impls + [f"{k}@{knee}" for k in kernel_impls if knee] + \
            [f"{k} best (SMs)" for k in kernel_impls] + ["route"]
        chosen = {r["block_bytes"]: r for r in dec.get("by_size", [])}
        rows = []
        for b in sorted({m.block_bytes for m in size}):
            at = [m for m in size if m.block_bytes == b]
            get = lambda impl, sms: next((m.gbps for m in at if m.impl == impl and m.num_sms == sms), None)  # noqa: E731
            row = [human_bytes(b), str(max(m.batch for m in at))]
            row += [_gb(get(i, None)) for i in batch_impls]
            row += [_gb(get(k, knee)) for k in kernel_impls if knee]
            for k in kernel_impls:
                best = max((m for m in at if m.impl == k), key=lambda m: m.gbps, default=None)
                row.append(f"{best.gbps:.1f} ({best.num_sms})" if best else "-")
            r = chosen.get(b) or {"impl": "-"}
            row.append(r["impl"] + (f"@{r['num_sms']}" if r.get("num_sms") else ""))
            rows.append(row)
        ceiling = doc.get("ceiling_gbps", {}).get(d)
        out.append(f"{d}: GB/s by block size (contiguous ceiling {_gb(ceiling)} GB/s)")
        out += ["  " + line for line in _grid(header, rows)]
        out.append("")
    out.append("decisions:")
    for d, dec in doc.get("decisions", {}).items():
        out += ["  " + line for line in describe_decision(d, dec)]
    by_dir: dict[str, list[str]] = {}
    for r in doc.get("interference", []):
        label = r["impl"] + (f"@{r['num_sms']}" if r.get("num_sms") else "")
        by_dir.setdefault(r["direction"], []).append(f"{label} {r['slowdown']:.0%}" + ("" if r["covered"] else " (partial)"))
    for d, items in by_dir.items():
        out.append(f"  {d}: GEMM slowdown beside each route ({doc['interference'][0]['block_bytes'] // 1024} KiB "
                   f"blocks): {', '.join(items)}")
    if doc.get("slowdown"):
        pairs = ", ".join(f"{k} {v:.0%}" for k, v in sorted(doc["slowdown"].items()))
        out.append(f"  compute slowdown beside a GEMM: {pairs} ({doc.get('slowdown_source', '')})")
    grouped: dict[tuple[str, str, str], list[int]] = {}
    for f in doc.get("failures", []):  # one line per route and cause, however many SM counts
        grouped.setdefault((f["direction"], f["impl"], f["error"]), []).extend([f["num_sms"]] if f.get("num_sms") else [])
    for (d, impl, error), sms in grouped.items():
        on = f" on {', '.join(map(str, sms))} SMs" if sms else ""
        out.append(f"  skipped {d} {impl}{on}: {error}")
    return "\n".join(out)


def _ratio(row: dict[str, Any], key: str, missing: str) -> str:
    """A bench ratio with twice its standard error, where the row has one."""
    if not row.get(key):
        return missing
    se = row.get(key + "_se")
    return f"{row[key]:.3f}" + (f" ±{2 * se:.3f}" if se is not None else "")


def bench_report(result: dict[str, Any]) -> str:
    """One table per direction: ceiling, each candidate, resolved, peer, and the ratios
    (± two standard errors; "=" where resolved takes the peer's own route)."""
    out = []
    for d in result["directions"]:
        rows = [r for r in result["rows"] if r["direction"] == d]
        if not rows:
            continue
        names = sorted({n for r in rows for n in r["candidates"]})
        header = ["block", "n"] + names + ["resolved", "route", "peer", "res/best", "res/peer"]
        table = []
        for r in rows:
            line = [human_bytes(r["block_bytes"]), str(r["batch"])]
            line += [_gb(r["candidates"].get(n, {}).get("gbps")) for n in names]
            res, peer = r["resolved"], r["peer"]
            line += [_gb(res["gbps"]), res["route"], _gb(peer["gbps"]) if peer else "n/a",
                     _ratio(r, "resolved_over_best", "-"),
                     _ratio(r, "resolved_over_peer", "n/a") + (" =" if peer and peer.get("same_route") else "")]
            table.append(line)
        out.append(f"{d}: GB/s (contiguous ceiling {_gb(result['ceiling_gbps'].get(d))} GB/s)")
        out += ["  " + line for line in _grid(header, table)]
        s = result["summary"].get(d, {})
        worst = {k: "n/a" if s.get(k) is None else f"{s[k]:.3f}"
                 for k in ("min_resolved_over_best", "min_resolved_over_peer")}
        out.append(f"  worst resolved/best-candidate (regret): {worst['min_resolved_over_best']}; "
                   f"worst resolved/peer: {worst['min_resolved_over_peer']}")
        if "under_best_bar" in s:
            out.append(f"  of {s['points']} points: {s['under_best_bar']} under {BAR_BEST} x the best candidate "
                       f"({s['under_best_bar_beyond_noise']} by more than 2 standard errors); "
                       f"{s['under_peer']} under {BAR_PEER} x the peer ({s['under_peer_beyond_noise']} by more than "
                       f"2 standard errors; {s['under_peer_same_route']} on the peer's own route)")
        again = [r for r in rows if r.get("confirm")]
        if again:
            k = again[0]["confirm"]["passes"]
            out.append(f"  timed again after the grid, on fresh draws ({k} pass{'es' if k != 1 else ''} each; "
                       "resolved against the same best candidate, and the peer where it takes another route):")
            for r in again:
                c = r["confirm"]
                line = (f"    {human_bytes(r['block_bytes'])} x {r['batch']}: res/best {_ratio(r, 'resolved_over_best', '-')}"
                        f" -> {_ratio(c, 'resolved_over_best', '-')} ({c['best']})")
                if c.get("resolved_over_peer") is not None:
                    line += (f"; res/peer {_ratio(r, 'resolved_over_peer', 'n/a')} -> "
                             f"{_ratio(c, 'resolved_over_peer', 'n/a')} ({r['peer']['route']})")
                out.append(line)
            out.append(f"  of those {s['confirmed_points']}: {s['confirmed_under_best_bar']} still under {BAR_BEST} x the "
                       f"best candidate ({s['confirmed_under_best_bar_beyond_noise']} by more than 2 standard errors); "
                       f"{s['confirmed_under_peer']} still under {BAR_PEER} x the peer on another route "
                       f"({s['confirmed_under_peer_beyond_noise']} by more than 2 standard errors)")
        if s.get("same_work_pairs"):
            out.append(f"  identical work timed {s['same_work_min']:.3f}-{s['same_work_max']:.3f} x apart "
                       f"({s['same_work_pairs']} pairs of resolved and a candidate or the peer on its very route): "
                       "the run's noise floor")
        out.append("")
    return "\n".join(out)
