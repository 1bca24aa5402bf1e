"""Whether a CUDA graph makes a small kernel copy cheaper than launching it.

For each direction and batch of scattered 4 KiB blocks, the copy kernel that ``triton.kernel``
binds, three ways, each call on fresh random blocks:

* ``call``: the bound transfer as a SwapFn calls it (descriptors packed into its pinned
  staging buffer, the compiled variant launched on the raw stream);
* ``launch``: the same variant launched over descriptors already packed in a fixed pinned
  buffer (packing and launching only, none of the call's bookkeeping);
* ``graph``: that launch captured once as a CUDA graph over the fixed buffer and replayed
  (the descriptors written into the buffer each call, as a graph needs fixed addresses).

Per way: the GPU time from an idle stream to the copy's end (``kvswap bench``'s timing) and the
time the call holds the thread, medians, as ratios to ``call``; every way's bytes checked
once (sampled blocks, poisoned first).

``python3 tests/bench/bench_graph_launch.py --json graph.json``
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import kvswap
from kvswap import Policy
from kvswap.calibration.timing import DeviceTimer
from kvswap.calibration.workload import Pools
from kvswap.registry.platform import detect
from kvswap.registry.plugins import plugin_host

BLOCK = 4096


def held_us(call, stream, reps: int) -> float:
    out = []
    for _ in range(reps):
        stream.synchronize()
        t = time.perf_counter_ns()
        call(stream)
        out.append((time.perf_counter_ns() - t) / 1e3)
    stream.synchronize()
    return statistics.median(out)


def run(direction: str, n: int, pools: Pools, reps: int) -> dict:
    dev = pools.device
    fn = kvswap.resolve(direction, device=dev.torch_device, policy=Policy(force="triton.kernel"))
    batch = pools.batch(direction, BLOCK, n)
    ((impl, sms, _),) = fn.assign(batch.src, batch.dst, batch.sizes)
    kc = fn._fns[(impl, sms)]
    if getattr(kc, "variants", None) is None:
        return dict(direction=direction, n=n, route=impl, note="not a kernel at this batch")
    s = torch.cuda.Stream(device=dev.index or 0)
    kc(batch.src, batch.dst, batch.sizes, s)
    s.synchronize()
    launch = kc.last_launch
    variant = kc.variants.get(launch.tile)
    fixed = torch.empty(3 * n, dtype=torch.int64).pin_memory()
    view = fixed.numpy()
    draws = [pools.batch(direction, BLOCK, n) for _ in range(8)]
    turn = [0]

    def fresh():
        b = draws[turn[0] % len(draws)]
        turn[0] += 1
        return b

    def pack(b) -> None:
        view[:n], view[n:2 * n], view[2 * n:] = b.src, b.dst, b.sizes

    def call(stream):
        b = fresh()
        kc(b.src, b.dst, b.sizes, stream)

    def launched(stream):
        pack(fresh())
        kc.variants.launch(variant, launch.tile, launch.grid, fixed.data_ptr(), n, launch.tile.splits,
                           stream.cuda_stream)

    graph = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream(device=dev.index or 0)
    pack(batch)
    with torch.cuda.graph(graph, stream=cap):
        kc.variants.launch(variant, launch.tile, launch.grid, fixed.data_ptr(), n, launch.tile.splits,
                           cap.cuda_stream)

    def replayed(stream):
        pack(fresh())
        graph.replay()

    timer = DeviceTimer(dev)
    for way in (call, launched, replayed):  # each way's bytes, once, on the draw it copies next
        turn[0] = 0
        pools.verify(timer, way, draws[0])
    gpu = [statistics.median(t) for t in timer.measure([call, launched, replayed], reps)]
    with torch.cuda.stream(s):
        host = [held_us(w, s, reps) for w in (call, launched, replayed)]
    return dict(direction=direction, n=n, route=f"{impl}@{sms}", grid=launch.grid, descriptors=launch.descriptors,
                gpu_us=[round(g * 1e6, 1) for g in gpu], host_us=[round(h, 1) for h in host])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--reps", type=int, default=101)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dev = detect(plugin_host(), "cuda:0")
    pools = Pools(dev, 256 << 20)
    rows = [run(d, int(n), pools, args.reps) for d in ("h2d", "d2h") for n in args.batches.split(",")]
    print(f"device {torch.cuda.get_device_name()}: 4 KiB blocks on triton.kernel, call / launch over a fixed "
          f"buffer / CUDA graph replay (median of {args.reps})")
    print("| dir | n | route | GPU us call | launch / call | graph / call | host us call | launch / call | graph / call |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "note" in r:
            print(f"| {r['direction']} | {r['n']} | {r['route']} | {r['note']} | | | | | |")
            continue
        g, h = r["gpu_us"], r["host_us"]
        print(f"| {r['direction']} | {r['n']} | {r['route']} | {g[0]} | {g[1] / g[0]:.3f} | {g[2] / g[0]:.3f} | "
              f"{h[0]} | {h[1] / h[0]:.3f} | {h[2] / h[0]:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
