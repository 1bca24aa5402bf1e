"""Merge two profiles' raw measurements into one and fit it again: what would a profile made
from two machines of a kind decide?

Not a test, and not a feature: tried once (session 8) on the H100 profiles of two machines,
and the merged profile did no better than the shipped one (docs/results/session8). Where
both profiles measured a point (same direction, stage, impl, SM count, block size and
batch) the merged time is the geometric mean of the two; points only one measured are kept
as they are (each machine's batch sweep times the SM tiers of its own knee). Then
tests/bench/refit_profile.py fits the decisions from the merged measurements.

    python tests/bench/merge_profiles.py FIRST.json SECOND.json OUT.json
    python tests/bench/refit_profile.py OUT.json
"""
from __future__ import annotations

import copy
import json
import math
import sys


def key(m: dict) -> tuple:
    return m["direction"], m["stage"], m["impl"], m["num_sms"], m["block_bytes"], m["batch"]


def merge(first: dict, second: dict) -> dict:
    other = {key(m): m for m in second["measurements"]}
    out = []
    for m in first["measurements"]:
        o = other.pop(key(m), None)
        if o is not None:
            seconds = math.sqrt(m["seconds"] * o["seconds"])
            m = dict(m, seconds=seconds, gbps=m["gbps"] * m["seconds"] / seconds, spread=max(m["spread"], o["spread"]))
        out.append(m)
    doc = copy.deepcopy(first)
    doc["measurements"] = out + list(other.values())
    doc["notes"] = [f"measurements merged from two profiles of {first['created']} and {second['created']}"]
    return doc


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    docs = [json.load(open(p)) for p in argv[:2]]
    with open(argv[2], "w") as f:
        json.dump(merge(*docs), f)
    print(f"merged profile written to {argv[2]}; fit it with tests/bench/refit_profile.py {argv[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
