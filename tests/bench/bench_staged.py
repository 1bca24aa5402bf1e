"""The staged route against the contiguous ceiling and beside compute, by chunk size.

Per-layer FlashAttention-shaped device KV (``layers`` x K/V chunks of 4-32 KiB a block)
against a block-major pinned host cache (``kvswap.host_cache``), jobs of ``--blocks``
random blocks. For each route (the mover's default, which stages such a host side; the
kernel at its calibrated SMs; the batch route; the staged route's device side on several SM
counts) it prints, as ratios measured in this run:

* ``alone/ceiling``: the transfer's speed from an idle device over a contiguous copy of the
  same bytes;
* ``slowdown``: bf16 GEMMs on a compute stream (about ``--step-ms``) beside the transfer,
  over the GEMMs alone;
* ``makespan/bound``: launch to both done, over max(compute alone, bytes / ceiling).

A ``contiguous`` row does the same for one contiguous copy of the job's bytes on a side
stream: the compute slowdown of moving those bytes over the link at all, the floor the
routes are read against.

Every job's bytes are checked once. ``python3 tests/bench/bench_staged.py --json out.json``

``--link-only`` measures the link by itself instead: the batch route copying runs of 64 KiB
to 1 MiB between a contiguous device buffer and scattered host runs, its descriptors spread
over 1-4 streams, as a fraction of the contiguous copy of the same bytes; ``--host-mib``
sets the pinned pool the runs are scattered over (an engine's host cache is many GiB).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch

import kvswap
from kvswap import BlockMover, Policy
from kvswap.backends.triton_generic import staged as staged_mod

GEMM = 4096


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def link_only(streams: list[int], reps: int, host_bytes: int = 256 << 20) -> list[dict]:
    """The batch route's runs over 1..N streams against the contiguous ceiling, the runs at
    random places of a pinned pool of ``host_bytes``."""
    dev, total = torch.device("cuda:0"), 128 << 20
    host = torch.empty(max(host_bytes, total), dtype=torch.uint8, pin_memory=True)
    device = torch.empty(total, dtype=torch.uint8, device=dev)
    contiguous = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    side = [torch.cuda.Stream() for _ in range(max(streams))]
    rng, rows = np.random.default_rng(1), []
    for direction in ("h2d", "d2h"):
        ceil_t = timed(lambda: (device.copy_(contiguous, non_blocking=True) if direction == "h2d"
                                else contiguous.copy_(device, non_blocking=True)), reps)
        fn = kvswap.resolve(direction, device=dev, policy=Policy(force="cuda.batch"))
        for run in (64 << 10, 256 << 10, 1 << 20):
            n = total // run
            hp = host.data_ptr() + rng.choice(host.numel() // run, n, replace=False).astype(np.int64) * run
            dp = device.data_ptr() + np.arange(n, dtype=np.int64) * run
            src, dst = (hp, dp) if direction == "h2d" else (dp, hp)
            sizes = np.full(n, run, dtype=np.int64)
            row = dict(direction=direction, run_kib=run >> 10, descriptors=n, host_mib=host.numel() >> 20)
            for k in streams:
                def spread():
                    cur, cuts = torch.cuda.current_stream(), np.linspace(0, n, k + 1).astype(int)
                    for s, lo, hi in zip(side, cuts, cuts[1:]):
                        s.wait_stream(cur)
                        fn(src[lo:hi], dst[lo:hi], sizes[lo:hi], stream=s.cuda_stream)
                    for s in side[:k]:
                        cur.wait_stream(s)
                row[f"{k} stream(s)"] = round(ceil_t / timed(spread, reps), 3)
            rows.append(row)
    print(f"device {torch.cuda.get_device_name()}: the batch route over runs scattered in {host.numel() >> 20} MiB "
          f"of pinned memory / contiguous copy")
    keys = [f"{k} stream(s)" for k in streams]
    print("| dir | run | descriptors | " + " | ".join(keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for r in rows:
        print(f"| {r['direction']} | {r['run_kib']} KiB | {r['descriptors']} | " + " | ".join(str(r[k]) for k in keys) + " |")
    return rows


def beside_compute(copy, launch_compute, compute, comp_alone: float, nbytes: int, ceiling: float,
                   reps: int) -> dict:
    """``copy(stream)`` enqueued on a side stream right after the GEMMs: the compute's
    slowdown and the makespan over the bound, medians of ``reps``."""
    side = torch.cuda.Stream()
    comps, spans = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record(compute)
        side.wait_event(ev[0])
        launch_compute()
        ev[1].record(compute)
        with torch.cuda.stream(side):
            copy(side)
        ev[2].record(side)
        torch.cuda.synchronize()
        comps.append(ev[0].elapsed_time(ev[1]) / 1e3)
        spans.append(max(comps[-1], ev[0].elapsed_time(ev[2]) / 1e3))
    bound = max(comp_alone, nbytes / (ceiling * 1e9))
    return dict(slowdown=round(statistics.median(comps) / comp_alone - 1, 3),
                makespan_over_bound=round(statistics.median(spans) / bound, 3),
                ceiling_gbps=round(ceiling, 1), bytes=nbytes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--sms", default="16,32,66,132", help="SM counts of the staged device side to try")
    p.add_argument("--link-streams", default="1,2,4",
                   help="copy-engine streams of the staged route's link to try (the mover's default route)")
    p.add_argument("--shapes", default="4x80,8x64,16x40,32x32", help="chunk KiB x layers, comma-separated")
    p.add_argument("--link-only", action="store_true", help="measure the batch route's runs over --link-streams")
    p.add_argument("--host-mib", type=int, default=256, help="with --link-only: the pinned pool the runs lie in")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.link_only:
        rows = link_only([int(x) for x in args.link_streams.split(",")], args.reps, args.host_mib << 20)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), link_only=rows), f, indent=1)
        return 0
    dev = torch.device("cuda:0")
    default_links = staged_mod.LINK_STREAMS
    # (chunk KiB, layers, heads): 16 tokens x heads x 128 x 2 B per K or V chunk
    shapes = [(int(c), int(n), int(c) // 4) for c, n in (x.split("x") for x in args.shapes.split(","))]
    a = torch.randn(GEMM, GEMM, device=dev, dtype=torch.bfloat16)
    b = torch.randn(GEMM, GEMM, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(a)
    compute = torch.cuda.Stream()
    with torch.cuda.stream(compute):
        for _ in range(10):
            torch.matmul(a, b, out=out)
    one = timed(lambda: torch.matmul(a, b, out=out), 10)
    gemms = max(1, round(args.step_ms / 1e3 / one))

    def launch_compute():
        with torch.cuda.stream(compute):
            for _ in range(gemms):
                torch.matmul(a, b, out=out)

    rows = []
    rng = np.random.default_rng(0)
    for chunk_kib, layers, heads in shapes:
        pool = 2 * args.blocks
        device = [torch.randint(-9, 9, (2, pool, 16, heads, 128), dtype=torch.int16, device=dev).view(torch.bfloat16)
                  for _ in range(layers)]
        cache = kvswap.host_cache(device, pool, block_dim=1)
        cache.buffer.copy_(torch.randint(0, 256, cache.buffer.shape, dtype=torch.uint8))
        nbytes = args.blocks * cache.block_bytes
        for direction in ("h2d", "d2h"):
            src, dst = (list(cache.views), device) if direction == "h2d" else (device, list(cache.views))
            h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            ceil_t = timed(lambda: (d.copy_(h, non_blocking=True) if direction == "h2d"
                                    else h.copy_(d, non_blocking=True)), args.reps)
            ceiling = nbytes / ceil_t / 1e9
            comp_alone = timed(lambda: (launch_compute(), torch.cuda.current_stream().wait_stream(compute)),
                               args.reps)
            rows.append(dict(chunk_kib=chunk_kib, direction=direction, route="contiguous", label="",
                             alone_over_ceiling=1.0, **beside_compute(
                                 lambda s: (d.copy_(h, non_blocking=True) if direction == "h2d"
                                            else h.copy_(d, non_blocking=True)),
                                 launch_compute, compute, comp_alone, nbytes, ceiling, args.reps)))
            del h, d
            streams = [int(x) for x in args.link_streams.split(",")]
            contenders = [(f"default/{n} link" if len(streams) > 1 else "default", Policy(), n) for n in streams]
            contenders += [("kernel", Policy(force="triton.kernel"), None), ("batch", Policy(force="cuda.batch"), None)]
            contenders += [(f"staged@{k}", Policy(force="triton.staged", max_sms=int(k)), None)
                           for k in args.sms.split(",") if k]
            for name, policy, links in contenders:
                staged_mod.LINK_STREAMS = links or default_links
                try:
                    mover = BlockMover(src, dst, direction, block_dim=1, policy=policy)
                except Exception as e:
                    rows.append(dict(chunk_kib=chunk_kib, direction=direction, route=name, error=str(e)))
                    continue
                sid = rng.choice(pool, args.blocks, replace=False)
                did = rng.choice(pool, args.blocks, replace=False)
                mover.wait(mover.submit(sid, did))  # warm-up
                for t_src, t_dst in zip(src, dst):  # one check of every block of the job
                    assert torch.equal(t_dst[:, did].view(torch.int16).cpu(), t_src[:, sid].view(torch.int16).cpu())

                def alone():
                    mover.wait(mover.submit(sid, did, after=None))

                t_alone = timed(alone, args.reps)
                spans, comps = [], []
                for _ in range(args.reps):
                    torch.cuda.synchronize()
                    s0 = torch.cuda.Event(enable_timing=True)
                    c1 = torch.cuda.Event(enable_timing=True)
                    s0.record(compute)
                    launch_compute()
                    c1.record(compute)
                    job = mover.submit(sid, did, after=None)
                    mover.wait(job)
                    torch.cuda.synchronize()
                    t1 = torch.cuda.Event(enable_timing=True)
                    comps.append(s0.elapsed_time(c1) / 1e3)
                    (r,) = [x for x in mover.poll() if x.job_id == job] or [None]
                    spans.append(max(comps[-1], r.seconds if r is not None else 0.0))
                    del t1
                mover.poll()
                comp_beside = statistics.median(comps)
                bound = max(comp_alone, nbytes / (ceiling * 1e9))
                rows.append(dict(chunk_kib=chunk_kib, direction=direction, route=name,
                                 label=mover.explain().splitlines()[-1] if name.startswith("default") else "",
                                 alone_over_ceiling=round(nbytes / t_alone / 1e9 / ceiling, 3),
                                 slowdown=round(comp_beside / comp_alone - 1, 3),
                                 makespan_over_bound=round(statistics.median(spans) / bound, 3),
                                 ceiling_gbps=round(ceiling, 1), bytes=nbytes))
                mover.close()
        del device, cache
        torch.cuda.empty_cache()
    print(f"device {torch.cuda.get_device_name()}, {args.blocks} blocks a job, GEMMs {gemms} x {GEMM}^3 "
          f"(~{gemms * one * 1e3:.1f} ms), median of {args.reps}")
    print("| chunk | dir | route | alone/ceiling | compute slowdown | makespan/bound |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['chunk_kib']} KiB | {r['direction']} | {r['route']} | error: {r['error'][:80]} | | |")
        else:
            print(f"| {r['chunk_kib']} KiB | {r['direction']} | {r['route']} | {r['alone_over_ceiling']} | "
                  f"{r['slowdown']:+.1%} | {r['makespan_over_bound']} |")
    for r in rows:
        if r.get("label"):
            print(f"{r['chunk_kib']} KiB {r['direction']} default: {r['label'].strip()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
