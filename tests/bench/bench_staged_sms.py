"""The staged route's device side on several SM counts, paired in one run (GPU; not a test:
it prints, it asserts nothing).

Two parts, each over ``--sms`` (e.g. 32,66,132):

* ``interference``: the compute slowdown beside a staged job, measured the step benchmark's way
  (``kvswap.calibration.step_interference``, block-major host cache, 4/16/32 KiB chunks, with
  the contiguous-copy reference), the route bound with each SM count in turn
  (``triton_generic.staged.DEVICE_SMS``);
* ``step``: the step benchmark (``kvswap bench --model``) with one contender per SM count
  (``Policy(force=<the staged route>, max_sms=k)``), contenders interleaved within each
  repetition with the benchmark's contiguous reference; the arguments after ``--`` go to
  ``kvswap bench``.

``render`` prints either part's JSON as markdown: the slowdown by SM count beside the
contiguous copy's, or per case the transfer alone over its time on the fewest SMs and the step
over the contiguous reference's (span/contiguous).

    python3 tests/bench/bench_staged_sms.py interference --sms 32,132 --json $OUT/sms.json
    python3 tests/bench/bench_staged_sms.py step --sms 32,66,132 -- --model llama-3.1-8b \\
        --tp 1 --blocks 512 --host-layouts block-major --reps 5 --json $OUT/sms_step.json
    python3 tests/bench/bench_staged_sms.py render $OUT/sms.json $OUT/sms_step.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys


def interference(sms: list, reps: int, out: str) -> None:
    from kvswap.backends.triton_generic import staged
    from kvswap.calibration import step_interference as si
    from kvswap.calibration.step import DeviceEnv
    from kvswap.registry.platform import detect
    from kvswap.registry.plugins import plugin_host
    from kvswap.types import Direction

    host = plugin_host()
    dev = detect(host, None)
    records = []
    for k in sms:
        staged.DEVICE_SMS = k  # what the route binds with when the policy names no SM count
        for r in si.measure(DeviceEnv(dev, 20.0), dev, [Direction.H2D, Direction.D2H], reps=reps, host=host,
                            staged=True, per_layer=False, by_size=si.size_workloads()):
            r["device_sms"] = k
            records.append(r)
            slow = f"{r['slowdown']:6.1%}" if "slowdown" in r else r.get("error", "")[:60]
            print(f"device side on {k:3d} SMs  {r['direction']}  {r['route']:16s} {r['chunk_bytes'] // 1024:3d} KiB  "
                  f"slowdown {slow}  transfer beside {r.get('transfer_beside_ms', 0):6.2f} ms", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"device": dev.name, "records": records}, f, indent=1)


def step(sms: list, bench_args: list) -> int:
    from kvswap import Policy
    from kvswap.calibration import step as step_bench
    from kvswap.calibration.step_contenders import Contender
    from kvswap.cli import main

    def contenders(direction, cache, blocks, batch_impl, kernel_impl, staged_impl=None, with_variants=False):
        return [Contender(f"staged@{k}", Policy(force=staged_impl, max_sms=k)) for k in sms] if staged_impl else []

    step_bench.contenders_for = contenders
    return main(["bench", *bench_args])


def render(doc: dict) -> str:
    """Markdown for one part's JSON."""
    if "cases" in doc:  # the step part: kvswap bench's JSON, its contenders staged@k and the reference
        sms = sorted({int(c["name"].split("@")[1]) for case in doc["cases"] for c in case["contenders"]
                      if c["name"].startswith("staged@")})
        device = doc["device"]["name"] if isinstance(doc["device"], dict) else doc["device"]
        lines = [f"{device}, {doc['cases'][0]['reps']} repetitions, contenders interleaved:", "",
                 "| model | tp | dir | chunk | B | " + " | ".join(f"alone @{k}" for k in sms[1:])
                 + " | " + " | ".join(f"step/contiguous @{k}" for k in sms) + " |",
                 "|---" * (5 + 2 * len(sms) - 1) + "|"]
        for case in doc["cases"]:
            by = {int(c["name"].split("@")[1]): c for c in case["contenders"] if c["name"].startswith("staged@")}
            base = by[sms[0]]["transfer_alone_ms"]
            lines.append(f"| {case['model']} | {case['tp']} | {case['direction']} | {case['chunk_bytes'] // 1024} KiB "
                         f"| {case['blocks']} | " + " | ".join(f"{by[k]['transfer_alone_ms'] / base:.3f}" for k in sms[1:])
                         + " | " + " | ".join(f"{by[k]['span_over_contiguous']:.3f}" for k in sms) + " |")
        spans = {k: [c["span_over_contiguous"] for case in doc["cases"] for c in case["contenders"]
                     if c["name"] == f"staged@{k}"] for k in sms}
        lines.append("| geomean | | | | | " + " | ".join("" for _ in sms[1:]) + " | "
                     + " | ".join(f"{math.exp(sum(map(math.log, v)) / len(v)):.3f}" for v in spans.values()) + " |")
        lines += ["", f"alone @k: the transfer alone on k SMs over its time on {sms[0]}."]
        return "\n".join(lines) + "\n"
    rows: dict = {}
    for r in doc["records"]:
        if "slowdown" in r:
            rows.setdefault((r["direction"], r["chunk_bytes"]), {}).setdefault(r["kind"], {})[r["device_sms"]] = r["slowdown"]
    sms = sorted({r["device_sms"] for r in doc["records"]})
    lines = [f"{doc['device']}, compute slowdown beside a job (step_interference):", "",
             "| dir | chunk | " + " | ".join(f"staged @{k}" for k in sms) + " | contiguous copy |",
             "|---" * (3 + len(sms)) + "|"]
    for (d, chunk), kinds in sorted(rows.items()):
        ref = sorted(kinds.get("contiguous", {}).values())
        lines.append(f"| {d} | {chunk // 1024} KiB | "
                     + " | ".join(f"{kinds['staged'][k]:.1%}" if k in kinds.get("staged", {}) else "-" for k in sms)
                     + (f" | {ref[0]:.1%} to {ref[-1]:.1%} |" if ref else " | - |"))
    return "\n".join(lines) + "\n"


def run() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=("interference", "step", "render"))
    ap.add_argument("--sms", type=lambda s: [int(x) for x in s.split(",")], default=[32, 132])
    ap.add_argument("--reps", type=int, default=5, help="interference: repetitions per route")
    ap.add_argument("--json", default="", help="interference: write the records here")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # step: kvswap bench's arguments follow "--"
    if argv[:1] == ["render"]:
        for path in argv[1:]:
            with open(path) as f:
                print(render(json.load(f)))
        return 0
    args = ap.parse_args(argv[:cut])
    if args.part == "interference":
        interference(args.sms, args.reps, args.json)
        return 0
    return step(args.sms, argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(run())
