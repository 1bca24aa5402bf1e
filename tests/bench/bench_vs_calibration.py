"""How far a bench's timings moved from the calibration whose profile it benched: per grid
point and route, the bench's GB/s over the profile's batch-sweep GB/s (1.00: unchanged).
Where every route of a point moved alike, the machine was in another state; where they moved
unevenly, a decision fitted in one state can miss in the other.

Then, per direction, what decides a route: the batch route's GB/s over the fastest kernel's
(over the SM counts both timed) at each point, in the bench over the same in calibration. Its
median and 90th-percentile distance from 1, and the points where the two runs put different
routes ahead and the bench's loser was more than 3% behind: there, the decision fitted from
the calibration misses the bench's regret bar on this machine, whatever the fitting rule.

    python tests/bench/bench_vs_calibration.py PROFILE.json BENCH.json
"""
from __future__ import annotations

import json
import sys


def short(route: str) -> str:
    return route.replace("triton.kernel", "k").replace("cuda.batch", "dma")


def main(profile_path: str, bench_path: str) -> int:
    profile, bench = json.load(open(profile_path)), json.load(open(bench_path))
    measured = {}
    for m in profile["measurements"]:
        if m["stage"] == "batch":
            route = m["impl"] + (f"@{m['num_sms']}" if m["num_sms"] else "")
            measured[(m["direction"], m["block_bytes"], m["batch"], route)] = m["gbps"]
    print(f"bench GB/s over calibration GB/s, per point and route ({bench_path} against {profile_path})")
    moves = []
    for d in bench["directions"]:
        print(d)
        for r in (r for r in bench["rows"] if r["direction"] == d):
            got = [(name, c["gbps"] / measured[(d, r["block_bytes"], r["batch"], name)])
                   for name, c in sorted(r["candidates"].items())
                   if (d, r["block_bytes"], r["batch"], name) in measured and c["gbps"]]
            if got:
                moves += [v for _, v in got]
                print(f"  {r['block_bytes'] // 1024:>4} KiB x {r['batch']:<6}"
                      + " ".join(f"{short(n)}:{v:.2f}" for n, v in got)
                      + f"   uneven by {max(v for _, v in got) / min(v for _, v in got):.2f}")
    if moves:
        moves.sort()
        print(f"all routes and points: {moves[0]:.2f}-{moves[-1]:.2f}, median {moves[len(moves) // 2]:.2f}")
    for d in bench["directions"]:
        shifts, flips = [], []
        for r in (r for r in bench["rows"] if r["direction"] == d):
            key = (d, r["block_bytes"], r["batch"])
            kernels = [n for n in r["candidates"] if n != "cuda.batch" and (*key, n) in measured]
            if "cuda.batch" not in r["candidates"] or (*key, "cuda.batch") not in measured or not kernels:
                continue
            cal = measured[(*key, "cuda.batch")] / max(measured[(*key, n)] for n in kernels)
            got = r["candidates"]["cuda.batch"]["gbps"] / max(r["candidates"][n]["gbps"] for n in kernels)
            shifts.append(abs(got / cal - 1.0))
            if (cal >= 1.0) != (got >= 1.0) and min(got, 1.0 / got) < 0.97:
                flips.append(f"{r['block_bytes'] // 1024} KiB x {r['batch']} ({cal:.2f} -> {got:.2f})")
        if shifts:
            shifts.sort()
            print(f"{d}: batch/kernel ratio, bench over calibration, {len(shifts)} points: off 1 by median "
                  f"{shifts[len(shifts) // 2]:.1%}, 90th percentile {shifts[int(0.9 * (len(shifts) - 1))]:.1%}; "
                  f"order flipped with the loser over 3% behind at {len(flips)}"
                  + (": " + ", ".join(flips) if flips else ""))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
