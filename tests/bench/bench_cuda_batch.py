"""Benchmark ``cuda.batch`` on one GPU against the link's contiguous ceiling.

One process measures, per direction: a contiguous pinned copy of 512 MiB (the ceiling),
then N scattered blocks (distinct random slots in a pool on each side, ~1 GiB of reach, more
only where N blocks do not fit) copied by ``cuda.batch`` — one ``cuMemcpyBatchAsync`` per
call on a side stream — for blocks of 4-256 KiB at N = 1000 and 10000; and, for scale, the
per-copy ``cuMemcpyAsync`` path at 16 KiB, N = 2000. It prints GB/s, the fraction of the
ceiling, the host time to enqueue per descriptor, and an H200 reference value where one
exists; with ``$OUT`` set it also writes ``cuda_batch.json`` and ``cuda_batch.md`` there.

Timing: after a correctness check (sampled destination blocks poisoned, then compared)
and two warm-up calls, each call is bracketed by CUDA events on the copy stream; the
median of ``--reps`` counts.

    python tests/bench/bench_cuda_batch.py [--reps 10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

KiB, MiB, GiB = 1024, 1 << 20, 1 << 30
BLOCKS = (4, 8, 16, 32, 64, 128, 256)  # KiB
COUNTS = (1000, 10_000)
REACH = 1 * GiB
CEILING_BYTES = 512 * MiB
# NVIDIA H200 PCIe Gen5 x16, driver 580 / CUDA 13.0, N scattered blocks: batch DMA GB/s at
# (dir, KiB, N); h2d is the ANY column (what cuda.batch uses), d2h the STREAM column.
H200_REFERENCE = {
    ("h2d", 4, 10_000): 4.1, ("h2d", 8, 10_000): 5.4, ("h2d", 16, 10_000): 6.6,
    ("h2d", 32, 10_000): 36.3, ("h2d", 64, 10_000): 44.5, ("h2d", 128, 1000): 48.8,
    ("d2h", 4, 10_000): 9.6, ("d2h", 8, 10_000): 17.5, ("d2h", 16, 10_000): 23.5,
    ("d2h", 32, 10_000): 34.5, ("d2h", 64, 10_000): 42.5,
}
H200_PER_COPY_16K = 5.3  # per-block cuMemcpyAsync loop, 16 KiB, N=2000


class Bench:
    def __init__(self, reps: int) -> None:
        import torch

        from kvswap.backends.cuda import batch, device, driver

        self.torch, self.reps = torch, reps
        self.info = device.describe("cuda:0")
        self.driver = driver.get()
        self.batch = batch
        self.pool = max(REACH, max(BLOCKS) * KiB * max(COUNTS) * 5 // 4)
        self.stream = torch.cuda.Stream()
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.dpool = torch.randint(0, 256, (self.pool,), dtype=torch.uint8, device="cuda", generator=gen)
        self.hpool = torch.empty(self.pool, dtype=torch.uint8, pin_memory=True)
        self.hpool.copy_(torch.randint(0, 256, (self.pool,), dtype=torch.uint8, device="cuda", generator=gen))
        torch.cuda.synchronize()
        self.rng = np.random.default_rng(0)

    def sides(self, d: str) -> tuple[Any, Any]:
        return (self.hpool, self.dpool) if d == "h2d" else (self.dpool, self.hpool)

    def time(self, call: Callable[[], None], nbytes: int, count: int) -> tuple[float, float]:
        """``(GB/s, host µs per descriptor to enqueue)``, medians over ``reps`` calls."""
        torch, s = self.torch, self.stream
        for _ in range(2):
            call()
        s.synchronize()
        pairs, enqueue = [], []
        for _ in range(self.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # From an idle stream: the host work of the call counts, as it does for an
            # engine's one transfer per step (back to back, earlier copies hide it).
            s.synchronize()
            a.record(s)
            t0 = time.perf_counter()
            call()
            enqueue.append(time.perf_counter() - t0)
            b.record(s)
            pairs.append((a, b))
        s.synchronize()
        sec = statistics.median(a.elapsed_time(b) for a, b in pairs) / 1e3
        return nbytes / sec / 1e9, statistics.median(enqueue) / max(count, 1) * 1e6

    def ceiling(self, d: str) -> float:
        src, dst = self.sides(d)
        s, t = src[:CEILING_BYTES], dst[:CEILING_BYTES]

        def run() -> None:
            with self.torch.cuda.stream(self.stream):
                t.copy_(s, non_blocking=True)

        return self.time(run, CEILING_BYTES, 1)[0]

    def layout(self, d: str, block: int, n: int) -> tuple[np.ndarray, ...]:
        reach = max(REACH, n * block * 5 // 4)
        assert reach <= self.pool, f"{n} blocks of {block} B need a pool of {reach} B"
        slots = reach // block
        so = self.rng.choice(slots, n, replace=False).astype(np.int64) * block
        do = self.rng.choice(slots, n, replace=False).astype(np.int64) * block
        src, dst = self.sides(d)
        return so, do, src.data_ptr() + so, dst.data_ptr() + do, np.full(n, block, dtype=np.int64), reach

    def check(self, d: str, so: np.ndarray, do: np.ndarray, block: int, run: Callable[[], None]) -> Optional[str]:
        torch = self.torch
        src, dst = self.sides(d)
        pick = np.unique(np.linspace(0, len(so) - 1, 16).astype(np.int64)).tolist()
        for i in pick:
            dst[int(do[i]):int(do[i]) + block].copy_(~src[int(so[i]):int(so[i]) + block])
        torch.cuda.synchronize()
        run()
        self.stream.synchronize()
        for i in pick:
            if not torch.equal(dst[int(do[i]):int(do[i]) + block].cpu(), src[int(so[i]):int(so[i]) + block].cpu()):
                return f"block {i} wrong after the copy"
        return None

    def measure(self, fn: Any, d: str, block: int, n: int) -> dict[str, Any]:
        so, do, src, dst, sizes, reach = self.layout(d, block, n)
        row: dict[str, Any] = {"dir": d, "block": block, "n": n, "reach": reach}

        def run() -> None:
            fn(src, dst, sizes, self.stream)

        try:
            row["error"] = self.check(d, so, do, block, run)
            if not row["error"]:
                row["gbps"], row["enqueue_us"] = self.time(run, int(sizes.sum()), n)
                row["path"] = fn.last_path
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
        return row


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    import torch

    from kvswap import Direction

    started = time.time()
    bench = Bench(args.reps)
    info, drv = bench.info, bench.driver
    out: dict[str, Any] = {"device": info.to_dict(), "torch": torch.__version__, "reps": args.reps,
                           "ceiling": {}, "rows": [], "per_copy": []}
    lines = [
        f"# cuda.batch on {info.name} ({info.link}, driver {info.driver_version}, torch {torch.__version__})",
        "",
        f"identity {info.identity}; median of {args.reps}, CUDA events; scattered blocks, distinct slots",
    ]
    ceil = {d: bench.ceiling(d) for d in ("h2d", "d2h")}
    out["ceiling"] = ceil
    lines.append("Contiguous pinned ceiling (512 MiB): " + ", ".join(f"{d} {g:.1f} GB/s" for d, g in ceil.items()))
    lines += ["", "| dir | block | N | cuda.batch GB/s | fraction of ceiling | enqueue µs/desc | H200 reference |",
              "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    notes = []
    for d in ("h2d", "d2h"):
        fn = bench.batch.bind(drv, Direction.parse(d), 0)
        notes.append(f"{d}: {fn.note}")
        for block in BLOCKS:
            for n in COUNTS:
                row = bench.measure(fn, d, block * KiB, n)
                out["rows"].append(row)
                ref = H200_REFERENCE.get((d, block, n))
                if row.get("error"):
                    cells = ["ERR", "", ""]
                    notes.append(f"{d} {block} KiB N={n}: {row['error']}")
                else:
                    cells = [f"{row['gbps']:.1f}", f"{row['gbps'] / ceil[d]:.2f}", f"{row['enqueue_us']:.2f}"]
                    if row["path"] != "batch":
                        notes.append(f"{d} {block} KiB N={n}: took the {row['path']} path")
                lines.append(f"| {d} | {block} KiB | {n} | " + " | ".join(cells) + f" | {ref if ref else ''} |")
                print(lines[-1], flush=True)
    per_copy_lines = ["", "Per-copy path (one cuMemcpyAsync per block), 16 KiB, N=2000:"]
    for d in ("h2d", "d2h"):
        fn = bench.batch.BatchCopy(Direction.parse(d), 0, abi=None, batch_fn=None, memcpy_fn=drv.memcpy_async(),
                                   error=drv.error, context=drv.context_guard(0), why="measured for comparison")
        row = bench.measure(fn, d, 16 * KiB, 2000)
        out["per_copy"].append(row)
        per_copy_lines.append(
            f"  {d}: " + (f"ERR {row['error']}" if row.get("error") else
                          f"{row['gbps']:.1f} GB/s ({row['gbps'] / ceil[d]:.2f} of ceiling), "
                          f"{row['enqueue_us']:.2f} µs/desc to enqueue")
            + f" (H200 reference: {H200_PER_COPY_16K} GB/s)")
    lines += per_copy_lines
    print("\n".join(per_copy_lines), flush=True)
    lines += ["", "Notes:"] + [f"- {n}" for n in notes] + [f"- wall time {time.time() - started:.0f} s"]
    print("\n".join(lines[-len(notes) - 2:]), flush=True)
    out["notes"] = notes
    where = os.environ.get("OUT")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / "cuda_batch.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
        (Path(where) / "cuda_batch.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
