"""What a short call costs when the thread has been doing something else (CPU only; not a
test: it prints, it asserts nothing).

A call's host time depends on whether its code and data are still in the CPU caches. This
times the same calls after four kinds of wait, median of ``--reps`` each:

* ``warm``: right after the same call, no wait;
* ``nap``: after the thread slept ``--wait-ms`` (as a thread blocked on a stream does);
* ``spin``: after the thread spun ``--wait-ms`` in a Python loop (it never slept);
* ``spin-self``: after the thread spent ``--wait-ms`` repeating the timed call itself.

If ``nap`` and ``spin`` are alike and ``spin-self`` is as quick as ``warm``, what slows the call
is not sleeping or the device but time spent on other work: its lines were evicted.

Calls: ``check`` (kvswap's whole-batch check of ``--descriptors`` scattered 4 KiB descriptors,
what every SwapFn call runs first), ``numpy`` (ten sorts of a 64-element array) and ``python``
(a 300-step loop of integer arithmetic), the last two as references that involve no kvswap.

    python3 tests/bench/diag_cold_calls.py [--descriptors 16,64,5120] [--wait-ms 25] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from typing import Any, Callable

import numpy as np

BLOCK = 4096
WAITS = ("warm", "nap", "spin", "spin-self")


def wait(kind: str, seconds: float, call: Callable[[], Any]) -> None:
    t = time.perf_counter()
    if kind == "nap":
        time.sleep(seconds)
    elif kind == "spin":
        while time.perf_counter() - t < seconds:
            pass
    elif kind == "spin-self":
        while time.perf_counter() - t < seconds:
            call()


def timed(call: Callable[[], Any], kind: str, seconds: float) -> float:
    call()
    wait(kind, seconds, call)
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        call()
        return (time.perf_counter_ns() - t0) / 1e3
    finally:
        gc.enable()


def calls(descriptors: list[int]) -> dict[str, Callable[[], Any]]:
    from kvswap.addressing.descriptors import validate

    rng = np.random.default_rng(0)
    out: dict[str, Callable[[], Any]] = {}
    for n in descriptors:
        slots = 4 * n
        # Host and device pools far apart, as pinned host memory and device memory lie.
        s = rng.permutation(slots)[:n].astype(np.int64) * BLOCK + (1 << 40)
        d = rng.permutation(slots)[:n].astype(np.int64) * BLOCK + (1 << 44)
        z = np.full(n, BLOCK, dtype=np.int64)
        out[f"check n={n}"] = lambda s=s, d=d, z=z: validate(s, d, z)
    a = rng.permutation(64)
    out["numpy"] = lambda: [np.sort(a) for _ in range(10)]
    out["python"] = lambda: sum(i * i for i in range(300))
    return out


def main(argv: Any = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--descriptors", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 5120])
    ap.add_argument("--wait-ms", type=float, default=25.0)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    seconds = args.wait_ms / 1e3
    rows = []
    print(f"{platform.processor() or platform.machine()}; median of {args.reps}, µs; waits of {args.wait_ms} ms")
    print(f"{'call':16s}" + "".join(f"{k:>11s}" for k in WAITS) + "   nap/warm")
    for name, call in calls(args.descriptors).items():
        # Every wait each rep, so drift spreads over all alike.
        got: dict[str, list[float]] = {k: [] for k in WAITS}
        for _ in range(args.reps):
            for k in WAITS:
                got[k].append(timed(call, k, seconds))
        med = {k: statistics.median(v) for k, v in got.items()}
        rows.append({"call": name, **{f"{k}_us": round(v, 2) for k, v in med.items()}})
        print(f"{name:16s}" + "".join(f"{med[k]:11.1f}" for k in WAITS) + f"{med['nap'] / med['warm']:10.1f}x",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"wait_ms": args.wait_ms, "reps": args.reps, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
