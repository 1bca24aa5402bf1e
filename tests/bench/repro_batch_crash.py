"""Reproduce a segmentation fault inside ``cuMemcpyBatchAsync`` (GPU; not a test).

Host->device batches of random descriptors (``--sizes mixed``: 1-4,096 bytes at odd
addresses; ``uniform``: 4 KiB blocks at 4 KiB-aligned addresses), from one pinned pool of
random bytes (``--zero-source``: of zeros) to one device pool, are copied again and again,
each run in a child process so that a crash is reported instead of ending this script:

* ``resolve``: through ``kvswap.resolve("h2d", policy=Policy(force="cuda.batch"))``;
* ``bound``: the same arrays through a ``cuda.batch`` callable bound directly
  (``kvswap.backends.cuda.batch.bind``), in a process where ``resolve`` also ran.

Each line says how many calls completed and how the child ended (exit code 0, or the
signal). The bytes of the last call are checked when the child survives.

    python3 tests/bench/repro_batch_crash.py --calls 12
    python3 tests/bench/repro_batch_crash.py --sizes uniform --descriptors 50000
    python3 tests/bench/repro_batch_crash.py --zero-source
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CHILD = r"""
import faulthandler, os, sys
faulthandler.enable()
import numpy as np, torch
import kvswap
from kvswap import Direction, Policy
from kvswap.backends.cuda import batch, driver

mode, calls, n, uniform, zero = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.argv[5] == "1"
torch.cuda.init()
swap = kvswap.resolve("h2d", device="cuda:0", policy=Policy(force="cuda.batch"))
bound = batch.bind(driver.get(), Direction.H2D, 0)
rng = np.random.default_rng(1)
if uniform:
    sizes, gaps = np.full(n, 4096, np.int64), 4096 * rng.integers(0, 2, n)
else:
    sizes, gaps = rng.integers(1, 4097, n).astype(np.int64), rng.integers(1, 4097, n)

def layout(seed):
    order = np.random.default_rng(seed).permutation(n)
    ends = np.cumsum(sizes[order] + gaps[order])
    off = np.empty(n, np.int64)
    off[order] = ends - sizes[order]
    return off, int(ends[-1]) + 8192

so, sb = layout(2)
do, db = layout(3)
host = torch.empty(sb, dtype=torch.uint8, pin_memory=True)
host.numpy()[:] = 0 if zero else rng.integers(0, 256, sb, dtype=np.uint8)
dev = torch.zeros(db, dtype=torch.uint8, device="cuda")
src, dst = so + host.data_ptr(), do + dev.data_ptr()
for i in range(calls):
    s = torch.cuda.Stream()
    if mode == "bound":
        bound(src, dst, sizes, s)
    else:
        swap(src, dst, sizes, stream=s)
    s.synchronize()
    print("call", i + 1, flush=True)
got, want = dev.cpu().numpy(), host.numpy()
bad = sum(int((got[d:d + k] != want[o:o + k]).any()) for o, d, k in zip(so[:2000], do[:2000], sizes[:2000]))
print("checked", "ok" if bad == 0 else f"{bad} wrong blocks", flush=True)
"""


def run(mode: str, calls: int, n: int, timeout: float, uniform: bool, zero: bool) -> str:
    env = dict(os.environ)
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, "-c", CHILD, "bound" if mode == "bound" else "resolve", str(calls), str(n),
                            str(int(uniform)), str(int(zero))],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"{mode:15s} timed out after {timeout:.0f} s"
    done = sum(line.startswith("call ") for line in p.stdout.splitlines())
    how = "exit 0" if p.returncode == 0 else (f"signal {-p.returncode}" if p.returncode < 0 else f"exit {p.returncode}")
    check = next((line for line in p.stdout.splitlines() if line.startswith("checked")), "")
    return f"{mode:15s} {done}/{calls} calls, {how} ({time.time() - t0:.0f} s) {check}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--descriptors", type=int, default=200_000)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--modes", default="resolve,bound")
    ap.add_argument("--sizes", choices=("mixed", "uniform"), default="mixed")
    ap.add_argument("--zero-source", action="store_true", help="a source pool of zeros instead of random bytes")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        print(run(mode, args.calls, args.descriptors, args.timeout, args.sizes == "uniform", args.zero_source),
              flush=True)


if __name__ == "__main__":
    main()
