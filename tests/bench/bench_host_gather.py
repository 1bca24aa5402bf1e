"""Can host threads gather a per-layer host cache's chunks as fast as the link moves them?

A staged route over a per-layer host cache would need a host-side step the block-major
cache does not: before a host-to-device copy, threads gather each block's per-layer chunks
into one pinned bounce buffer (and after a device-to-host copy, scatter them back), so that
the link moves one contiguous run per slice. This measures that step alone and beside the
link: ``layers`` pinned per-layer tensors of ``pool`` blocks, ``--blocks`` random blocks
gathered (numpy ``take`` into the bounce buffer, one layer per task, which releases the GIL)
on a pool of 1-16 threads, against a contiguous host-to-device copy of the same bytes timed
in the same run. It prints the gather's speed over the link's (>= 1 keeps up alone) and the
link's speed while the threads gather (the two share host memory bandwidth).

``python3 tests/bench/bench_host_gather.py --json out.json``
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", default="1,2,4,8,16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for chunk_kib, layers in ((4, 80), (16, 40), (32, 32)):
        chunk = chunk_kib << 10
        pool = 2 * args.blocks
        host = [torch.randint(0, 256, (pool, 2 * chunk), dtype=torch.uint8).pin_memory() for _ in range(layers)]
        per_layer = 2 * chunk
        bounce = torch.empty(args.blocks, layers * per_layer, dtype=torch.uint8).pin_memory()
        nbytes = bounce.numel()
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        flat = bounce.view(-1)

        def link() -> float:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dev.copy_(flat, non_blocking=True)
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 1e3

        link_alone = statistics.median(link() for _ in range(args.reps))
        hosts = [h.numpy() for h in host]
        out = bounce.numpy().reshape(args.blocks, layers, per_layer)
        for k in map(int, args.threads.split(",")):
            ids = rng.choice(pool, args.blocks, replace=False)
            with ThreadPoolExecutor(k) as ex:
                def gather() -> float:
                    t = time.perf_counter()
                    list(ex.map(lambda layer: np.take(hosts[layer], ids, axis=0, out=out[:, layer]), range(layers)))
                    return time.perf_counter() - t

                gather()  # warm-up
                alone = statistics.median(gather() for _ in range(args.reps))
                # Beside the link: the copy runs while the threads gather the next slice.
                side = []
                for _ in range(args.reps):
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    dev.copy_(flat, non_blocking=True)
                    b.record()
                    gather()
                    b.synchronize()
                    side.append(a.elapsed_time(b) / 1e3)
            for layer in (0, layers - 1):  # the gather is right
                assert np.array_equal(out[:, layer], hosts[layer][ids])
            rows.append(dict(chunk_kib=chunk_kib, layers=layers, threads=k, bytes=nbytes,
                             gather_over_link=round(link_alone / alone, 3),
                             link_beside_over_alone=round(link_alone / statistics.median(side), 3)))
        del host, bounce, dev
    print(f"host: {torch.get_num_threads()} torch threads; {args.blocks} blocks a job; median of {args.reps}")
    print("| chunk | layers | threads | host gather / link | link beside gather / alone |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chunk_kib']} KiB | {r['layers']} | {r['threads']} | {r['gather_over_link']} | "
              f"{r['link_beside_over_alone']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
