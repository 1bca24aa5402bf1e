"""Does the choice of slots a batch copies change what it costs? (On the H100, host->device
48 KiB x 16 took 35.7 us on the batch route in calibration and 48.1 us in the bench run
minutes later, the kernel 36.7 and 48.0 us on 4 SMs; 32 KiB x 16 timed the same in both.)

One process, one pool: each point is drawn afresh ``DRAWS`` times (new random slots on both
sides), and each draw is timed on the batch route and the kernel at two SM counts, in the
timer's schedule. Then a second pool of the same size is allocated and the same is done: a
spread between draws says the slots matter (where the pages lie); a spread between pools
but not between draws says the allocation does.

    python tests/bench/bench_draws.py
"""
from __future__ import annotations

import sys
from typing import Any

KiB = 1024
DRAWS = 6
POINTS = (("h2d", 48 * KiB, 16), ("h2d", 128 * KiB, 16), ("h2d", 32 * KiB, 16), ("d2h", 16 * KiB, 16),
          ("d2h", 64 * KiB, 16))
SMS = (4, 16)


def contenders(sms: tuple[int, ...]) -> tuple[Any, Any, dict[str, dict[str, Any]]]:
    """``(device, timer, fns)`` on cuda:0: per direction, the batch route and the kernel
    bound at each of ``sms`` SMs, by label (also used by bench_pool_size.py and
    bench_over_ceiling.py)."""
    import kvswap
    from kvswap.calibration.bench import bound_at
    from kvswap.calibration.timing import DeviceTimer
    from kvswap.platform import detect
    from kvswap.plugins import plugin_host

    host = plugin_host()
    dev = detect(host, "cuda:0")
    fns = {d: {"batch": kvswap.resolve(d, policy=kvswap.Policy(force="cuda.batch")),
               **{f"kernel@{k}": bound_at(d, dev, "cuda:0", host, "triton.kernel", k) for k in sms}}
           for d in ("h2d", "d2h")}
    return dev, DeviceTimer(dev), fns


def main() -> int:
    import torch

    from kvswap.calibration.timing import median
    from kvswap.calibration.workload import Pools

    dev, timer, fns = contenders(SMS)
    print(f"us per call (median of 201) over {DRAWS} random draws of each point, in two pools of 1 GiB", flush=True)
    for seed in (1, 2):
        pools = Pools(dev, 1 << 30, seed)
        print(f"pool {seed}")
        for p in POINTS:
            rows: dict[str, list[float]] = {name: [] for name in fns[p[0]]}
            for _ in range(DRAWS):
                b = pools.batch(*p)
                calls = [(lambda f: lambda s: f(b.src, b.dst, b.sizes, stream=s))(f) for f in fns[p[0]].values()]
                for name, t in zip(fns[p[0]], timer.measure(calls, 201, 3)):
                    rows[name].append(median(t) * 1e6)
            for name, row in rows.items():
                print(f"  {f'{p[0]} {p[1] // KiB}K x{p[2]}':<16}{name:<11}" + "".join(f"{x:>7.1f}" for x in row)
                      + f"  max/min {max(row) / min(row):.3f}", flush=True)
        del pools
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
