"""Host->device 4 KiB x 10,000 through BlockMover against the contiguous ceiling (GPU;
not a test: it prints, it asserts nothing). The goal: >= 0.90 of the ceiling.

For each layout, BlockMover on the kernel route copies B random blocks (B x pieces ~
10,000 descriptors of 4 KiB), two ways:

* ``by-ids``: the kernel derives the addresses on the device from the template uploaded
  at construction; a submit sends only the two id arrays;
* ``descriptors``: the same mover with the by-id path switched off (descriptors built on
  the host, coalesced, packed and uploaded before the kernel), as before.

Each is timed three ways, median of ``--reps``: ``idle`` (from an idle stream: the wall
time from the submit call to the job's completion, host preparation included, as an
engine's first transfer of a step sees it), ``stream`` (the job's own start/end events on
the transfer stream) and ``queued`` (``--queue`` jobs submitted back to back, wall time
per job: the previous copy hides the next one's preparation). The ceiling is one
contiguous pinned->device copy of the same bytes, timed the same ways. Every job of the
first rep is checked byte for byte.

Layouts: ``pool`` (one tensor a side, one 4 KiB piece per block: 10,000 blocks) and
``layers`` (28 per-layer FlashAttention tensors a side, K and V: 56 pieces of 4 KiB per
block, 179 blocks).

    python3 tests/bench/bench_by_ids.py --json $OUT/by_ids.json
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

KiB = 1024


def layouts(device: str) -> dict[str, tuple[list, list, int, int]]:
    """name -> (host tensors, device tensors, block_dim, blocks per job)."""
    import torch

    out = {}
    nb_h, nb_d = 24_000, 12_000
    host = torch.randint(0, 256, (nb_h, 4 * KiB), dtype=torch.uint8).pin_memory()
    gpu = torch.randint(0, 256, (nb_d, 4 * KiB), dtype=torch.uint8, device=device)
    out["pool"] = ([host], [gpu], 0, 10_000)
    nb_h, nb_d = 600, 400
    shape = lambda nb: (2, nb, 16, 1, 128)  # noqa: E731  4 KiB per K or V chunk (bf16)
    host = [torch.randint(-99, 99, shape(nb_h), dtype=torch.bfloat16).pin_memory() for _ in range(28)]
    gpu = [torch.randint(-99, 99, shape(nb_d), dtype=torch.bfloat16, device=device) for _ in range(28)]
    out["layers"] = (host, gpu, 1, 179)
    return out


def ceiling(nbytes: int, reps: int) -> dict[str, float]:
    """Seconds of one contiguous pinned->device copy of ``nbytes``: idle wall and stream."""
    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    idle, stream = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
        b.synchronize()
        idle.append(time.perf_counter() - t0)
        stream.append(a.elapsed_time(b) / 1e3)
    return dict(idle=statistics.median(idle[1:]), stream=statistics.median(stream[1:]))


def timed_mover(mover: Any, draw: Callable[[], tuple], reps: int, queue: int, check: Callable) -> dict[str, float]:
    import torch

    idle, stream, queued = [], [], []
    for rep in range(reps + 1):
        sid, did = draw()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        mover.submit(sid, did)
        mover.wait()
        idle.append(time.perf_counter() - t0)
        (res,) = mover.poll()
        assert res.ok, res.error
        stream.append(res.seconds)
        if rep == 0:
            check(sid, did)
        jobs = [draw() for _ in range(queue)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for sid, did in jobs:
            mover.submit(sid, did)
        mover.wait()
        queued.append((time.perf_counter() - t0) / queue)
        mover.poll()
    return dict(idle=statistics.median(idle[1:]), stream=statistics.median(stream[1:]),
                queued=statistics.median(queued[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--queue", type=int, default=4, help="jobs submitted back to back for 'queued'")
    ap.add_argument("--max-sms", type=int, default=None, help="Policy.max_sms for the kernel route")
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=["pool", "layers"])
    args = ap.parse_args()

    import torch

    import kvswap
    from kvswap import Policy

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = f"cuda:{torch.cuda.current_device()}"
    rng = np.random.default_rng(0)
    rows = []
    built = layouts(device)
    for name in args.layouts:
        host, gpu, bd, blocks = built[name]
        mover = kvswap.BlockMover(host, gpu, "h2d", block_dim=bd,
                                  policy=Policy(force="triton.kernel", max_sms=args.max_sms), device_descriptors=True)
        nbytes = blocks * mover.block_bytes
        ceil = ceiling(nbytes, args.reps)
        n_src, n_dst = mover.num_src_blocks, mover.num_dst_blocks

        def draw() -> tuple:
            return (rng.permutation(n_src)[:blocks].astype(np.int64), rng.permutation(n_dst)[:blocks].astype(np.int64))

        def check(sid: np.ndarray, did: np.ndarray) -> None:
            for h, g in zip(host, gpu):
                hs = h.index_select(bd, torch.as_tensor(sid))
                gs = g.index_select(bd, torch.as_tensor(did, device=g.device)).cpu()
                if not torch.equal(hs.view(torch.uint8) if hs.dtype != torch.uint8 else hs,
                                   gs.view(torch.uint8) if gs.dtype != torch.uint8 else gs):
                    raise SystemExit(f"{name}: wrong bytes after a job")

        ids_path = mover._plan.ids
        paths = [("by-ids", ids_path), ("descriptors", None)] if ids_path is not None else [("descriptors", None)]
        if ids_path is None:
            print(f"{name}: this mover has no by-id path (kernel route without the capability?)")
        for path, steps in paths:
            mover._plan.ids = steps
            t = timed_mover(mover, draw, args.reps, args.queue, check)
            for how in ("idle", "stream", "queued"):
                ref = ceil["stream"] if how == "queued" else ceil[how]
                row = dict(layout=name, path=path, timing=how, blocks=blocks, pieces=mover.chunks_per_block,
                           descriptors=blocks * mover.chunks_per_block, bytes=nbytes, seconds=t[how],
                           gbps=round(nbytes / t[how] / 1e9, 2), ceiling_gbps=round(nbytes / ref / 1e9, 2),
                           of_ceiling=round(ref / t[how], 3), impls=",".join(mover.swap_fn.impls))
                rows.append(row)
                print(f"{name:7s} {path:12s} {how:7s} {row['descriptors']:6d} x 4 KiB  {row['gbps']:6.2f} GB/s  "
                      f"ceiling {row['ceiling_gbps']:6.2f}  -> {row['of_ceiling']:.3f} of it", flush=True)
        mover.close()
    print("\ngoal: >= 0.90 of the ceiling (h2d 4 KiB x 10,000 through BlockMover)")
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                    argv=sys.argv[1:])
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
