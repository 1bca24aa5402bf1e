"""A SwapFn call against the same kernel launched with its descriptors already on the GPU.

For each direction and (block size, batch), scattered blocks at random distinct slots of a
2 GiB pool on each side: the resolved SwapFn called from an idle stream (its host work,
upload and copy, as ``kvswap bench`` times it), and the very kernel variant it launched
(same SM count and launch shape) launched again over the same descriptors, packed once
into device memory beforehand. The ratio resident/SwapFn time is what the call's own
host work and descriptor upload cost; 1.0 means none. Both are checked once (sampled
blocks, every byte, poisoned first). Where the resolved route is not a kernel, the row says which it is.

``python3 tests/bench/bench_resident.py --json resident.json`` (default 4 KiB x 10,000)
"""
from __future__ import annotations

import argparse
import json
import statistics

import numpy as np
import torch

import kvswap
from kvswap.calibration.timing import DeviceTimer
from kvswap.calibration.workload import Pools
from kvswap.registry.platform import detect
from kvswap.registry.plugins import plugin_host


def run(direction: str, block: int, n: int, pools: Pools, reps: int) -> dict:
    dev = pools.device
    fn = kvswap.resolve(direction, device=dev.torch_device)
    batch = pools.batch(direction, block, n)
    src, dst, sizes = batch.src, batch.dst, batch.sizes
    ((impl, sms, _),) = fn.assign(src, dst, sizes)
    row = dict(direction=direction, block_bytes=block, n=n, route=f"{impl}@{sms}" if sms else impl)
    kc = fn._fns.get((impl, sms))  # the bound transfer the SwapFn launches (a KernelCopy for a kernel)
    if not hasattr(kc, "variants") or kc.variants is None:
        row["note"] = "the resolved route is not a kernel: nothing to compare"
        return row
    s = torch.cuda.Stream(device=dev.index or 0)
    fn(src, dst, sizes, stream=s)
    s.synchronize()
    launch = kc.last_launch
    a, b = src, dst
    if kc._translate_src is not None:
        a = np.asarray(kc._translate_src(a), dtype=np.int64)
    if kc._translate_dst is not None:
        b = np.asarray(kc._translate_dst(b), dtype=np.int64)
    packed = torch.from_numpy(np.concatenate((a, b, sizes)).astype(np.int64)).to(f"cuda:{dev.index or 0}")
    variant = kc.variants.get(launch.tile)

    def swapfn(stream):
        fn(src, dst, sizes, stream=stream)

    def resident(stream):
        kc.variants.launch(variant, launch.tile, launch.grid, packed.data_ptr(), n, launch.tile.splits,
                           stream.cuda_stream)

    timer = DeviceTimer(dev)
    for call in (swapfn, resident):  # each checked: sampled destinations poisoned, copied, compared
        pools.verify(timer, call, batch)
    t_fn, t_res = (statistics.median(x) for x in timer.measure([swapfn, resident], reps))
    nbytes = int(sizes.sum())
    row.update(grid=launch.grid, descriptors=launch.descriptors, swapfn_gbps=round(nbytes / t_fn / 1e9, 2),
               resident_gbps=round(nbytes / t_res / 1e9, 2), swapfn_over_resident=round(t_res / t_fn, 3))
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", default="4096", help="block sizes in bytes, comma-separated")
    p.add_argument("--batches", default="10000", help="descriptors per call, comma-separated")
    p.add_argument("--reps", type=int, default=41)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = detect(plugin_host(), "cuda:0")
    pools = Pools(dev, 2048 << 20)
    rows = [run(d, int(b), int(n), pools, args.reps) for d in ("h2d", "d2h")
            for b in args.blocks.split(",") for n in args.batches.split(",")]
    print(f"device {torch.cuda.get_device_name()}: SwapFn from an idle stream vs the same kernel with "
          f"descriptors already on the GPU (median of {args.reps})")
    print("| dir | block | n | route | SwapFn GB/s | resident GB/s | SwapFn / resident |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['direction']} | {r['block_bytes']} | {r['n']} | {r['route']} | {r.get('swapfn_gbps', '-')} | "
              f"{r.get('resident_gbps', '-')} | {r.get('swapfn_over_resident', r.get('note', ''))} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
