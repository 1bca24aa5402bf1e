"""How long a transfer holds the engine's thread, per route and descriptor count (GPU;
not a test: it prints, it asserts nothing).

The budget: the caller's thread returns from ``BlockMover.submit`` and from a SwapFn
call within 100 µs + 10 ns per descriptor, on every route. Timed with the transfer
stream busy (a sleep kernel queued first), so only host work counts; median of
``--reps`` calls, each on fresh ids. Between calls the thread blocks on the stream, so each
call starts cold; ``--warm`` polls it instead, so the thread stays busy.

* ``swapfn``: ``resolve(direction, policy=force)`` called on N scattered 4 KiB blocks
  (one pinned pool, one device pool), and the bound transfer it ends in called alone
  (``raw``: the driver call or kernel launch without kvswap's checks and routing); the
  SwapFn's bar is ``raw`` + 20 µs;
* ``submit``: ``BlockMover.submit`` on 80 per-layer FlashAttention tensors a side
  (2 chunks of 4 KiB per layer and block: 32 blocks are 5,120 descriptors).

Routes: ``cuda.batch`` (the driver call on the caller's thread), ``triton.kernel`` and
kvswap's default. Every transfer's bytes are checked once per
route and count (the first call), so a fast wrong answer cannot pass.

    python3 tests/bench/bench_thread_held.py --json $OUT/thread_held.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from typing import Any, Callable, Optional

import numpy as np

BLOCK = 4096
LAYERS = 80
ROUTES = ("cuda.batch", "triton.kernel", "default")


def budget_us(descriptors: int) -> float:
    return 100.0 + 0.010 * descriptors


WARM = False  # --warm: poll the busy stream instead of blocking on it between calls


def held_us(stream: Any, fn: Callable[[], Any], spin: int = 50_000_000) -> float:
    from kvswap.calibration.timing import held_us as timed

    return timed(fn, stream, spin, spin=WARM)  # what calibration times a route's host cost with


def resolve_for(route: str, direction: str, device: str, block_bytes: Any) -> Any:
    import kvswap
    from kvswap import Policy

    force = route if route != "default" else None
    return kvswap.resolve(direction, device=device, block_bytes=block_bytes,
                          policy=Policy(force=force) if force else None)


def swapfn_rows(args: argparse.Namespace, rows: list) -> None:
    import torch

    rng = np.random.default_rng(0)
    dev = f"cuda:{torch.cuda.current_device()}"
    top = max(args.counts)
    slots = 2 * top
    host = torch.randint(0, 256, (slots * BLOCK,), dtype=torch.uint8).pin_memory()
    gpu = torch.randint(0, 256, (slots * BLOCK,), dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream()
    for direction in ("h2d", "d2h"):
        src_t, dst_t = (host, gpu) if direction == "h2d" else (gpu, host)
        for route in args.routes:
            fn = resolve_for(route, direction, dev, BLOCK)
            for n in args.counts:
                def draw() -> tuple:
                    s = rng.permutation(slots)[:n].astype(np.int64) * BLOCK
                    d = rng.permutation(slots)[:n].astype(np.int64) * BLOCK
                    return s + src_t.data_ptr(), d + dst_t.data_ptr(), np.full(n, BLOCK, dtype=np.int64), s, d

                s, d, z, so, do = draw()
                fn(s, d, z, stream=stream)  # warm-up, then check its bytes
                stream.synchronize()
                ok = _check(src_t, dst_t, so, do)
                times, raw, first, second = [], [], [], []
                for rep in range(args.reps):
                    s, d, z, _, _ = draw()
                    steps = fn.assign(s, d, z)
                    # One route takes the whole batch: time it alone too, first every other
                    # rep (the call timed first after drawing the ids can run colder).
                    bound = fn._fns[steps[0][:2]] if len(steps) == 1 else None
                    if bound is not None and rep % 2:
                        raw.append(held_us(stream, lambda: bound(s, d, z, stream)))
                    times.append(held_us(stream, lambda: fn(s, d, z, stream=stream)))
                    (second if bound is not None and rep % 2 else first).append(times[-1])
                    if bound is not None and not rep % 2:
                        raw.append(held_us(stream, lambda: bound(s, d, z, stream)))
                _row(rows, "swapfn", route, direction, n, statistics.median(times), ok, fn,
                     statistics.median(raw) if raw else None)
                if first and second:
                    rows[-1].update(held_us_timed_first=round(statistics.median(first), 1),
                                    held_us_timed_second=round(statistics.median(second), 1))
                    print(f"       the SwapFn call timed first after the draw {rows[-1]['held_us_timed_first']} us, "
                          f"after the bound transfer {rows[-1]['held_us_timed_second']} us", flush=True)


def _check(src_t: Any, dst_t: Any, so: np.ndarray, do: np.ndarray) -> bool:
    """Every byte of up to 4,096 of the blocks (a sample of the largest batches)."""
    src = src_t.cpu().numpy() if src_t.is_cuda else src_t.numpy()
    dst = dst_t.cpu().numpy() if dst_t.is_cuda else dst_t.numpy()
    pick = np.random.default_rng(len(so)).permutation(len(so))[:4096]
    idx = np.arange(BLOCK)
    return bool((src[so[pick, None] + idx] == dst[do[pick, None] + idx]).all())


def submit_rows(args: argparse.Namespace, rows: list) -> None:
    import torch

    import kvswap
    from kvswap import Policy

    rng = np.random.default_rng(1)
    dev = f"cuda:{torch.cuda.current_device()}"
    blocks_needed = max(args.counts) // (2 * LAYERS) + 1
    nb = max(2 * blocks_needed, 64)
    shape = (2, nb, 16, 1, 128)  # 4 KiB chunks (bf16)
    host = [torch.randint(-9, 9, shape, dtype=torch.bfloat16).pin_memory() for _ in range(LAYERS)]
    gpu = [torch.randint(-9, 9, shape, dtype=torch.bfloat16, device=dev) for _ in range(LAYERS)]
    for direction in ("h2d", "d2h"):
        src, dst = (host, gpu) if direction == "h2d" else (gpu, host)
        for route in args.routes:
            force = route if route != "default" else None
            mover = kvswap.BlockMover(src, dst, direction, block_dim=1, policy=Policy(force=force) if force else None)
            for n in args.counts:
                blocks = max(1, n // (2 * LAYERS))
                desc = blocks * 2 * LAYERS

                def draw() -> tuple:
                    return (rng.permutation(nb)[:blocks].astype(np.int64), rng.permutation(nb)[:blocks].astype(np.int64))

                sid, did = draw()
                mover.submit(sid, did)
                mover.wait()
                ok = all(torch.equal(s[:, sid].cpu(), d[:, did].cpu()) for s, d in zip(src, dst))
                times = []
                for _ in range(args.reps):
                    sid, did = draw()
                    times.append(held_us(mover.stream, lambda: mover.submit(sid, did)))
                    mover.wait()
                    mover.poll()
                _row(rows, "submit", route, direction, desc, statistics.median(times), ok, mover.swap_fn)
            mover.close()


def _row(rows: list, what: str, route: str, direction: str, n: int, us: float, ok: bool, fn: Any,
         raw: Optional[float] = None) -> None:
    b = budget_us(n)
    impls = ",".join(fn.impls) if hasattr(fn, "impls") else ""
    row = dict(what=what, route=route, impls=impls, direction=direction, descriptors=n, held_us=round(us, 1),
               budget_us=round(b, 1), within=us <= b, bytes_ok=ok,
               raw_us=None if raw is None else round(raw, 1), within_raw=None if raw is None else us <= raw + 20)
    rows.append(row)
    vs_raw = "" if raw is None else f"  raw {raw:8.1f} us ({us - raw:+.1f}, {'within' if us <= raw + 20 else 'OVER'} +20)"
    print(f"{what:6s} {route:22s} {direction} n={n:7d} held {us:9.1f} us  budget {b:8.1f} us  "
          f"{'within' if us <= b else 'OVER'}  bytes {'ok' if ok else 'WRONG'}{vs_raw}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--counts", type=lambda s: [int(x) for x in s.split(",")],
                    default=[64, 160, 1024, 5120, 16384, 163840])
    ap.add_argument("--routes", type=lambda s: s.split(","), default=list(ROUTES))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--part", choices=("swapfn", "submit", "both"), default="both")
    ap.add_argument("--warm", action="store_true",
                    help="between calls, poll the busy stream instead of blocking on it: the thread stays busy, "
                         "as an engine's does between its calls, instead of starting each call cold")
    args = ap.parse_args()
    global WARM
    WARM = args.warm

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows: list = []
    if args.part in ("swapfn", "both"):
        swapfn_rows(args, rows)
    if args.part in ("submit", "both"):
        submit_rows(args, rows)
    over = [r for r in rows if not r["within"]]
    wrong = [r for r in rows if not r["bytes_ok"]]
    print(f"\n{len(rows) - len(over)}/{len(rows)} within the budget (100 us + 10 ns/descriptor); "
          f"{len(wrong)} with wrong bytes")
    for r in over:
        print(f"  over: {r['what']} {r['route']} {r['direction']} n={r['descriptors']}: {r['held_us']} us > "
              f"{r['budget_us']} us")
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                    argv=sys.argv[1:])
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
