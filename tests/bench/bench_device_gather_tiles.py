"""The staged route's device side by tile shape: what keeps small chunks at memory speed
(GPU; not a test: it prints, it asserts nothing beyond each contender's bytes).

The staged route gathers (device to host) or scatters (host to device) a job's chunks
between the device KV cache and a device staging buffer, by block id, on ``DEVICE_SMS``
programs. Here the route's own kernel and launch shape (``shipped``) run against the same
copy written out below with other tile shapes (warps x rows x elements per step) and row
orders (a tile's rows the same piece of many blocks, or the pieces of one block), and a
contiguous device copy of the same bytes; GB/s of job bytes, medians of ``--reps``, the
contenders' turns rotating. Per-layer K/V of ``--layers`` layers, ``--blocks`` random
blocks of a cache of ``--cache-blocks``.

    python3 tests/bench/bench_device_gather_tiles.py --json $OUT/gather_tiles.json
    python3 tests/bench/bench_device_gather_tiles.py --render gather_tiles.json   # docs/benchmarks.md's table
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from types import SimpleNamespace

import numpy as np
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n", "pieces", "top"])
def rows_kernel(tmpl, ids, n, pieces, top, JOBS: tl.constexpr, WORDS: tl.constexpr, BLOCK_MAJOR: tl.constexpr,
                CACHE: tl.constexpr):
    """The by-id copy (every piece ``top`` 8-byte words), its rows piece- or block-major."""
    col = tl.arange(0, WORDS)
    total = n.to(tl.int64) * pieces
    for t in range(tl.program_id(0), tl.cdiv(total, JOBS), tl.num_programs(0)):
        j = tl.arange(0, JOBS).to(tl.int64) + t * JOBS
        live = j < total
        if BLOCK_MAJOR:
            i = tl.where(live, j // pieces, 0)
            p = tl.where(live, j - i * pieces, 0)
        else:
            p = tl.where(live, j // n, 0)
            i = tl.where(live, j - p * n, 0)
        sid = tl.load(ids + i, mask=live, other=0)
        did = tl.load(ids + n + i, mask=live, other=0)
        s = tl.load(tmpl + p, mask=live, other=0) + sid * tl.load(tmpl + pieces + p, mask=live, other=0)
        d = tl.load(tmpl + 2 * pieces + p, mask=live, other=0) + did * tl.load(tmpl + 3 * pieces + p, mask=live,
                                                                               other=0)
        nw = tl.load(tmpl + 4 * pieces + p, mask=live, other=0) >> 3
        sp = tl.multiple_of(s, 16).to(tl.pointer_type(tl.int64))
        dp = tl.multiple_of(d, 16).to(tl.pointer_type(tl.int64))
        for c in range(0, top, WORDS):
            rem = tl.multiple_of(tl.minimum(nw - c, WORDS).to(tl.int32), 2)
            mask = col[None, :] < rem[:, None]
            v = tl.load(tl.multiple_of(sp + c, 16)[:, None] + col[None, :], mask=mask, cache_modifier=CACHE)
            tl.store(tl.multiple_of(dp + c, 16)[:, None] + col[None, :], v, mask=mask)


def render(path: str) -> str:
    """The markdown table of a JSON this script wrote: per operation and chunk size, the shipped
    kernel's GB/s and its fraction of the contiguous device copy timed in the same run, and the
    best other contender's."""
    with open(path) as f:
        data = json.load(f)
    lines = [f"{data['device']}, {data['sms']} programs; GB/s of job bytes (fraction of a contiguous device copy "
             "of the same bytes, same run)", "",
             "| op | chunk | contiguous | shipped | best other shape |", "|---|---|---|---|---|"]
    for r in data["records"]:
        c, g = r["contiguous_gbps"], dict(r["gbps"])
        shipped = g.pop("shipped")
        best = max(g, key=g.get)
        lines.append(f"| {r['op']} | {r['chunk_bytes'] >> 10} KiB | {c:.0f} | {shipped:.0f} ({shipped / c:.2f}) | "
                     f"{best}: {g[best]:.0f} ({g[best] / c:.2f}) |")
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="4,16,32", help="chunk sizes, KiB")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=512, help="blocks per job")
    ap.add_argument("--cache-blocks", type=int, default=1024, help="blocks of the device KV cache")
    ap.add_argument("--shapes", default="32x32x8192,32x128x8192,32x256x16384,16x128x8192,32x128x4096",
                    help="warps x rows x tile elements, comma-separated")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default="")
    ap.add_argument("--render", metavar="FILE.json", help="measure nothing: print the table of a JSON this wrote")
    args = ap.parse_args(argv)
    if args.render:
        print(render(args.render))
        return 0

    import torch

    from kvswap.backends.triton_generic.by_ids import KernelCopyByIds
    from kvswap.backends.triton_generic.launch import DEFAULT_PLANS, TilePlan
    from kvswap.backends.triton_generic.staged import DEVICE_SMS

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    shipped = KernelCopyByIds(num_sms=DEVICE_SMS, device_index=0, tiles=TilePlan.from_params({}, DEFAULT_PLANS["d2d"]))
    s = torch.cuda.Stream(dev)
    gen = np.random.default_rng(0)

    def timed(fn) -> float:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(s):
            e0.record()
            fn()
            e1.record()
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / 1e3

    records = []
    for kib in [int(x) for x in args.chunks.split(",")]:
        chunk = kib << 10
        kv = [torch.randint(0, 255, (2, args.cache_blocks, chunk), dtype=torch.uint8, device=dev)
              for _ in range(args.layers)]
        pieces, n = 2 * args.layers, args.blocks
        job = n * pieces * chunk
        staging = torch.empty(job, dtype=torch.uint8, device=dev)
        contig = torch.empty(job, dtype=torch.uint8, device=dev)
        ids = gen.choice(args.cache_blocks, n, replace=False).astype(np.int64)
        slots = np.arange(n, dtype=np.int64)
        kv_base = np.array([[t[0].data_ptr(), t[1].data_ptr()] for t in kv], dtype=np.int64).ravel()
        stage_base = staging.data_ptr() + np.arange(pieces, dtype=np.int64) * chunk
        block_stride = pieces * chunk
        ref_stage = torch.cat([kv[l][k][torch.as_tensor(ids, device=dev)].reshape(n, 1, chunk)
                               for l in range(args.layers) for k in range(2)], dim=1).reshape(-1)
        for d in ("gather", "scatter"):
            to_stage = d == "gather"
            one = np.ones(pieces, dtype=np.int64)
            z = np.full(pieces, chunk, dtype=np.int64)
            if to_stage:
                tmpl = SimpleNamespace(src_base=kv_base, src_stride=one * chunk, dst_base=stage_base,
                                       dst_stride=one * block_stride, sizes=z)
                sid, did = ids, slots
            else:
                tmpl = SimpleNamespace(src_base=stage_base, src_stride=one * block_stride, dst_base=kv_base,
                                       dst_stride=one * chunk, sizes=z)
                sid, did = slots, ids
            fn = shipped.by_ids(tmpl)
            packed = torch.from_numpy(np.concatenate([tmpl.src_base, tmpl.src_stride, tmpl.dst_base,
                                                      tmpl.dst_stride, tmpl.sizes]).astype(np.int64)).to(dev)
            dids = torch.from_numpy(np.concatenate([sid, did])).to(dev)
            contenders = {"shipped": lambda: fn(sid, did, s.cuda_stream)}
            for shape in args.shapes.split(","):
                w, r, te = (int(x) for x in shape.split("x"))
                words = max(32, min(chunk // 8, te // r))
                for order in (0, 1):
                    def launch(w=w, r=r, words=words, order=order):
                        rows_kernel[(DEVICE_SMS,)](packed, dids, n, pieces, chunk // 8, JOBS=r, WORDS=words,
                                                   BLOCK_MAJOR=order, CACHE=".cg", num_warps=w)
                    contenders[f"w{w} r{r} x{words} {'block' if order else 'piece'}-major"] = launch

            def check(name, run):
                if to_stage:
                    staging.fill_(0x5A)
                    timed(run)
                    ok = torch.equal(staging, ref_stage)
                else:
                    staging.copy_(ref_stage)
                    saved = [t.clone() for t in kv]
                    for t in kv:
                        for k in range(2):
                            t[k][torch.as_tensor(ids, device=dev)] = 0x5A
                    timed(run)
                    ok = all(torch.equal(t, u) for t, u in zip(kv, saved))
                if not ok:
                    raise SystemExit(f"{name} moved wrong bytes ({d}, {kib} KiB)")

            for name, run in contenders.items():
                check(name, run)
            times = {name: [] for name in contenders}
            ref = []
            for rep in range(args.reps):
                ref.append(timed(lambda: contig.copy_(staging, non_blocking=True)))
                names = list(contenders)
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    times[name].append(timed(contenders[name]))
            ref_s = statistics.median(ref)
            row = {"op": d, "chunk_bytes": chunk, "job_bytes": job, "contiguous_gbps": job / ref_s / 1e9,
                   "gbps": {k: job / statistics.median(v) / 1e9 for k, v in times.items()}}
            records.append(row)
            best = max(row["gbps"], key=row["gbps"].get)
            print(f"{d} {kib:2d} KiB: contiguous {row['contiguous_gbps']:.0f} GB/s; "
                  + ", ".join(f"{k} {g:.0f}" for k, g in row["gbps"].items()) + f"; best {best}", flush=True)
        del kv, staging, contig
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "sms": DEVICE_SMS, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
