"""One block per `kvswap bench --json` file: per direction, the worst ratios, the points under
issue 6's bars (and those under by more than two standard errors), and the range over which
the bench timed identical work; the points timed again after the grid (``--confirm``) and
how many of them stayed under each bar; then every point under 0.97 x the best candidate.

    python tests/bench/summarize_benches.py LABEL=BENCH.json [LABEL=BENCH.json ...]
"""
from __future__ import annotations

import json
import sys


def main(args: list[str]) -> int:
    from kvswap.calibration.bench import BAR_BEST, summarize

    def num(v: object) -> str:
        return "n/a" if v is None else f"{v:.3f}"

    for arg in args:
        name, _, path = arg.rpartition("=")
        doc = json.load(open(path))
        print(f"{name or path} ({path}; passes: {doc['settings'].get('passes', 1)})")
        for d in doc["directions"]:
            rows = [r for r in doc["rows"] if r["direction"] == d]
            s = summarize(rows)
            print(f"  {d}: best {num(s['min_resolved_over_best'])}, {s['under_best_bar']} under "
                  f"({s['under_best_bar_beyond_noise']}); peer {num(s['min_resolved_over_peer'])}, {s['under_peer']} under "
                  f"({s['under_peer_beyond_noise']}; {s['under_peer_same_route']} same route); identical work "
                  f"{num(s['same_work_min'])}-{num(s['same_work_max'])} ({s['same_work_pairs']})")
            if s.get("confirmed_points"):
                print(f"      timed again: {s['confirmed_points']} points; still under the best's bar "
                      f"{s['confirmed_under_best_bar']} ({s['confirmed_under_best_bar_beyond_noise']}), the peer's "
                      f"on another route {s['confirmed_under_peer']} ({s['confirmed_under_peer_beyond_noise']})")
            for r in rows:
                if r["resolved_over_best"] is not None and r["resolved_over_best"] < BAR_BEST:
                    print(f"      under {BAR_BEST}: {r['block_bytes'] // 1024} KiB x {r['batch']}: resolved "
                          f"{r['resolved']['route']}, best {r['best']}, {r['resolved_over_best']:.3f} "
                          f"±{2 * r['resolved_over_best_se']:.3f}"
                          + (f", again {r['confirm']['resolved_over_best']:.3f} ±{2 * r['confirm']['resolved_over_best_se']:.3f}"
                             if r.get("confirm") and r["confirm"]["resolved_over_best"] is not None else ""))
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))
