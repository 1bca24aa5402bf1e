"""What ``kvswap bench --devices`` makes of every process's windows: each device's GB/s
alone and together, the aggregate against the sum of the ceilings alone and against the
shared ceiling (the contiguous copies of every device at once: the host's memory and PCIe
switches may cap it below the sum), the wrong NUMA node against the right one, and the
tables a person reads (:mod:`.multi` runs them)."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional, Sequence

from kvswap.resolution.plan import human_bytes

from .report import gbps_text, text_grid
from .timing import median

KiB = 1024
# The bar: on the resolved route, for blocks of BAR_SIZES, all devices at once reach at
# least this fraction of the sum of their ceilings measured alone, and of the shared ceiling.
BAR = 0.90
BAR_SIZES = (4 * KiB, 128 * KiB)
ROUTES = ("resolved", "batch")


def _sum(values: dict[str, Optional[float]]) -> Optional[float]:
    got = list(values.values())
    return round(sum(got), 3) if got and None not in got else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return round(a / b, 4) if a is not None and b else None


def _overlap(windows: list[list[dict[str, Any]]]) -> Optional[float]:
    """The least share of a together-window that all its devices spent copying at once."""
    shares = []
    for recs in windows:
        if len(recs) < 2:
            continue
        span = max(r["t1"] for r in recs) - min(r["t0"] for r in recs)
        common = min(r["t1"] for r in recs) - max(r["t0"] for r in recs)
        shares.append(max(0.0, common) / span if span > 0 else 1.0)
    return round(min(shares), 3) if shares else None


def aggregate(outs: Sequence[dict[str, Any]], steps: Sequence[Any], settings: Any,
              directions: Sequence[str]) -> dict[str, Any]:
    """The result: per device and all together, per point and route, from each process's
    windows (``outs``: what :func:`.multi._worker` sends, ``steps``: the schedule they ran)."""
    from kvswap import __version__

    outs = sorted(outs, key=lambda o: o["rank"])
    specs = [o["spec"] for o in outs]
    count = len(outs)
    names = [f"{s}" if specs.count(s) == 1 else f"{s}#{o['rank']}" for s, o in zip(specs, outs)]
    recs = [dict(r, **asdict(steps[r["step"]])) for o in outs for r in o["records"]]

    def pick(mode: str, **kw: Any) -> dict[str, Optional[float]]:
        """Median GB/s per device of the windows that match ``kw``, alone or together."""
        out = {}
        for rank, name in enumerate(names):
            got = [r["gbps"] for r in recs if r["rank"] == rank and all(r[k] == v for k, v in kw.items())
                   and (len(r["active"]) == 1) == (mode == "alone" or count == 1)]
            out[name] = round(median(got), 3) if got else None
        return out

    def windows_of(**kw: Any) -> list[list[dict[str, Any]]]:
        together = [r for r in recs if len(r["active"]) > 1 and all(r[k] == v for k, v in kw.items())]
        return [[r for r in together if r["step"] == i] for i in sorted({r["step"] for r in together})]

    result: dict[str, Any] = {
        "kvswap_version": __version__, "devices": [dict(o["info"], name=n) for o, n in zip(outs, names)],
        "directions": list(directions), "settings": asdict(settings), "bar": BAR, "bar_sizes": list(BAR_SIZES),
        "ceiling": {}, "rows": [], "numa": [], "summary": {},
        "failures": [f for o in outs for f in o["failures"]],
    }
    for d in directions:
        alone, together = pick("alone", kind="ceiling", direction=d), pick("together", kind="ceiling", direction=d)
        result["ceiling"][d] = {"alone": alone, "together": together, "sum_alone_gbps": _sum(alone),
                                "aggregate_gbps": _sum(together),
                                "aggregate_over_sum": _ratio(_sum(together), _sum(alone)),
                                "overlap": _overlap(windows_of(kind="ceiling", direction=d))}
        for b in settings.block_sizes:
            for n in settings.batch_sizes:
                for route in ROUTES:
                    key = dict(kind="point", direction=d, block_bytes=b, batch=n, route=route)
                    alone, together = pick("alone", **key), pick("together", **key)
                    if not any(v is not None for v in [*alone.values(), *together.values()]):
                        continue
                    labels = {names[r["rank"]]: r["label"] for r in recs if all(r[k] == v for k, v in key.items())}
                    agg, ceiling = _sum(together), result["ceiling"][d]
                    result["rows"].append({
                        "direction": d, "block_bytes": b, "batch": n, "route": route, "labels": labels,
                        "alone": alone, "together": together, "aggregate_gbps": agg,
                        "sum_alone_gbps": _sum(alone), "sum_ceilings_gbps": ceiling["sum_alone_gbps"],
                        "over_ceilings": _ratio(agg, ceiling["sum_alone_gbps"]),
                        "shared_ceiling_gbps": ceiling["aggregate_gbps"],
                        "over_shared_ceiling": _ratio(agg, ceiling["aggregate_gbps"]),
                        "over_alone": _ratio(agg, _sum(alone)), "overlap": _overlap(windows_of(**key)),
                    })
    for rank, (o, name) in enumerate(zip(outs, names)):
        for d in directions:
            for b in settings.block_sizes:
                for n in settings.batch_sizes:
                    got = {}
                    for host in ("right", "wrong"):
                        vals = [r["gbps"] for r in recs if r["rank"] == rank and r["kind"] == "numa" and r["host"] == host
                                and r["direction"] == d and r["block_bytes"] == b and r["batch"] == n]
                        got[host] = round(median(vals), 3) if vals else None
                    if got["right"] is None or got["wrong"] is None:
                        continue
                    result["numa"].append({"device": name, "direction": d, "block_bytes": b, "batch": n,
                                           "right_node": o["info"].get("numa_node"), "wrong_node": o["info"].get("wrong_node"),
                                           "right_gbps": got["right"], "wrong_gbps": got["wrong"],
                                           "wrong_over_right": _ratio(got["wrong"], got["right"])})
    for d in directions:
        result["summary"][d] = summarize([r for r in result["rows"] if r["direction"] == d],
                                         [r for r in result["numa"] if r["direction"] == d])
    return result


def _at(row: Optional[dict[str, Any]]) -> Optional[str]:
    return f"{human_bytes(row['block_bytes'])} x {row['batch']}" if row else None


def summarize(rows: Sequence[dict[str, Any]], numa_rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The bar over the resolved route's rows of :data:`BAR_SIZES`, against the sum of the
    ceilings alone and against the shared ceiling, and the NUMA ratios."""
    lo, hi = BAR_SIZES
    resolved = [r for r in rows if r["route"] == "resolved" and lo <= r["block_bytes"] <= hi]
    checked = [r for r in resolved if r["over_ceilings"] is not None]
    worst = min(checked, key=lambda r: r["over_ceilings"], default=None)
    shared = [r for r in resolved if r.get("over_shared_ceiling") is not None]
    worst_shared = min(shared, key=lambda r: r["over_shared_ceiling"], default=None)
    ratios = [r["wrong_over_right"] for r in numa_rows if r["wrong_over_right"] is not None]
    return {
        "bar_points": len(checked),
        "under_bar": sum(r["over_ceilings"] < BAR for r in checked),
        "min_over_ceilings": worst["over_ceilings"] if worst else None,
        "min_at": _at(worst),
        "shared_bar_points": len(shared),
        "under_shared_bar": sum(r["over_shared_ceiling"] < BAR for r in shared),
        "min_over_shared_ceiling": worst_shared["over_shared_ceiling"] if worst_shared else None,
        "min_shared_at": _at(worst_shared),
        "min_over_alone": min((r["over_alone"] for r in checked if r["over_alone"] is not None), default=None),
        "wrong_over_right_min": min(ratios, default=None),
        "wrong_over_right_median": round(median(ratios), 4) if ratios else None,
    }


