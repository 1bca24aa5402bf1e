"""Whether replaying small kernel copies from CUDA graphs (backends/triton_generic/graphs.py)
makes them cheaper than launching them.

For each direction and batch of scattered 4 KiB blocks, the copy kernel that ``triton.kernel``
binds, three ways, each call on fresh random blocks:

* ``plain``: the bound transfer with its graphs turned off (descriptors packed into its
  pinned launch buffer, the compiled variant launched on the raw stream);
* ``graphed``: the bound transfer as it ships: once a launch shape was seen twice, its
  calls replay a graph captured over fixed pinned buffers;
* ``floor``: one graph captured here over one fixed buffer and replayed, none of the
  call's bookkeeping (what a replay costs at least).

Per way: the GPU time from an idle stream to the copy's end (``kvswap bench``'s timing) and the
time the call holds the thread, medians, as ratios to ``plain``; every way's bytes checked
once (poisoned first).

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
    batch = pools.batch(direction, BLOCK, n)
    bound = []
    for _ in range(2):  # two SwapFns, two bound launchers: one keeps its graphs, one does not
        fn = kvswap.resolve(direction, device=dev.torch_device, policy=Policy(force="triton.kernel"))
        ((impl, sms, _),) = fn.assign(batch.src, batch.dst, batch.sizes)
        bound.append(fn._fns[(impl, sms)])
    kc, plain_kc = bound
    if getattr(kc, "variants", None) is None or kc is plain_kc:
        return dict(direction=direction, n=n, route=impl, note="not a kernel of its own at this batch")
    plain_kc._graphs.failed = "turned off by the benchmark"
    s = torch.cuda.Stream(device=dev.index or 0)
    for k in (kc, kc, plain_kc):  # the second sighting of the shape captures kc's graphs
        k(batch.src, batch.dst, batch.sizes, s)
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

    def plain(stream):
        b = fresh()
        plain_kc(b.src, b.dst, b.sizes, stream)

    def graphed(stream):
        b = fresh()
        kc(b.src, b.dst, b.sizes, stream)

    graph = torch.cuda.CUDAGraph()
    cap = torch.cuda.Stream(device=dev.index or 0)
    with torch.cuda.graph(graph, stream=cap):
        kc.variants.launch(variant, launch.tile, launch.grid, fixed.data_ptr(), n, launch.tile.splits,
                           cap.cuda_stream)

    def floor(stream):
        b = fresh()
        view[:n], view[n:2 * n], view[2 * n:] = b.src, b.dst, b.sizes
        graph.replay()

    ways = (plain, graphed, floor)
    timer = DeviceTimer(dev)
    for way in ways:  # each way's bytes, once, on the draw it copies next
        turn[0] = 0
        pools.verify(timer, way, draws[0])
    gpu = [statistics.median(t) for t in timer.measure(list(ways), reps)]
    with torch.cuda.stream(s):
        host = [held_us(w, s, reps) for w in ways]
    graphs = kc._graphs
    return dict(direction=direction, n=n, route=f"{impl}@{sms}", grid=launch.grid, descriptors=launch.descriptors,
                graphs=len(graphs._rings), graph_failure=graphs.failed,
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
    print(f"device {torch.cuda.get_device_name()}: 4 KiB blocks on triton.kernel, plain launch / graphed "
          f"(as shipped) / one bare replay (median of {args.reps})")
    print("| dir | n | route | shapes graphed | GPU us plain | graphed / plain | floor / plain | thread us plain | "
          "graphed / plain | floor / plain |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "note" in r:
            print(f"| {r['direction']} | {r['n']} | {r['route']} | {r['note']} | | | | | | |")
            continue
        g, h = r["gpu_us"], r["host_us"]
        shapes = r["graphs"] if r["graph_failure"] is None else f"failed: {r['graph_failure']}"
        print(f"| {r['direction']} | {r['n']} | {r['route']} | {shapes} | {g[0]} | {g[1] / g[0]:.3f} | {g[2] / g[0]:.3f} | "
              f"{h[0]} | {h[1] / h[0]:.3f} | {h[2] / h[0]:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
