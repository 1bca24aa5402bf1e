"""Why did the H100's size sweep time the kernel above the link? (Host to device, 1 GiB pool,
256 MiB a point as `kvswap calibrate` draws it: the kernel at 60-66 GB/s at one or two block
sizes, 128 KiB in session 6, 64 and 192 KiB in session 7, at every SM count from 2 to 132,
where the contiguous copy does 54-55 GB/s; never on the H200, never in a bench.)

Not a test; run on an H100 in session 8 (docs/results/session8/h100-d-over-ceiling.txt: nothing
above the ceiling, every byte right). For each block size,
one draw as the size sweep makes it, timed three ways: the sweep's own timer (events, the
median of 10 after 3 untimed calls), the wall clock over 10 calls after a synchronize, and
a contiguous copy of the same bytes beside them. Then every block of the draw (not a
sample) is poisoned and copied once more and checked byte for byte. Above the ceiling on
both clocks with every byte right says the link really moved it (a cache, or a faster path
than the copy engine's); on the events only says the timer; a wrong byte says the copy.

    python tests/bench/bench_over_ceiling.py
"""
from __future__ import annotations

import sys
import time

KiB, MiB = 1024, 1 << 20
BLOCKS = (48 * KiB, 64 * KiB, 96 * KiB, 128 * KiB, 192 * KiB, 256 * KiB)
SMS = (2, 4, 32)
SWEEP_BYTES, POOL_BYTES, REPEATS, WARMUP = 256 * MiB, 1 << 30, 10, 3


def main() -> int:
    import torch

    from bench_draws import contenders  # this folder: the same routes, bound the same way
    from kvswap.calibration.timing import median
    from kvswap.calibration.workload import Pools

    d = "h2d"
    dev, timer, by_direction = contenders(SMS)
    fns = by_direction[d]
    pools = Pools(dev, POOL_BYTES, 0)
    print(f"h2d GB/s, one draw of {SWEEP_BYTES >> 20} MiB a block size from a {POOL_BYTES >> 30} GiB pool: "
          "events (the sweep's timer) / wall clock; then every block checked", flush=True)
    for b in BLOCKS:
        batch = pools.batch(d, b, min(10000, SWEEP_BYTES // b, pools.slots(b)))
        calls = {"contiguous": pools.contiguous(d, batch.nbytes)}
        calls.update({name: (lambda f: lambda s: f(batch.src, batch.dst, batch.sizes, stream=s))(f)
                      for name, f in fns.items()})
        events = dict(zip(calls, timer.measure(list(calls.values()), REPEATS, WARMUP)))
        line = [f"{b // KiB:>4} KiB x {batch.n:<5}"]
        for name, call in calls.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(REPEATS):
                call(timer.stream)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / REPEATS
            line.append(f"{name} {batch.nbytes / median(events[name]) / 1e9:5.1f}/{batch.nbytes / wall / 1e9:5.1f}")
        for name, call in calls.items():
            if name == "contiguous":
                continue
            pools.poison(batch, k=batch.n)
            call(timer.stream)
            torch.cuda.synchronize()
            bad = pools.check(batch, k=batch.n)
            line.append(f"{name} {'ok' if bad is None else 'WRONG: ' + bad}")
        print("  " + "  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
