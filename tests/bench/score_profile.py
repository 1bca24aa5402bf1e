"""Score profiles against a bench they did not run in: at every point of a ``kvswap bench
--json`` file, the route each PROFILE resolves there, and that route's ratio to the point's
best candidate, from the bench's own paired ratios (resolved over each candidate, round by
round: the route's ratio to the best is resolved-over-best divided by resolved-over-route);
and, per profile and direction, the mean SM count of those routes and their ratio to the
bench's peer (vLLM's policy), the same way.

Not a test. It answers "would another fit of the same measurements have done better in
this bench?" without a device. Routes are decided by the resolver's own route
building (:func:`kvswap.resolution.routing.routes`) from each profile's decisions, at the bench's exact
block size, as ``kvswap bench`` resolves them; a point is left out where a profile picks a
kernel SM count the bench did not time. The first PROFILE should be the one the bench ran
with: its routes must match the bench's resolved ones, which the script checks.

    python tests/bench/score_profile.py BENCH.json LABEL=PROFILE.json [LABEL=PROFILE.json ...]
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def route_at(routes, block: int, batch: int, knee: int) -> str:
    """The bench's label (``cuda.batch``, ``triton.kernel@K``) of what a SwapFn with
    ``routes`` runs for ``batch`` blocks of ``block`` bytes (:meth:`kvswap.Route.runs`)."""
    route = next(r for r in routes if r.min_bytes <= block and (r.max_bytes is None or block <= r.max_bytes))
    name, tier = route.runs(batch)
    return f"{name}@{tier or knee}" if name.startswith("triton.") else name


def routes_of(path: Path, direction: str, block: int):
    from kvswap import CopyImpl, DeviceInfo, Direction, Policy
    from kvswap.resolution import profiles, routing

    cal = profiles.load(path)
    device = DeviceInfo(platform="cuda", name=cal.identity, identity=cal.identity, compute_units=132)
    d = Direction.parse(direction)
    impls = [CopyImpl("cuda.batch", "batch", ("cuda",), (d,), factory=lambda ctx: None),
             CopyImpl("triton.kernel", "kernel", ("cuda",), (d,), factory=lambda ctx: None)]
    knee = routing.knee_sms(cal, d, Policy(), device)
    return routing.routes(impls, cal, d, Policy(), (block,), knee, device), knee


def main(args: list[str]) -> int:
    if len(args) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    bench = json.load(open(args[0]))
    profiles = [(a.rpartition("=")[0] or a, Path(a.rpartition("=")[2])) for a in args[1:]]
    for i, (label, path) in enumerate(profiles):
        for direction in bench["directions"]:
            scores, untimed, mismatched, sms, peer = [], 0, [], [], []
            for r in bench["rows"]:
                if r["direction"] != direction or r["resolved_over_best"] is None:
                    continue
                routes, knee = routes_of(path, direction, r["block_bytes"])
                name = route_at(routes, r["block_bytes"], r["batch"], knee)
                if i == 0 and name != r["resolved"]["route"]:
                    mismatched.append(f"{r['block_bytes'] // 1024} KiB x {r['batch']}: {name} vs {r['resolved']['route']}")
                cand = r["candidates"].get(name)
                if cand is None:
                    untimed += 1
                    continue
                scores.append((r["resolved_over_best"] / cand["resolved_over"], r["block_bytes"], r["batch"], name))
                sms.append(int(name.partition("@")[2] or 0))
                if r.get("resolved_over_peer"):
                    peer.append(r["resolved_over_peer"] / cand["resolved_over"])
            vals = [s[0] for s in scores]
            worst = sorted(scores)[:3]
            print(f"{label} {direction}: {len(vals)} points, route/best median {statistics.median(vals):.3f}, "
                  f"min {min(vals):.3f}, under 0.97: {sum(v < 0.97 for v in vals)}, mean {statistics.fmean(vals):.4f}"
                  + (f"; {untimed} left out (SM count not timed)" if untimed else ""))
            print("    worst: " + ", ".join(f"{b // 1024} KiB x {n} {name} {v:.3f}" for v, b, n, name in worst))
            print(f"    SMs a call (the batch route: 0): mean {statistics.fmean(sms):.1f}"
                  + (f"; route/peer min {min(peer):.3f}, under 1.0: {sum(v < 1.0 for v in peer)}, "
                     f"under 0.99: {sum(v < 0.99 for v in peer)}" if peer else ""))
            if mismatched:
                print(f"    ROUTES DIFFER FROM THE BENCH'S RESOLVED ({len(mismatched)}): " + "; ".join(mismatched[:5]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
