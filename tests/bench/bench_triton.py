"""Benchmark ``triton.kernel`` on one GPU against the link's contiguous ceiling.

One run measures, per direction: a contiguous pinned copy (the ceiling), then N scattered
blocks (random distinct slots in a pool on each side) copied by ``triton.kernel`` at
several SM budgets and by ``cuda.batch`` where that backend is available. It prints a
table of GB/s and fraction of the ceiling and writes it (markdown and JSON) under ``$OUT``
when that is set. ``--sweep`` first compares launch shapes (tile, warps, vector width,
prefetch) and measures the table with the best one per direction.

Timing: calls are enqueued back to back on one stream with an event pair around each,
after warm-up calls (the kernel compiles on its first launch); the median interval counts.
Every measured route's result is checked on sampled blocks (poisoned first).

    python tests/bench/bench_triton.py [--n 10000] [--reps 10] [--sweep]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional

import numpy as np

KiB, MiB = 1024, 1 << 20
BLOCKS = (4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB)
BUDGETS = (2, 4, 8, 12)
POOL = 1536 * MiB  # 10 000 slots of 128 KiB fit; ~1 GiB of scattered reach at small blocks
CEILING_BYTES = 512 * MiB
# Launch shapes the sweep compares: (tile_elems, row_max, warps, align_max, prefetch,
# load cache modifier). All compile without register spills on sm_90 (ptxas -v) except
# where noted.
SWEEP = (
    (4096, 1024, 8, 16, False, ""), (4096, 1024, 8, 16, True, ""), (4096, 1024, 8, 8, True, ""),
    (4096, 1024, 8, 8, False, ""), (8192, 1024, 16, 16, False, ""), (8192, 1024, 8, 16, False, ""),
    (8192, 1024, 32, 16, False, ""), (8192, 2048, 16, 16, False, ""),
    (8192, 1024, 16, 8, False, ""),  # spills a little at 4 KiB
    (4096, 1024, 8, 16, False, ".cg"), (8192, 1024, 16, 16, False, ".cg"),
    (4096, 1024, 8, 1, False, ""),  # the any-alignment path on aligned data: its cost
)
SHAPE_KEYS = ("tile_elems", "row_max", "warps", "align_max", "prefetch", "cache")
# Where the sweep measures: (block bytes, SMs). The winner per direction has the best
# mean fraction of the ceiling over the points with >= 4 SMs (the bar's budgets).
SWEEP_POINTS = ((4 * KiB, 2), (4 * KiB, 4), (8 * KiB, 4), (16 * KiB, 4), (128 * KiB, 4),
                (4 * KiB, 8), (32 * KiB, 8), (128 * KiB, 8))


class Bench:
    def __init__(self, n: int, reps: int) -> None:
        import torch

        from kvswap.registry.platform import detect
        from kvswap.registry.plugins import plugin_host

        self.torch = torch
        self.n, self.reps = n, reps
        self.info = detect(plugin_host(), "cuda:0")
        self.dev = "cuda:0"
        self.stream = torch.cuda.Stream(device=self.dev)
        gen = torch.Generator(device=self.dev).manual_seed(0)
        self.dpool = torch.randint(0, 256, (POOL,), dtype=torch.uint8, device=self.dev, generator=gen)
        self.hpool = torch.empty(POOL, dtype=torch.uint8, pin_memory=True)
        self.hpool.copy_(torch.randint(0, 256, (POOL,), dtype=torch.uint8, device=self.dev, generator=gen))
        torch.cuda.synchronize()
        self.rng = np.random.default_rng(0)

    def sides(self, d: str) -> tuple[Any, Any]:
        return (self.hpool, self.dpool) if d == "h2d" else (self.dpool, self.hpool)

    def gbps(self, call: Callable[[], None], nbytes: int, warmup: int = 2) -> float:
        torch, s = self.torch, self.stream
        with torch.cuda.stream(s):
            for _ in range(warmup):
                call()
            s.synchronize()
            pairs = []
            for _ in range(self.reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                # From an idle stream: the host work of the call counts, as it does for an
                # engine's one transfer per step (back to back, earlier copies hide it).
                s.synchronize()
                a.record(s)
                call()
                b.record(s)
                pairs.append((a, b))
            s.synchronize()
        sec = statistics.median(a.elapsed_time(b) for a, b in pairs) / 1e3
        return nbytes / sec / 1e9

    def ceiling(self, d: str) -> float:
        src, dst = self.sides(d)
        s, t = src[:CEILING_BYTES], dst[:CEILING_BYTES]
        return self.gbps(lambda: t.copy_(s, non_blocking=True), CEILING_BYTES)

    def batch(self, d: str, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        slots = POOL // block
        so = self.rng.choice(slots, self.n, replace=False).astype(np.int64) * block
        do = self.rng.choice(slots, self.n, replace=False).astype(np.int64) * block
        src, dst = self.sides(d)
        return so, do, src.data_ptr() + so, dst.data_ptr() + do, np.full(self.n, block, dtype=np.int64)

    def check(self, d: str, so: np.ndarray, do: np.ndarray, block: int, run: Callable[[], None]) -> Optional[str]:
        """Poison sampled destination blocks, run once, compare them with their sources."""
        torch = self.torch
        src, dst = self.sides(d)
        pick = np.unique(np.linspace(0, len(so) - 1, 16).astype(np.int64)).tolist()
        for i in pick:
            dst[int(do[i]):int(do[i]) + block].copy_(~src[int(so[i]):int(so[i]) + block])
        torch.cuda.synchronize()
        with torch.cuda.stream(self.stream):
            run()
        self.stream.synchronize()
        for i in pick:
            got = dst[int(do[i]):int(do[i]) + block].cpu()
            if not torch.equal(got, src[int(so[i]):int(so[i]) + block].cpu()):
                return f"block {i} wrong after the copy"
        return None


def kernel_fn(bench: Bench, d: str, num_sms: int, shape: Optional[tuple] = None) -> Any:
    from kvswap import BindContext, Direction
    from kvswap.backends.triton_generic import kernel as tk

    params: dict[str, Any] = {"num_sms": num_sms}
    if shape:
        params.update(zip(SHAPE_KEYS, shape))
    return tk.bind(BindContext(Direction.parse(d), bench.info, params))


def batch_fn(d: str) -> tuple[Any, str]:
    import kvswap

    try:
        return kvswap.resolve(d, device="cuda:0", policy=kvswap.Policy(force="cuda.batch")), ""
    except Exception as e:  # not landed or not available here: the table says so
        return None, f"{type(e).__name__}: {e}"


def measure(bench: Bench, d: str, block: int, fn: Any, batch_api: bool = False) -> tuple[Optional[float], str]:
    so, do, src, dst, sizes = bench.batch(d, block)
    if batch_api:
        run = lambda: fn(src, dst, sizes, stream=bench.stream)  # noqa: E731
    else:
        run = lambda: fn(src, dst, sizes, bench.stream)  # noqa: E731
    try:
        bad = bench.check(d, so, do, block, run)
        if bad:
            return None, bad
        return bench.gbps(run, int(sizes.sum())), ""
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def label(shape: tuple) -> str:
    t, r, w, a, p, c = shape
    return f"t{t} r{r} w{w} a{a}{' pf' if p else ''}{' ' + c if c else ''}"


def sweep(bench: Bench, ceil: dict[str, float], lines: list[str], out: dict) -> dict[str, tuple]:
    """Measure every SWEEP shape at SWEEP_POINTS; return the winning shape per direction."""
    lines += ["", "## Launch-shape sweep (fraction of ceiling)", "",
              "| dir | block | SMs | " + " | ".join(label(sh) for sh in SWEEP) + " |",
              "|---|---|---|" + "---|" * len(SWEEP)]
    print("\n".join(lines[-4:]), flush=True)
    best: dict[str, tuple] = {}
    for d in ("h2d", "d2h"):
        scores: dict[tuple, list[float]] = {sh: [] for sh in SWEEP}
        for block, k in SWEEP_POINTS:
            cells = []
            for shape in SWEEP:
                g, err = measure(bench, d, block, kernel_fn(bench, d, k, shape))
                out["sweep"].append({"dir": d, "block": block, "sms": k, "shape": shape, "gbps": g, "error": err})
                cells.append(f"{g / ceil[d]:.2f}" if g else "ERR")
                if k >= 4:
                    scores[shape].append(g / ceil[d] if g else 0.0)
                if err:
                    print(f"sweep {d} {block} {k} {shape}: {err}", file=sys.stderr)
            lines.append(f"| {d} | {block // KiB} KiB | {k} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        best[d] = max(SWEEP, key=lambda sh: statistics.mean(scores[sh]))
        lines.append(f"| {d} winner: {label(best[d])} (mean {statistics.mean(scores[best[d]]):.3f} at >= 4 SMs) |")
        print(lines[-1], flush=True)
    out["winners"] = {d: list(sh) for d, sh in best.items()}
    return best


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="compare launch shapes first; table with the best")
    args = ap.parse_args(argv)
    import torch
    import triton

    t0 = time.time()
    bench = Bench(args.n, args.reps)
    name = torch.cuda.get_device_name(0)
    out: dict[str, Any] = {"device": name, "n": args.n, "reps": args.reps, "torch": torch.__version__,
                           "triton": triton.__version__, "rows": [], "sweep": [], "ceiling": {}}
    lines = [f"# triton.kernel on {name} (N={args.n}, median of {args.reps}; torch {torch.__version__}, "
             f"triton {triton.__version__})", ""]
    ceil = {d: bench.ceiling(d) for d in ("h2d", "d2h")}
    out["ceiling"] = ceil
    lines.append("Contiguous pinned ceiling (512 MiB): " + ", ".join(f"{d} {g:.1f} GB/s" for d, g in ceil.items()))
    print(lines[-1], flush=True)
    shapes: dict[str, Optional[tuple]] = {"h2d": None, "d2h": None}
    if args.sweep:
        shapes = sweep(bench, ceil, lines, out)
        save(lines, out)
    used = ", ".join(f"{d} {label(sh) if sh else 'library defaults'}" for d, sh in shapes.items())
    cols = [f"triton {k} SMs" for k in BUDGETS] + ["cuda.batch"]
    lines += ["", f"GB/s (fraction of the contiguous ceiling); triton.kernel launch shape: {used}", "",
              "| dir | block | ceiling | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    print("\n".join(lines[-3:]), flush=True)
    notes = []
    for d in ("h2d", "d2h"):
        batch, why = batch_fn(d)
        if batch is None:
            notes.append(f"cuda.batch {d}: not measured ({why})")
        for block in BLOCKS:
            cells = []
            for k in BUDGETS:
                g, err = measure(bench, d, block, kernel_fn(bench, d, k, shapes[d]))
                out["rows"].append({"dir": d, "block": block, "impl": "triton.kernel", "sms": k, "gbps": g, "error": err})
                cells.append(f"{g:.1f} ({g / ceil[d]:.2f})" if g else "ERR")
                if err:
                    notes.append(f"triton.kernel {d} {block} {k} SMs: {err}")
            if batch is not None:
                g, err = measure(bench, d, block, batch, batch_api=True)
                out["rows"].append({"dir": d, "block": block, "impl": "cuda.batch", "gbps": g, "error": err})
                cells.append(f"{g:.1f} ({g / ceil[d]:.2f})" if g else "ERR")
                if err:
                    notes.append(f"cuda.batch {d} {block}: {err}")
            else:
                cells.append("n/a")
            lines.append(f"| {d} | {block // KiB} KiB | {ceil[d]:.1f} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    lines += [""] + [f"- {note}" for note in notes]
    print("\n".join(lines[-len(notes) - 1:]), flush=True)
    lines += ["", f"wall time {time.time() - t0:.0f} s"]
    save(lines, out)
    return 0


def save(lines: list[str], out: dict) -> None:
    where = os.environ.get("OUT")
    if where:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, "bench_triton.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(os.path.join(where, "bench_triton.json"), "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
