"""How long ``BlockMover.submit`` holds the engine's thread, timed cold (GPU; not a test:
it prints, it asserts nothing).

An engine submits once per step, between other work: the step's kernel launches and its
own Python have evicted kvswap's code and data from the CPU's caches, which makes the same
submit several times slower than in a tight loop. So before every timed submit, a batch of
bf16 GEMMs is launched on the compute stream and a host buffer is rewritten
(``--touch-mb``), as a step's other work would; then ``submit`` alone is timed.

Layout: ``--layers`` per-layer tensors a side in vLLM's FlashAttention layout
``(2, num_blocks, 16, heads, head_dim)``, ``block_dim=1`` (two chunks per layer and block:
32 layers make 64 descriptors a block). Per direction, route (kvswap's default,
``triton.kernel``, ``cuda.batch``), with the issuing thread and without it, and per job of
B random blocks: the median and 90th percentile of the time ``submit`` held the thread, as
a fraction of the budget of 100 µs + 10 ns per descriptor, and the median time from
calling ``submit`` to the job being on the transfer stream (``wait_issued``). Each
configuration's first job has its bytes checked.

    python tests/bench/bench_mover_submit.py --json $OUT/mover_submit.json
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from typing import Any

import numpy as np

ROUTES = ("default", "triton.kernel", "cuda.batch")


def budget_us(descriptors: int) -> float:
    return 100.0 + 0.010 * descriptors


class Pollution:
    """A step's other work: GEMMs launched on the compute stream, a host buffer rewritten."""

    def __init__(self, torch: Any, device: str, gemms: int, size: int, touch_mb: int) -> None:
        self.torch, self.gemms = torch, gemms
        self.a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        self.host = np.zeros(touch_mb << 17, dtype=np.float64) if touch_mb else None

    def __call__(self) -> None:
        for _ in range(self.gemms):
            self.a @ self.b
        if self.host is not None:
            self.host += 1.0


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    import kvswap
    from kvswap import Policy

    dev = f"cuda:{torch.cuda.current_device()}"
    rng = np.random.default_rng(0)
    nb = max(2 * max(args.blocks), 64)
    shape = (2, nb, 16, args.heads, args.head_dim)
    host = [torch.randint(-9, 9, shape, dtype=torch.bfloat16).pin_memory() for _ in range(args.layers)]
    gpu = [torch.randint(-9, 9, shape, dtype=torch.bfloat16, device=dev) for _ in range(args.layers)]
    pollute = Pollution(torch, dev, args.gemms, args.gemm_size, args.touch_mb)
    rows = []
    for direction in ("h2d", "d2h"):
        src, dst = (host, gpu) if direction == "h2d" else (gpu, host)
        for route in args.routes:
            for threaded in (True, False):
                policy = Policy(force=route) if route != "default" else None
                mover = kvswap.BlockMover(src, dst, direction, block_dim=1, policy=policy,
                                          issuing_thread=threaded)
                for blocks in args.blocks:
                    desc = blocks * mover.chunks_per_block

                    def draw() -> tuple:
                        return (rng.permutation(nb)[:blocks].astype(np.int64),
                                rng.permutation(nb)[:blocks].astype(np.int64))

                    sid, did = draw()
                    mover.wait(mover.submit(sid, did))
                    ok = all(torch.equal(s[:, sid].cpu(), d[:, did].cpu()) for s, d in zip(src, dst))
                    for _ in range(3):  # warm: compile, pool buffers, thread started
                        mover.wait(mover.submit(*draw()))
                    mover.poll()
                    held, issued = [], []
                    for _ in range(args.reps):
                        sid, did = draw()
                        torch.cuda.synchronize()
                        pollute()
                        gc.disable()
                        t0 = time.perf_counter_ns()
                        job = mover.submit(sid, did)
                        t1 = time.perf_counter_ns()
                        mover.wait_issued(job)
                        t2 = time.perf_counter_ns()
                        gc.enable()
                        held.append((t1 - t0) / 1e3)
                        issued.append((t2 - t0) / 1e3)
                        mover.wait(job)
                        mover.poll()
                    med, p90 = statistics.median(held), float(np.percentile(held, 90))
                    b = budget_us(desc)
                    row = dict(direction=direction, route=route, impls=",".join(mover.swap_fn.impls),
                               issuing_thread=threaded, blocks=blocks, descriptors=desc,
                               submit_us=round(med, 1), submit_p90_us=round(p90, 1), budget_us=round(b, 1),
                               of_budget=round(med / b, 3), issued_after_us=round(statistics.median(issued), 1),
                               bytes_ok=ok)
                    rows.append(row)
                    print(f"{direction} {route:14s} thread={'on ' if threaded else 'off'} B={blocks:5d} "
                          f"desc={desc:6d} submit {med:8.1f} us (p90 {p90:8.1f})  budget {b:7.1f} us  "
                          f"{med / b:5.2f} of it  issued after {row['issued_after_us']:8.1f} us  "
                          f"bytes {'ok' if ok else 'WRONG'}", flush=True)
                mover.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[32, 128, 512])
    ap.add_argument("--routes", type=lambda s: s.split(","), default=list(ROUTES))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--gemms", type=int, default=8, help="GEMMs launched before each submit")
    ap.add_argument("--gemm-size", type=int, default=2048)
    ap.add_argument("--touch-mb", type=int, default=32, help="host memory rewritten before each submit")
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    rows = run(args)
    over = [r for r in rows if r["of_budget"] > 1.0]
    print(f"\n{len(rows) - len(over)}/{len(rows)} medians within the budget (100 us + 10 ns/descriptor); "
          f"{sum(not r['bytes_ok'] for r in rows)} with wrong bytes")
    for r in over:
        print(f"  over: {r['direction']} {r['route']} thread={r['issuing_thread']} B={r['blocks']}: "
              f"{r['submit_us']} us > {r['budget_us']} us")
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                    numpy=np.__version__, argv=sys.argv[1:])
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
