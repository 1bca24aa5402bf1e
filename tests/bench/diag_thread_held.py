"""Why a call holds the thread longer when the stream is busy (GPU; not a test: it prints,
it asserts nothing).

``bench_thread_held.py`` times each call with a sleep kernel queued on its stream and the
thread blocked on that stream between calls. This separates what that does: the same calls
timed in five conditions, median of ``--reps`` each:

* ``idle``: nothing queued before the call, the stream waited for after it;
* ``busy``: a sleep kernel queued on the call's stream first, the thread blocked on it after
  (``bench_thread_held.py``'s condition);
* ``busy-spin``: the same, the stream polled after (the thread never sleeps);
* ``other``: the sleep kernel on another stream, the call's stream idle, the thread blocked
  on the other stream after (the GPU busy, the call's stream not);
* ``nap``: no GPU work queued; the thread sleeps as long as the sleep kernel runs before the
  call (the thread cold, the GPU idle).

Each timed call follows an untimed one in the same condition, so the wait just before it is its
own condition's.

Calls, on ``--descriptors`` scattered 4 KiB blocks host to device: ``cpu`` (kvswap's whole-batch
check alone: numpy, no driver call), ``raw`` (the bound kernel route's launch without kvswap's
check and routing) and ``swapfn`` (the resolved SwapFn forced onto that route). A ``cpu`` call
that slows as much as the others says the thread, not the stream, is what slows. The
``swapfn`` call is also cut in three by clock reads inside it: ``check`` (the whole-batch
check), ``route`` (from there to the bound transfer) and ``launch`` (the bound transfer).

    python3 tests/bench/diag_thread_held.py [--descriptors 64,5120] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any, Callable

import numpy as np

BLOCK = 4096
SPIN = 50_000_000  # sleep-kernel cycles: some 25-30 ms
CONDITIONS = ("idle", "busy", "busy-spin", "other", "nap")


def timed(call: Callable[[], Any], condition: str, stream: Any, other: Any, marks: list) -> float:
    import torch

    if condition in ("busy", "busy-spin"):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SPIN)
    elif condition == "other":
        with torch.cuda.stream(other):
            torch.cuda._sleep(SPIN)
    elif condition == "nap":
        time.sleep(0.025)
    gc.disable()
    try:
        t0 = time.perf_counter_ns()
        marks.append(t0)
        call()
        t1 = time.perf_counter_ns()
    finally:
        gc.enable()
    if condition == "busy-spin":
        while not stream.query():
            pass
    other.synchronize()
    stream.synchronize()
    return (t1 - t0) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--descriptors", type=lambda s: [int(x) for x in s.split(",")], default=[64, 5120])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    import kvswap
    from kvswap import Policy
    from kvswap.addressing.descriptors import validate
    from kvswap.resolution import swapfn as swapfn_module

    marks: list = []  # clock reads: the call's start, then (SwapFn) after its check, around the transfer

    def checked(*a: Any) -> Any:
        out = validate(*a)
        marks.append(time.perf_counter_ns())
        return out

    def clocked(f: Any) -> Any:
        def transfer(*a: Any) -> Any:
            marks.append(time.perf_counter_ns())
            try:
                return f(*a)
            finally:
                marks.append(time.perf_counter_ns())
        return transfer

    dev = f"cuda:{torch.cuda.current_device()}"
    slots = 2 * max(args.descriptors)
    host = torch.randint(0, 256, (slots * BLOCK,), dtype=torch.uint8).pin_memory()
    gpu = torch.randint(0, 256, (slots * BLOCK,), dtype=torch.uint8, device=dev)
    stream, other = torch.cuda.Stream(), torch.cuda.Stream()
    fn = kvswap.resolve("h2d", device=dev, block_bytes=BLOCK, policy=Policy(force="triton.kernel"))
    raw_fns = dict(fn._fns)
    # The SwapFn's own calls clocked: its check, and the transfers its steps call.
    swapfn_module.validate = checked
    fn._fns = {key: clocked(f) for key, f in raw_fns.items()}
    fn._steps = [fn._steps_of(r) for r in fn.plan.routes]
    fn._by_size.clear()
    rng = np.random.default_rng(0)
    rows = []
    for n in args.descriptors:
        def draw() -> tuple:
            s = rng.permutation(slots)[:n].astype(np.int64) * BLOCK + host.data_ptr()
            d = rng.permutation(slots)[:n].astype(np.int64) * BLOCK + gpu.data_ptr()
            return s, d, np.full(n, BLOCK, dtype=np.int64)

        s, d, z = draw()
        fn(s, d, z, stream=stream)
        stream.synchronize()
        bound = raw_fns[fn.assign(s, d, z)[0][:2]]
        calls = {"cpu": lambda: validate(s, d, z), "raw": lambda: bound(s, d, z, stream),
                 "swapfn": lambda: fn(s, d, z, stream=stream)}
        parts = ("swapfn:check", "swapfn:route", "swapfn:launch")
        got: dict = {(c, k): [] for c in CONDITIONS for k in (*calls, *parts)}
        for _ in range(args.reps):
            s, d, z = draw()
            for c in CONDITIONS:  # every condition each rep, so drift spreads over all alike
                for k, call in calls.items():
                    # Once untimed first: a call inherits the wait before it (the previous
                    # condition's), so each timed call follows a wait of its own condition.
                    timed(call, c, stream, other, [])
                    marks.clear()
                    got[(c, k)].append(timed(call, c, stream, other, marks))
                    if k == "swapfn" and len(marks) == 4:  # start, checked, transfer in, transfer out
                        for part, (a, b) in zip(parts, zip(marks, marks[1:])):
                            got[(c, part)].append((b - a) / 1e3)
        for k in (*calls, *parts):
            med = {c: statistics.median(got[(c, k)]) for c in CONDITIONS}
            rows.append(dict(descriptors=n, call=k, **{c: round(v, 1) for c, v in med.items()}))
            print(f"n={n:6d} {k:7s} " + "  ".join(f"{c} {v:7.1f}" for c, v in med.items()) + "  (us, median)",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
