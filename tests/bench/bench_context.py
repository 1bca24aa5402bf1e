"""Why did calibration's batch-sweep calls time differently from the same calls in
``kvswap bench``? (On the H200, 32 KiB x 16 host->device: 36-37 us in calibration, 30-31 us
in the bench, and the order of the batch route and the kernel flipped.)

One process times host->device points, the batch route against the kernel at its knee:

1. history: each of the two timed right after a sequence of calls of itself and of the
   other (each call from an idle stream, as the timer runs them);
2. both harnesses, under the timer's old schedule (each call timed once per round) and
   its current one (a block per call: timing.SETTLE untimed calls, then timing.KEEP timed):
   the bench's (these two routes alone) and calibration's (Sweep.measure: the batch route
   against the kernel at five SM counts). A schedule is right when the two harnesses agree,
   and agree with part 1's routes timed after themselves: a route's time must not depend
   on which other routes are being compared;
3. the same point over fresh random draws of its blocks (does the choice of slots matter?);
4. both directions on pools of 1, 2 and 4 GiB (calibration's pools are 1 GiB, the bench's 2).

    python tests/bench/bench_context.py [knee]
"""
from __future__ import annotations

import sys

KiB, MiB = 1024, 1 << 20
POINTS = ((8 * KiB, 4), (32 * KiB, 4), (32 * KiB, 16), (128 * KiB, 4), (128 * KiB, 16), (16 * KiB, 64))
POOL_POINTS = (("d2h", 32 * KiB, 16), ("d2h", 64 * KiB, 16), ("d2h", 32 * KiB, 64), ("h2d", 32 * KiB, 16))
HISTORIES = ("SSSS", "OSSS", "OOSS", "OSS", "OS", "O", "OOOO")  # S: the timed route itself, O: the other


