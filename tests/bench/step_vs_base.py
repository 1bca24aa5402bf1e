"""The default's step on a per-layer host against an older tree's default, from two step
benchmark JSON files measured on one machine (not a test: it prints ratios, asserts nothing).

Per case (model x TP x direction x blocks), the default's makespan over the compute alone of
its own repetition (``makespan_over_compute``, which cancels the GPU's clock drift between
repetitions) in the current run over the same in the base run, against a bar (1.05 by
default). The batch-only contender moves the same blocks the same way in both trees; its
ratio is printed beside as the drift between the two runs.

    python tests/bench/step_vs_base.py BASE.json HEAD.json [--bar 1.05]

``tests/bench/step_vs_base.sh`` measures both files and runs this.
"""
from __future__ import annotations

import argparse
import json
import math
from typing import Any, Optional

Key = tuple[str, int, str, int]


def per_layer(doc: dict[str, Any], contender: str) -> dict[Key, float]:
    """``contender``'s makespan over compute per per-layer case (a run from before host
    layouts existed has only per-layer cases)."""
    out: dict[Key, float] = {}
    for case in doc["cases"]:
        if case.get("host_layout", "per-layer") != "per-layer":
            continue
        for c in case["contenders"]:
            if c["name"] == contender and c.get("makespan_over_compute") and not c.get("error"):
                out[(case["model"], case["tp"], case["direction"], case["blocks"])] = c["makespan_over_compute"]
    return out


def compare(base: dict[str, Any], head: dict[str, Any], bar: float = 1.05) -> dict[str, Any]:
    """Rows for the cases both runs have, and the summary: how many within ``bar``, the worst
    and the geomean of head over base."""
    b, h = per_layer(base, "default"), per_layer(head, "default")
    bb, hb = per_layer(base, "batch"), per_layer(head, "batch")
    rows = []
    for key in sorted(set(b) & set(h)):
        control: Optional[float] = hb[key] / bb[key] if key in bb and key in hb else None
        rows.append(dict(model=key[0], tp=key[1], direction=key[2], blocks=key[3], base=b[key], head=h[key],
                         ratio=h[key] / b[key], batch_ratio=control))
    ratios = [r["ratio"] for r in rows]
    return dict(bar=bar, rows=rows, cases=len(rows), within=sum(r <= bar for r in ratios),
                worst=max(ratios, default=None),
                geomean=math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
                only_base=sorted(set(b) - set(h)), only_head=sorted(set(h) - set(b)))


def table(result: dict[str, Any]) -> str:
    lines = ["| model | tp | dir | B | base: span/compute | head: span/compute | head / base | batch: head / base |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        control = "-" if r["batch_ratio"] is None else f"{r['batch_ratio']:.3f}"
        lines.append(f"| {r['model']} | {r['tp']} | {r['direction']} | {r['blocks']} | {r['base']:.3f} | "
                     f"{r['head']:.3f} | {r['ratio']:.3f} | {control} |")
    if result["cases"]:
        lines.append("")
        lines.append(f"per-layer: default's step, head over base <= {result['bar']}: {result['within']}/"
                     f"{result['cases']} cases; worst {result['worst']:.3f}; geomean {result['geomean']:.3f}")
    for side in ("only_base", "only_head"):
        if result[side]:
            lines.append(f"{side.replace('_', ' in ')}: {len(result[side])} case(s), not compared")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="the older tree's step JSON (kvswap bench --model ... --json)")
    ap.add_argument("head", help="the current tree's step JSON")
    ap.add_argument("--bar", type=float, default=1.05)
    args = ap.parse_args(argv)
    with open(args.base) as f, open(args.head) as g:
        result = compare(json.load(f), json.load(g), args.bar)
    print(table(result))
    return result


if __name__ == "__main__":
    main()
