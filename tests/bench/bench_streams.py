"""Does the stream a copy runs on change what it costs? (The device->host batch route at
16-64 KiB x 16 timed up to 10% apart between calibration and the bench, on the same
machine, with the kernel unchanged; within one process pools of 1-4 GiB gave the same
times: tests/bench/bench_context.py.)

Each stream of the process is served by one of the GPU's copy-engine channels; which one
depends on how many streams the process made before it. This times the batch route and the
kernel at its knee, on each of ``STREAMS`` fresh streams in turn, in the timer's schedule, and
prints the time per call for each stream. Run it twice to see whether a process repeats its
own times (stream order) or not (something else).

    python tests/bench/bench_streams.py [knee]
"""
from __future__ import annotations

import sys

KiB = 1024
STREAMS = 8
POINTS = (("d2h", 4 * KiB, 16), ("d2h", 16 * KiB, 16), ("d2h", 32 * KiB, 16), ("d2h", 64 * KiB, 16),
          ("h2d", 16 * KiB, 16), ("h2d", 64 * KiB, 16))


def main() -> int:
    import kvswap
    from kvswap.calibration.bench import bound_at
    from kvswap.calibration.timing import DeviceTimer, median
    from kvswap.calibration.workload import Pools
    from kvswap.platform import detect
    from kvswap.plugins import plugin_host

    knee = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    host = plugin_host()
    dev = detect(host, "cuda:0")
    pools = Pools(dev, 1 << 30, 0)
    fns = {d: {"batch": kvswap.resolve(d, policy=kvswap.Policy(force="cuda.batch")),
               f"kernel@{knee}": bound_at(d, dev, "cuda:0", host, "triton.kernel", knee)} for d in ("h2d", "d2h")}
    batches = {p: pools.batch(*p) for p in POINTS}
    timers = [DeviceTimer(dev) for _ in range(STREAMS)]
    print(f"us per call (median of 201) on each of {STREAMS} fresh streams; batch route / kernel@{knee}", flush=True)
    print(f"{'point':<16}{'route':<11}" + "".join(f"{f's{i}':>7}" for i in range(STREAMS)) + "  max/min")
    for p in POINTS:
        d, b = p[0], batches[p]
        calls = [(lambda f: lambda s: f(b.src, b.dst, b.sizes, stream=s))(f) for f in fns[d].values()]
        times = [[median(t) * 1e6 for t in timer.measure(calls, 201, 3)] for timer in timers]
        for j, name in enumerate(fns[d]):
            row = [t[j] for t in times]
            print(f"{f'{d} {p[1] // KiB}K x{p[2]}':<16}{name:<11}" + "".join(f"{x:>7.1f}" for x in row)
                  + f"  {max(row) / min(row):7.3f}", flush=True)
        print(f"{'':<16}{'ratio':<11}" + "".join(f"{t[0] / t[1]:>7.2f}" for t in times), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
