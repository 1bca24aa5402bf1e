"""The staged route's device side on the copy engines or on the SMs (GPU; not a test: it
prints, it asserts nothing).

The staged route gathers (d2h) or scatters (h2d) a job's scattered chunks to or from a
device staging buffer with a Triton kernel on ``DEVICE_SMS`` SMs, then moves the buffer over
the link on the copy engines. A device-to-device ``cuMemcpyBatchAsync`` (one descriptor per
chunk) would take no SMs from the compute beside it, if it kept up with the link. Per chunk
size (per-layer KV of ``--layers`` layers, ``--blocks`` random blocks of a larger cache),
paired in one run, every route's bytes checked first: the device side alone, in GB/s of job
bytes, on the Triton kernel (``DEVICE_SMS`` SMs), the batch on one stream and the batch spread over four
streams, against a contiguous device copy of the same bytes and a contiguous link copy (the
pace the device side must keep).

    python3 tests/bench/bench_staged_device_side.py --json $OUT/device_side.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="4,16,32", help="chunk sizes, KiB")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=512, help="blocks per job")
    ap.add_argument("--cache-blocks", type=int, default=1024, help="blocks of the device KV cache")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    import torch

    from kvswap.backends.cuda import batch, driver
    from kvswap.backends.triton_generic.by_ids import KernelCopyByIds
    from kvswap.backends.triton_generic.launch import DEFAULT_PLANS, TilePlan
    from kvswap.backends.triton_generic.staged import DEVICE_SMS
    from kvswap.types import Direction

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    ce = batch.bind(driver.get(), Direction.D2D, 0)
    sm = KernelCopyByIds(num_sms=DEVICE_SMS, device_index=0, tiles=TilePlan.from_params({}, DEFAULT_PLANS["d2d"]))
    SMS = f"sm@{DEVICE_SMS}"
    streams = [torch.cuda.Stream(dev) for _ in range(4)]
    main_s = torch.cuda.Stream(dev)
    gen = np.random.default_rng(0)

    def timed(fn, s) -> float:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            e0.record()
            fn(s)
            e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1)

    def one_chunk(kib: int) -> list:
        """Both directions' rows at chunks of ``kib`` KiB."""
        records = []
        chunk = kib << 10
        kv = [torch.randint(0, 255, (2, args.cache_blocks, chunk), dtype=torch.uint8, device=dev)
              for _ in range(args.layers)]
        n = args.blocks * args.layers * 2
        job = n * chunk
        staging = torch.empty(job, dtype=torch.uint8, device=dev)
        contig = torch.empty(job, dtype=torch.uint8, device=dev)
        host = torch.empty(job, dtype=torch.uint8, pin_memory=True)
        ids = gen.choice(args.cache_blocks, args.blocks, replace=False).astype(np.int64)
        # Per block, its layers' K and V in turn: the block-major order of the staging buffer.
        bases = np.array([[t[0].data_ptr(), t[1].data_ptr()] for t in kv], dtype=np.int64).ravel()
        scattered = (ids[:, None] * chunk + bases[None, :]).ravel()
        packed = staging.data_ptr() + np.arange(n, dtype=np.int64) * chunk
        sizes = np.full(n, chunk, dtype=np.int64)
        parts = np.array_split(np.arange(n), 4)
        join = [torch.cuda.Event() for _ in streams]

        def device_side(kind: str, to_host: bool):
            src, dst = (scattered, packed) if to_host else (packed, scattered)

            def op(s) -> None:
                if kind == SMS:
                    sm(src, dst, sizes, s)
                elif kind == "ce x1":
                    ce(src, dst, sizes, s)
                else:  # ce x4: fork onto four streams, join back
                    start = torch.cuda.Event()
                    start.record(s)
                    for p, ps, ev in zip(parts, streams, join):
                        ps.wait_event(start)
                        ce(src[p], dst[p], sizes[p], ps)
                        ev.record(ps)
                    for ev in join:
                        s.wait_event(ev)
            return op

        def check(to_host: bool) -> None:
            """Every route moves the right bytes before anything is timed."""
            ref = torch.cat([kv[l][kv_i][torch.as_tensor(ids, device=dev)].reshape(args.blocks, 1, chunk)
                             for l in range(args.layers) for kv_i in range(2)], dim=1).reshape(-1)
            for kind in (SMS, "ce x1", "ce x4"):
                if to_host:
                    staging.fill_(0x5A)
                    timed(device_side(kind, True), main_s)
                    assert torch.equal(staging, ref), kind
                else:
                    staging.copy_(ref)
                    saved = [t.clone() for t in kv]
                    for t in kv:
                        for kv_i in range(2):
                            t[kv_i][torch.as_tensor(ids, device=dev)] = 0x5A
                    timed(device_side(kind, False), main_s)
                    assert all(torch.equal(t, u) for t, u in zip(kv, saved)), kind

        for d in ("d2h", "h2d"):
            to_host = d == "d2h"
            check(to_host)
            kinds = (SMS, "ce x1", "ce x4")
            ref_ms, alone = [], {k: [] for k in kinds}
            for _ in range(args.reps):
                ref_ms.append(timed(lambda s: contig.copy_(staging, non_blocking=True), main_s))
                for k in kinds:
                    alone[k].append(timed(device_side(k, to_host), main_s))
            ref = statistics.median(ref_ms)
            link = statistics.median(timed(lambda s: (host.copy_(staging, non_blocking=True) if to_host
                                                      else staging.copy_(host, non_blocking=True)), main_s)
                                     for _ in range(args.reps))
            row = {"direction": d, "chunk_bytes": chunk, "job_bytes": job, "descriptors": n,
                   "contiguous_gbps": job / ref / 1e6, "link_gbps": job / link / 1e6,
                   "alone_gbps": {k: job / statistics.median(v) / 1e6 for k, v in alone.items()}}
            records.append(row)
            print(f"{d} {kib:2d} KiB x{n}: contiguous {row['contiguous_gbps']:.0f} GB/s, link "
                  f"{row['link_gbps']:.1f} GB/s; device side alone "
                  + ", ".join(f"{k} {g:.1f}" for k, g in row["alone_gbps"].items()), flush=True)
        return records

    records = []
    for kib in [int(x) for x in args.chunks.split(",")]:
        records += one_chunk(kib)
        torch.cuda.empty_cache()  # this size's tensors are gone with one_chunk's frame
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