def _x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def multi_report(result: dict[str, Any]) -> str:
    """The tables a person reads: the devices, the ceilings, every point (each device's
    GB/s together / alone, the aggregate against the sum of the ceilings alone, against the
    shared ceiling and against alone), the NUMA ratios, the bar."""
    names = [d["name"] for d in result["devices"]]
    lines = [f"{len(names)} device(s) at once, one process each; windows of {result['settings']['window_s']} s, "
             f"{result['settings']['windows']} per point (GB/s: their median)"]
    for d in result["devices"]:
        dev = d.get("device") or {}
        node = "unknown" if d.get("numa_node") is None else d["numa_node"]
        wrong = f", wrong node {d['wrong_node']}" if d.get("wrong_node") is not None else ""
        lines.append(f"  {d['name']}: {dev.get('name', '?')} (link {dev.get('link', '?')}, NUMA node {node}{wrong})")
    lines.append("")
    head = ["ceiling"] + [f"{n} tog/alone" for n in names] + ["aggregate", "sum alone", "agg/sum", "overlap"]
    body = [[d] + [f"{gbps_text(c['together'].get(n))}/{gbps_text(c['alone'].get(n))}" for n in names]
            + [gbps_text(c["aggregate_gbps"]), gbps_text(c["sum_alone_gbps"]), _x(c["aggregate_over_sum"]),
               _x(c["overlap"])]
            for d, c in result["ceiling"].items()]
    lines += text_grid(head, body) + [""]
    head = ["dir", "block", "batch", "route"] + [f"{n} tog/alone" for n in names] + [
        "aggregate", "agg/ceilings", "agg/shared", "agg/alone", "overlap", "impl"]
    body = []
    for r in result["rows"]:
        impls = ",".join(dict.fromkeys(r["labels"].values()))
        body.append([r["direction"], human_bytes(r["block_bytes"]), str(r["batch"]), r["route"]]
                    + [f"{gbps_text(r['together'].get(n))}/{gbps_text(r['alone'].get(n))}" for n in names]
                    + [gbps_text(r["aggregate_gbps"]), _x(r["over_ceilings"]), _x(r.get("over_shared_ceiling")),
                       _x(r["over_alone"]), _x(r["overlap"]), impls])
    lines += text_grid(head, body)
    if result["numa"]:
        lines += ["", "host memory on the wrong NUMA node (resolved route, each device alone):"]
        lines += text_grid(["device", "dir", "block", "batch", "nodes right/wrong", "right", "wrong", "wrong/right"],
                           [[r["device"], r["direction"], human_bytes(r["block_bytes"]), str(r["batch"]),
                             f"{r['right_node']}/{r['wrong_node']}", gbps_text(r["right_gbps"]),
                             gbps_text(r["wrong_gbps"]), _x(r["wrong_over_right"])] for r in result["numa"]])
    else:
        lines += ["", "wrong NUMA node: not measured (one node with memory and CPUs, or the devices' nodes unknown)"]
    lines.append("")
    lo, hi = (human_bytes(v) for v in result["bar_sizes"])
    for d, s in result["summary"].items():
        line = (f"{d}: resolved route, {lo}-{hi}: aggregate >= {result['bar']:.2f} x the sum of the ceilings alone "
                f"at {s['bar_points'] - s['under_bar']} of {s['bar_points']} points")
        if s["min_over_ceilings"] is not None:
            line += f" (lowest {s['min_over_ceilings']:.3f} at {s['min_at']})"
        if s.get("shared_bar_points"):
            line += (f"; >= {result['bar']:.2f} x the shared ceiling (every device copying at once) at "
                     f"{s['shared_bar_points'] - s['under_shared_bar']} of {s['shared_bar_points']} points "
                     f"(lowest {s['min_over_shared_ceiling']:.3f} at {s['min_shared_at']})")
        if s["wrong_over_right_median"] is not None:
            line += (f"; wrong node / right node: median {s['wrong_over_right_median']:.3f}, "
                     f"lowest {s['wrong_over_right_min']:.3f}")
        lines.append(line)
    return "\n".join(lines)
