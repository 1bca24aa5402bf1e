"""Host cost of one SwapFn call: the resolved function against each forced candidate.

Not a test. Prints microseconds per call (median of several loops, perf_counter) for a
one-block transfer, where the host work is all there is to measure, and the ratio to the
forced route the resolved one takes. Usage: python tests/bench/bench_swapfn_overhead.py
"""
from __future__ import annotations

import statistics
import time

import torch

import kvswap


def per_call(fn, args, stream, loops=2000, rounds=7):
    for _ in range(200):
        fn(*args, stream=stream)
    stream.synchronize()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(loops):
            fn(*args, stream=stream)
        out.append((time.perf_counter() - t) / loops)
        stream.synchronize()
    return statistics.median(out) * 1e6


def main() -> None:
    stream = torch.cuda.Stream()
    block = 16384
    host = torch.empty(1 << 24, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 24, dtype=torch.uint8, device="cuda")
    for d in ("h2d", "d2h"):
        src, dst = (host, dev) if d == "h2d" else (dev, host)
        resolved = kvswap.resolve(d, block_bytes=block)
        print(f"{d}: routes {[r.impl for r in resolved.plan.routes]}, impls {resolved.impls}")
        for n in (1, 16, 256):
            s = torch.arange(n, dtype=torch.int64).numpy() * block * 2 + src.data_ptr()
            t = torch.arange(n, dtype=torch.int64).numpy() * block * 2 + dst.data_ptr()
            args = (s, t, torch.full((n,), block, dtype=torch.int64).numpy())
            row = {"resolved": per_call(resolved, args, stream)}
            for name in resolved.impls:
                forced = kvswap.resolve(d, block_bytes=block, policy=kvswap.Policy(force=name))
                row[name] = per_call(forced, args, stream)
            taken = resolved.assign(*args)[0][0]
            print(f"  n={n:<4} " + "  ".join(f"{k} {v:.1f} us" for k, v in row.items())
                  + f"  -> resolved takes {taken}: {row[taken] / row['resolved']:.3f} of its speed")


if __name__ == "__main__":
    main()
