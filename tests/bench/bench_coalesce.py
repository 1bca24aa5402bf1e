"""What merging contiguous runs buys: a SwapFn with ``Policy(coalesce=True)`` against one with
``coalesce=False``, on the same batches of runs of blocks contiguous on both sides.

Not a test. For each route (the resolved one and each usable implementation forced), block
size and run length, the median GB/s of each setting over interleaved rounds (CUDA events
on one stream) and their ratio; a run length of 1 (nothing to merge) shows what looking
for runs costs. Writes JSON to ``$OUT/bench_coalesce.json`` when ``OUT`` is set.

    python tests/bench/bench_coalesce.py [--device cuda:0] [--blocks 4096,16384,65536] [--runs 1,4,16]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import numpy as np
import torch

import kvswap

TOTAL = 64 << 20  # bytes per batch


def batch(rng: np.random.Generator, block: int, run: int, src_base: int, dst_base: int) -> tuple:
    """``TOTAL`` bytes as runs of ``run`` blocks, the runs scattered in random order."""
    runs = TOTAL // (block * run)
    slot = block * run + 4096  # a gap between runs: nothing merges across them
    s_slots = rng.permutation(2 * runs)[:runs] * slot
    d_slots = rng.permutation(2 * runs)[:runs] * slot
    inner = np.arange(run) * block
    src = (src_base + s_slots[:, None] + inner).reshape(-1).astype(np.int64)
    dst = (dst_base + d_slots[:, None] + inner).reshape(-1).astype(np.int64)
    return src, dst, np.full(len(src), block, dtype=np.int64), 2 * runs * slot


def timed(fn, args, stream, rounds: int = 7) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn(*args, stream=stream)  # warm-up (Triton compiles on first use)
    out = []
    for _ in range(rounds):
        start.record(stream)
        fn(*args, stream=stream)
        end.record(stream)
        end.synchronize()
        out.append(TOTAL / (start.elapsed_time(end) / 1e3) / 1e9)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--blocks", default="4096,16384,65536")  # 4096 at least (see span)
    p.add_argument("--runs", default="1,4,16")
    p.add_argument("--directions", default="h2d,d2h")
    a = p.parse_args()
    dev = torch.device(a.device)
    stream = torch.cuda.Stream(dev)
    rng = np.random.default_rng(0)
    rows = []
    span = 4 * TOTAL  # the most a batch spans: runs of at least 4 KiB, each in a slot of twice its size or less
    host = torch.empty(span, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(span, dtype=torch.uint8, device=dev)
    print(f"{'direction':<10}{'route':<16}{'block':>8}{'run':>5}{'merged GB/s':>13}{'as is GB/s':>12}{'ratio':>8}")
    for d in a.directions.split(","):
        src, dst = (host, gpu) if d == "h2d" else (gpu, host)
        fn = kvswap.resolve(d, device=a.device)
        names = ["resolved"] + [c.name for c in fn.plan.candidates if c.available]
        for name in names:
            force = None if name == "resolved" else name
            on = kvswap.resolve(d, device=a.device, policy=kvswap.Policy(force=force, coalesce=True))
            off = kvswap.resolve(d, device=a.device, policy=kvswap.Policy(force=force, coalesce=False))
            for block in map(int, a.blocks.split(",")):
                for run in map(int, a.runs.split(",")):
                    s, t, n, _ = batch(rng, block, run, src.data_ptr(), dst.data_ptr())
                    merged, plain = [], []
                    for _ in range(3):  # interleaved: drift hits both alike
                        merged += timed(on, (s, t, n), stream)
                        plain += timed(off, (s, t, n), stream)
                    m, q = statistics.median(merged), statistics.median(plain)
                    rows.append({"direction": d, "route": name, "block": block, "run": run,
                                 "merged_gbps": round(m, 2), "as_is_gbps": round(q, 2), "ratio": round(m / q, 3)})
                    print(f"{d:<10}{name:<16}{block:>8}{run:>5}{m:>13.1f}{q:>12.1f}{m / q:>8.2f}", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bench_coalesce.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
