"""Is "resolved" slower than a candidate taking the same route? Copies of one route, timed
side by side: at each point, two SwapFns forced to the route's impl and SM count, and two
SwapFns resolve() returns, interleaved from an idle stream as ``kvswap bench`` times them.
Ratios against the first forced copy; the spread between the two forced copies is the
noise a bench ratio of one route against itself shows.

    KVSWAP_PROFILE=profile.json python tests/bench/bench_same_route.py
"""
from __future__ import annotations

import sys

KiB = 1024
POINTS = (("h2d", 1 * KiB, 1), ("h2d", 4 * KiB, 4), ("h2d", 1 * KiB, 64), ("h2d", 8 * KiB, 64),
          ("h2d", 4 * KiB, 256), ("d2h", 1 * KiB, 1024), ("d2h", 4 * KiB, 256), ("d2h", 8 * KiB, 256))


def main() -> int:
    import kvswap
    from kvswap.calibration.bench import bound_at, label
    from kvswap.calibration.timing import make_timer, median
    from kvswap.calibration.workload import Pools
    from kvswap.platform import detect
    from kvswap.plugins import plugin_host

    host = plugin_host()
    dev = detect(host, "cuda:0")
    timer, pools = make_timer(dev), Pools(dev, 256 << 20, 0)
    print(f"{'point':<22} {'route':<18} forced2/forced1  resolved1/forced1  resolved2/forced1")
    for d, b, n in POINTS:
        batch = pools.batch(d, b, n)
        r1, r2 = (kvswap.resolve(d, block_bytes=b) for _ in range(2))
        ((impl, sms, _),) = r1.assign(batch.src, batch.dst, batch.sizes)
        f1, f2 = (bound_at(d, dev, "cuda:0", host, impl, sms) if sms
                  else kvswap.resolve(d, policy=kvswap.Policy(force=impl)) for _ in range(2))
        calls = [(lambda f: lambda stream: f(batch.src, batch.dst, batch.sizes, stream=stream))(f)
                 for f in (f1, f2, r1, r2)]
        t = [median(x) for x in timer.measure(calls, 401, 3)]
        print(f"{d} {b // KiB} KiB x {n:<6} {label(impl, sms):<18} "
              + "  ".join(f"{t[0] / x:>15.3f}" for x in t[1:]) + f"   ({t[0] * 1e6:.1f} us)", flush=True)
        # As kvswap bench did when the peer was the candidate object itself: f1 twice a round.
        t = [median(x) for x in timer.measure(calls + [calls[0]], 401, 3)]
        print(f"{'  f1 called twice':<41} " + "  ".join(f"{t[0] / x:>15.3f}" for x in t[1:4])
              + f"   (second f1 call {t[0] / t[4]:.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