def main() -> int:
    import torch

    import kvswap
    from kvswap.calibration import timing
    from kvswap.calibration.bench import bound_at
    from kvswap.calibration.sweep import Sweep, settings_for
    from kvswap.calibration.timing import DeviceTimer, median
    from kvswap.calibration.workload import Pools
    from kvswap.platform import detect
    from kvswap.plugins import plugin_host

    knee = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    host = plugin_host()
    dev = detect(host, "cuda:0")
    d = "h2d"
    kernel = f"kernel@{knee}"
    fns = {"batch": kvswap.resolve(d, policy=kvswap.Policy(force="cuda.batch")),
           kernel: bound_at(d, dev, "cuda:0", host, "triton.kernel", knee)}
    settings = settings_for(dev)
    sweep = Sweep("cuda:0", settings, ["h2d"], host=host)
    pools = sweep.pools = Pools(dev, settings.pool_bytes, settings.seed)
    batches = {p: pools.batch(d, *p) for p in POINTS}

    def call(name: str, p: tuple[int, int]):
        f, b = fns[name], batches[p]
        return lambda s: f(b.src, b.dst, b.sizes, stream=s)

    stream = torch.cuda.Stream()
    print("1. host->device, us per call (median of 301), timed right after the calls of ... "
          "(S: itself, O: the other route; oldest first)", flush=True)
    print(f"{'point':<12}{'timed':<12}" + "".join(f"{h:>8}" for h in HISTORIES))
    with torch.cuda.stream(stream):
        for p in POINTS[:5]:
            for target, other in (("batch", kernel), (kernel, "batch")):
                row = []
                for h in HISTORIES:
                    before = [call(target if c == "S" else other, p) for c in h]
                    t, c = [], call(target, p)
                    for i in range(311):
                        for b in before:
                            stream.synchronize()
                            b(stream)
                        stream.synchronize()
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record(stream)
                        c(stream)
                        end.record(stream)
                        end.synchronize()
                        if i >= 10:
                            t.append(start.elapsed_time(end) * 1e3)
                    row.append(median(t))
                print(f"{f'{p[0] // KiB}K x{p[1]}':<12}{target:<12}" + "".join(f"{x:>8.1f}" for x in row), flush=True)

    rows: dict[str, dict[tuple[int, int], tuple[float, float]]] = {}
    tiers = {knee * f for f in (1, 2, 3, 4, 6)}
    bounds = [x for x in sweep.prepare()[kvswap.Direction.H2D]
              if x.impl == "cuda.batch" or (x.impl == "triton.kernel" and x.num_sms in tiers)]
    current = (timing.SETTLE, timing.KEEP)
    for name, (settle, keep) in (("old", (0, 1)), ("current", current)):
        timing.SETTLE, timing.KEEP = settle, keep
        sweep.timer = timer = DeviceTimer(dev)
        out = rows.setdefault(f"bench, {name}", {})
        for p in POINTS:
            t = timer.measure([call("batch", p), call(kernel, p)], 301, 2)
            out[p] = (median(t[0]), median(t[1]))
        out = rows.setdefault(f"sweep, {name}", {})
        for p in POINTS:
            ms = sweep.measure(bounds, batches[p], "batch", settings.batch_repeats, settings.batch_point_seconds,
                               settings.batch_max_repeats)
            by = {(m.impl, m.num_sms): m.seconds for m in ms}
            out[p] = (by[("cuda.batch", None)], by[("triton.kernel", knee)])
        print(f"done: {name} schedule (settle {settle}, keep {keep})", flush=True)
    timing.SETTLE, timing.KEEP = current

    print(f"\n2. host->device, us per call: batch route / {kernel} (batch/kernel); schedules: "
          f"old = each call timed once a round, current = {current[0]} untimed then {current[1]} timed")
    print(f"{'harness, schedule':<18}" + "".join(f"{f'{b // KiB}K x{n}':>22}" for b, n in POINTS))
    for name, got in rows.items():
        print(f"{name:<18}" + "".join(f"{g[0] * 1e6:>8.1f}/{g[1] * 1e6:<6.1f}({g[0] / g[1]:.2f})"
                                      for g in (got[p] for p in POINTS)))

    print(f"\n3. host->device: batch route / {kernel} time over fresh random draws of the same point "
          "(current schedule, 201 timed calls each)", flush=True)
    timer = DeviceTimer(dev)
    for p in POINTS[:5]:
        ratios = []
        for _ in range(8):
            batches[p] = pools.batch(d, *p)
            t = timer.measure([call("batch", p), call(kernel, p)], 201, 2)
            ratios.append(median(t[0]) / median(t[1]))
        print(f"{f'{p[0] // KiB}K x{p[1]}':<12}" + "".join(f"{r:>7.2f}" for r in ratios)
              + f"   min {min(ratios):.2f} max {max(ratios):.2f}", flush=True)

    print("\n4. batch route / kernel time by pool size (current schedule, 201 timed calls each)", flush=True)
    del sweep, pools, batches
    print(f"{'pool':<8}" + "".join(f"{f'{dd} {b // KiB}K x{n}':>22}" for dd, b, n in POOL_POINTS))
    for gib in (1, 2, 4, 1):
        pool = Pools(dev, gib << 30, gib)
        row = []
        for dd, b, n in POOL_POINTS:
            batch = pool.batch(dd, b, n)
            fb = (kvswap.resolve(dd, policy=kvswap.Policy(force="cuda.batch")),
                  bound_at(dd, dev, "cuda:0", host, "triton.kernel", knee))
            t = timer.measure([(lambda f: lambda s: f(batch.src, batch.dst, batch.sizes, stream=s))(f) for f in fb],
                              201, 2)
            row.append((median(t[0]), median(t[1])))
        print(f"{gib} GiB   " + "".join(f"{a * 1e6:>8.1f}/{k * 1e6:<6.1f}({a / k:.2f})" for a, k in row), flush=True)
        del pool
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
