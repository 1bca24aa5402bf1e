"""Does the size of the pools a batch's slots are drawn from change what a call costs, and
does it change the routes unevenly? (Session 10, H100: the same machine ran host->device
48 KiB x 16 about 20% slower in the bench, over 2 GiB pools, than in the calibration minutes
before, over 1 GiB pools; the batch route slowed more than the kernel, and 256 KiB x 4
flipped from the kernel 15% ahead to the batch route 14% ahead.)

One process. For each (host pool, device pool) size in turn, each point is drawn afresh
``DRAWS`` times (random distinct slots on both sides, as calibration draws them) and each
draw is timed on the batch route and the kernel at two SM counts, in the timer's schedule;
a route's time is the median over the draws of the median of its calls. The first pool
size comes again at the end: a difference between the first and last rows with the same
sizes is the machine drifting, not the pools.

    python tests/bench/bench_pool_size.py
"""
from __future__ import annotations

import statistics
import sys

KiB, MiB = 1024, 1024 * 1024
DRAWS = 3
REPEATS = 101
# (host pool, device pool) in MiB, in the order they are timed.
POOLS = ((1024, 1024), (2048, 2048), (256, 256), (8192, 8192), (2048, 1024), (1024, 2048), (1024, 1024))
POINTS = (("h2d", 8 * KiB, 1), ("h2d", 8 * KiB, 16), ("h2d", 32 * KiB, 16), ("h2d", 48 * KiB, 16),
          ("h2d", 128 * KiB, 4), ("h2d", 256 * KiB, 4), ("h2d", 16 * KiB, 256), ("d2h", 16 * KiB, 16),
          ("d2h", 256 * KiB, 4))
SMS = (6, 32)


def main() -> int:
    import numpy as np
    import torch

    from bench_draws import contenders  # this folder: the same routes, bound the same way
    from kvswap.calibration.timing import median

    _, timer, fns = contenders(SMS)
    rng = np.random.default_rng(0)
    names = list(fns["h2d"])
    print(f"us per call: median over {DRAWS} random draws of the median of {REPEATS} calls; "
          f"b/k: the batch route's time over the faster kernel's (over 1: the kernel wins)", flush=True)
    print(f"{'point':<16}{'host/dev MiB':>13}" + "".join(f"{n:>11}" for n in names) + f"{'b/k':>7}", flush=True)
    results: dict[tuple, dict[int, float]] = {}
    for i, (host_mib, dev_mib) in enumerate(POOLS):
        hbuf = torch.empty(host_mib * MiB, dtype=torch.uint8, pin_memory=True)
        dbuf = torch.empty(dev_mib * MiB, dtype=torch.uint8, device="cuda:0")
        hbuf.copy_(torch.randint(0, 256, (host_mib * MiB,), dtype=torch.uint8, device="cuda:0"))
        dbuf.random_(0, 256)
        torch.cuda.synchronize()
        ha, da = hbuf.data_ptr(), dbuf.data_ptr()
        for d, b, n in POINTS:
            row: dict[str, list[float]] = {name: [] for name in names}
            for _ in range(DRAWS):
                hoff = rng.choice(host_mib * MiB // b, n, replace=False).astype(np.int64) * b
                doff = rng.choice(dev_mib * MiB // b, n, replace=False).astype(np.int64) * b
                src, dst = (ha + hoff, da + doff) if d == "h2d" else (da + doff, ha + hoff)
                sizes = np.full(n, b, dtype=np.int64)
                calls = [(lambda f: lambda s: f(src, dst, sizes, stream=s))(f) for f in fns[d].values()]
                for name, t in zip(names, timer.measure(calls, REPEATS, 3)):
                    row[name].append(median(t) * 1e6)
            us = {name: statistics.median(v) for name, v in row.items()}
            bk = us["batch"] / min(v for k, v in us.items() if k != "batch")
            results.setdefault((d, b, n), {})[i] = bk
            print(f"{f'{d} {b // KiB}K x{n}':<16}{f'{host_mib}/{dev_mib}':>13}"
                  + "".join(f"{us[name]:>11.1f}" for name in names) + f"{bk:>7.3f}", flush=True)
        del hbuf, dbuf
        torch.cuda.empty_cache()
    print("\nb/k by pool sizes (host/dev MiB)")
    print(f"{'point':<16}" + "".join(f"{f'{h}/{v}':>11}" for h, v in POOLS))
    for (d, b, n), by in results.items():
        print(f"{f'{d} {b // KiB}K x{n}':<16}" + "".join(f"{by[i]:>11.3f}" for i in range(len(POOLS))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
