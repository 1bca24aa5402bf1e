"""How much slower BlockMover is on pageable host memory than on pinned (not a test).

For each model shape (``kvswap.cli.models``), direction and job size, two movers over the same
device tensors: one with pinned host tensors, one with pageable host tensors (staged
through kvswap's pinned buffers). Jobs alternate between the two, so drift hits both
alike. Per job it times, on the host clock:

* ``submit_us``: how long ``submit`` holds the calling thread (for pageable host-to-device
  this includes copying the blocks into the bounce buffer);
* ``job_ms``: from the start of ``submit`` until ``wait`` returns, i.e. until the bytes
  are in place (for pageable device-to-host, copied out of the bounce buffer);

and prints the medians with the pageable/pinned ratio (the slowdown), measured in this
one run, for each number of host copy threads in ``--copy-threads`` (the bounce copy of
a large job is split over threads; ``kvswap.memory.bounce.COPY_THREADS`` is the default). Every job's bytes are checked on sampled blocks. JSON goes to ``--json`` or to
``$OUT/bench_pageable.json``.

    python tests/bench/bench_pageable.py [--models llama-3.1-8b,qwen2.5-7b] [--blocks 32,512] [--reps 15]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from typing import Any

import numpy as np
import torch

import kvswap
from kvswap import BlockMover, PageableMemoryWarning
from kvswap.cli import models
from kvswap.memory import bounce


def _tensors(cache: Any, blocks: int, where: str, pinned: bool = False) -> list[torch.Tensor]:
    dtype = getattr(torch, cache.model.dtype)
    out = []
    for _ in range(cache.model.layers):
        t = torch.empty(cache.tensor_shape(blocks), dtype=dtype, device=where, pin_memory=pinned and where == "cpu")
        t.view(torch.uint8).random_(0, 256)
        out.append(t)
    return out


def _check(cache: Any, src: list, dst: list, sid: np.ndarray, did: np.ndarray, rng: np.random.Generator) -> int:
    """Compare a few sampled blocks of a few layers; returns the bytes compared."""
    bd = cache.block_dim
    checked = 0
    for layer in rng.choice(len(src), min(3, len(src)), replace=False):
        for k in rng.choice(len(sid), min(4, len(sid)), replace=False):
            a = src[layer].select(bd, int(sid[k])).cpu()
            b = dst[layer].select(bd, int(did[k])).cpu()
            if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                raise AssertionError(f"layer {layer}, block {sid[k]} -> {did[k]}: bytes differ")
            checked += a.numel() * a.element_size()
    return checked


def run(names: list[str], blocks: list[int], reps: int, pool_blocks: int, tp: int,
        copy_threads: list[int]) -> list[dict[str, Any]]:
    rows = []
    rng = np.random.default_rng(0)
    for name in names:
        cache = models.get(name).at(tp=tp)
        device = _tensors(cache, pool_blocks, "cuda")
        hosts = {"pinned": _tensors(cache, pool_blocks, "cpu", pinned=True),
                 "pageable": _tensors(cache, pool_blocks, "cpu", pinned=False)}
        for direction in ("h2d", "d2h"):
            movers = {}
            for memory, host in hosts.items():
                src, dst = (host, device) if direction == "h2d" else (device, host)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", PageableMemoryWarning)
                    movers[memory] = (BlockMover(src, dst, direction, block_dim=cache.block_dim), src, dst)
                assert movers[memory][0].bounces_host_memory == (memory == "pageable")
            variants = [("pinned", "pinned", None)] + [(f"pageable_t{t}", "pageable", t) for t in copy_threads]
            for n in blocks:
                times: dict[str, dict[str, list[float]]] = {v: {"submit": [], "job": []} for v, _, _ in variants}
                checked = 0
                for rep in range(reps + 2):  # two warm-ups
                    for variant, memory, threads in variants:
                        mover, src, dst = movers[memory]
                        if threads is not None:
                            bounce.COPY_THREADS = threads
                        sid = rng.choice(pool_blocks, n, replace=False)
                        did = rng.choice(pool_blocks, n, replace=False)
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        job = mover.submit(sid, did)
                        t1 = time.perf_counter()
                        mover.wait(job)
                        t2 = time.perf_counter()
                        (result,) = mover.poll()
                        assert result.ok, result
                        if rep >= 2:
                            times[variant]["submit"].append((t1 - t0) * 1e6)
                            times[variant]["job"].append((t2 - t0) * 1e3)
                        checked += _check(cache, src, dst, sid, did, rng)
                med = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
                nbytes = n * cache.block_bytes
                pin = med["pinned"]
                for variant, memory, threads in variants[1:]:
                    got = med[variant]
                    row = {
                        "model": name, "tp": tp, "direction": direction, "blocks": n, "copy_threads": threads,
                        "chunk_bytes": cache.chunk_bytes, "bytes": nbytes, "reps": reps,
                        "route": ", ".join(movers["pinned"][0].swap_fn.impls),
                        "pinned_job_ms": pin["job"], "pageable_job_ms": got["job"],
                        "pinned_submit_us": pin["submit"], "pageable_submit_us": got["submit"],
                        "pinned_gbps": nbytes / pin["job"] / 1e6, "pageable_gbps": nbytes / got["job"] / 1e6,
                        "slowdown": got["job"] / pin["job"], "bytes_checked": checked,
                    }
                    rows.append(row)
                    print(f"{name:>14} {direction} {n:>5} blocks {nbytes / 2**20:8.1f} MiB | pinned "
                          f"{row['pinned_job_ms']:8.2f} ms {row['pinned_gbps']:6.1f} GB/s submit "
                          f"{row['pinned_submit_us']:8.0f} us | pageable ({threads} thr) {row['pageable_job_ms']:8.2f} ms "
                          f"{row['pageable_gbps']:6.1f} GB/s submit {row['pageable_submit_us']:8.0f} us "
                          f"| slowdown x{row['slowdown']:.2f}", flush=True)
            for mover, _, _ in movers.values():
                mover.close()
        del device, hosts
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama-3.1-8b,qwen2.5-7b,deepseek-v3")
    ap.add_argument("--blocks", default="32,512")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pool-blocks", type=int, default=1024, help="blocks in each side's tensors")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--copy-threads", default="1,8",
                    help="host copy threads of the bounce copies to compare (default: 1 and kvswap's default)")
    ap.add_argument("--json", help="write results here (default: $OUT/bench_pageable.json when OUT is set)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pageable.py needs a GPU")
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    blocks = [int(b) for b in args.blocks.split(",")]
    threads = list(dict.fromkeys(int(t) for t in args.copy_threads.split(",")))
    rows = run(names, blocks, args.reps, args.pool_blocks, args.tp, threads)
    summary = {}
    for t in threads:
        ratios = [r["slowdown"] for r in rows if r["copy_threads"] == t]
        geo = float(np.exp(np.mean(np.log(ratios))))
        summary[str(t)] = {"geomean": geo, "min": min(ratios), "max": max(ratios)}
        print(f"pageable / pinned job time, {t} copy thread(s): geomean x{geo:.2f}, range "
              f"x{min(ratios):.2f}-x{max(ratios):.2f} over {len(ratios)} points, measured in this run")
    doc = {"kvswap_version": kvswap.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
           "host": platform.node(), "cpu_count": os.cpu_count(), "slowdown_by_copy_threads": summary, "rows": rows}
    path = args.json or (os.path.join(os.environ["OUT"], "bench_pageable.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
