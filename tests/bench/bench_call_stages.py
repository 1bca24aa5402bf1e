"""The host work of one SwapFn call by stage, on this machine's CPU (no GPU needed): whole
batch validation, the look for contiguous runs, and packing the descriptors as the kernel
route does, each timed warm (back to back) on random scattered blocks of one size.

``python3 tests/bench/bench_call_stages.py --counts 64,1024,10000``
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kvswap.addressing.descriptors import validate
from kvswap.backends.triton_generic.launch import batch_alignment


def timed(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", default="64,1024,10000")
    p.add_argument("--block", type=int, default=4096)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    print(f"numpy {np.__version__}; warm microseconds per call, median-free mean of {args.reps}")
    print("| n | validate | sort dst | runs look | pack | alignment | sum |")
    print("|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.counts.split(",")):
        b = args.block
        s = (1 << 40) + rng.permutation(2 * n)[:n].astype(np.int64) * b
        d = (1 << 41) + rng.permutation(2 * n)[:n].astype(np.int64) * b
        z = np.full(n, b, dtype=np.int64)
        packed = np.empty(3 * n, dtype=np.int64)

        def look():
            follows = s[:-1] + z[:-1] == s[1:]
            return np.count_nonzero(follows)

        def pack():
            packed[:n] = s
            packed[n:2 * n] = d
            packed[2 * n:] = z

        row = [timed(lambda: validate(s, d, z), args.reps), timed(lambda: np.sort(d), args.reps),
               timed(look, args.reps), timed(pack, args.reps), timed(lambda: batch_alignment(packed), args.reps),
               timed(lambda: int(z.sum()), args.reps)]
        print(f"| {n} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
