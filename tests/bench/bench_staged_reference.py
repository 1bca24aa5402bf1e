"""A staged job against the plainest staged copy (GPU; not a test: it prints, it asserts
nothing beyond each contender's bytes).

Per-layer FlashAttention KV on the device (``layers`` tensors of ``[2, blocks, 16 tokens,
kv_heads, 128]`` bf16) and a block-major pinned host cache (:func:`kvswap.host_cache`), jobs
of random blocks. Each contender's transfer alone, from an idle device to its completion on
the host's clock (so the host work of the call counts), as a fraction of a contiguous copy of
the same bytes timed the same way, medians of ``--reps``, turns rotating:

* ``kvswap``: the default BlockMover's job (the staged route, its slices pipelined);
* ``reference``: one by-id kernel launch gathering (device to host) or scattering (host to
  device) every block between the device tensors and a device buffer of the whole job, and
  one ``cuMemcpyBatchAsync`` call with one descriptor per block, one after the other on one
  stream, nothing pipelined.

    python3 tests/bench/bench_staged_reference.py --json $OUT/staged_reference.json
    python3 tests/bench/bench_staged_reference.py --render staged_reference.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace

import numpy as np

TOKENS, HEAD_DIM = 16, 128
CASES = "32x8x32,28x4x128,28x2x512,32x1x512,80x1x512,32x8x512"  # layers x kv heads x blocks


def render(path: str) -> str:
    """The markdown table of a JSON this script wrote."""
    with open(path) as f:
        data = json.load(f)
    lines = [f"{data['device']}; transfer alone / contiguous copy of the same bytes (median of {data['reps']})", "",
             "| case | chunk | kvswap h2d / d2h | reference h2d / d2h | kvswap / reference, worst |",
             "|---|---|---|---|---|"]
    by_case: dict = {}
    for r in data["records"]:
        by_case.setdefault(r["case"], {})[r["direction"]] = r
    for case, rows in by_case.items():
        h, d = rows.get("h2d"), rows.get("d2h")
        if h is None or d is None:
            continue
        worst = min(h["kvswap"] / h["reference"], d["kvswap"] / d["reference"])
        lines.append(f"| {case} | {h['chunk_bytes'] >> 10} KiB | {h['kvswap']:.2f} / {d['kvswap']:.2f} | "
                     f"{h['reference']:.2f} / {d['reference']:.2f} | {worst:.2f} |")
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=CASES, help="layers x kv heads x blocks, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--render", metavar="FILE.json", help="measure nothing: print the table of a JSON this wrote")
    args = ap.parse_args(argv)
    if args.render:
        print(render(args.render))
        return 0

    import torch

    import kvswap
    from kvswap import BlockMover
    from kvswap.backends.cuda import batch, driver
    from kvswap.backends.triton_generic.by_ids import KernelCopyByIds
    from kvswap.backends.triton_generic.launch import DEFAULT_PLANS
    from kvswap.backends.triton_generic.staged import DEVICE_SMS
    from kvswap.types import Direction

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    kernel = KernelCopyByIds(num_sms=DEVICE_SMS, device_index=0, tiles=DEFAULT_PLANS["d2d"])
    links = {d: batch.bind(driver.get(), Direction.parse(d), 0) for d in ("h2d", "d2h")}
    s = torch.cuda.Stream(dev)
    rng = np.random.default_rng(0)

    def wall(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    records = []
    for case in args.cases.split(","):
        layers, heads, n = (int(x) for x in case.split("x"))
        chunk = TOKENS * heads * HEAD_DIM * 2
        cache_blocks = max(2 * n, 64)
        kv = [torch.randint(-(1 << 15), 1 << 15, (2, cache_blocks, TOKENS, heads, HEAD_DIM), dtype=torch.int16,
                            device=dev).view(torch.bfloat16) for _ in range(layers)]
        host = kvswap.host_cache(kv, cache_blocks, block_dim=1)
        host.buffer.copy_(torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8))
        block = host.block_bytes
        job = n * block
        pieces = 2 * layers
        stage = torch.empty(job, dtype=torch.uint8, device=dev)
        contig_dev = torch.empty(job, dtype=torch.uint8, device=dev)
        contig_host = torch.empty(job, dtype=torch.uint8, pin_memory=True)
        # Piece (layer, K or V) of a block: its device chunk, and its place in a host block.
        dev_base = np.array([[t.data_ptr() + k * cache_blocks * chunk for k in range(2)] for t in kv],
                            dtype=np.int64).ravel()
        in_block = np.array([[host.offsets[l] + k * chunk for k in range(2)] for l in range(layers)],
                            dtype=np.int64).ravel()
        one = np.ones(pieces, dtype=np.int64)
        sizes = one * chunk
        gather = kernel.by_ids(SimpleNamespace(src_base=dev_base, src_stride=one * chunk, dst_base=stage.data_ptr()
                                               + in_block, dst_stride=one * block, sizes=sizes))
        scatter = kernel.by_ids(SimpleNamespace(src_base=stage.data_ptr() + in_block, src_stride=one * block,
                                                dst_base=dev_base, dst_stride=one * chunk, sizes=sizes))
        slots = np.arange(n, dtype=np.int64)
        stage_runs = stage.data_ptr() + slots * block
        for direction in ("d2h", "h2d"):
            to_host = direction == "d2h"
            dev_ids = rng.choice(cache_blocks, n, replace=False).astype(np.int64)
            host_ids = rng.choice(cache_blocks, n, replace=False).astype(np.int64)
            host_runs = host.buffer.data_ptr() + host_ids * block
            z = np.full(n, block, dtype=np.int64)
            link = links[direction]
            mover = (BlockMover(kv, list(host.views), "d2h", block_dim=1) if to_host
                     else BlockMover(list(host.views), kv, "h2d", block_dim=1))
            sid, did = (dev_ids, host_ids) if to_host else (host_ids, dev_ids)

            def kvswap_job() -> None:
                mover.wait(mover.submit(sid, did))
                mover.poll()

            def reference() -> None:
                with torch.cuda.stream(s):
                    if to_host:
                        gather(dev_ids, slots, s.cuda_stream)
                        link(stage_runs, host_runs, z, s.cuda_stream)
                    else:
                        link(host_runs, stage_runs, z, s.cuda_stream)
                        scatter(slots, dev_ids, s.cuda_stream)

            def contiguous() -> None:
                with torch.cuda.stream(s):
                    (contig_host.copy_(contig_dev, non_blocking=True) if to_host
                     else contig_dev.copy_(contig_host, non_blocking=True))

            contenders = {"kvswap": kvswap_job, "reference": reference}
            # Every contender's bytes, once: the job's blocks where they belong, nothing else touched.
            for name, fn in contenders.items():
                if to_host:
                    poison = torch.randint(0, 256, host.buffer.shape, dtype=torch.uint8)
                    host.buffer.copy_(poison)
                    wall(fn)
                    want = poison.clone()
                    want[torch.as_tensor(host_ids)] = torch.cat(
                        [t[:, torch.as_tensor(dev_ids, device=dev)].permute(1, 0, 2, 3, 4).reshape(n, -1).view(
                            torch.uint8).cpu() for t in kv], dim=1)
                    ok = torch.equal(host.buffer, want)
                else:
                    before = [t.clone() for t in kv]
                    wall(fn)
                    ok = True
                    for l, (t, b) in enumerate(zip(kv, before)):
                        exp = b.clone()
                        src = host.views[l][:, torch.as_tensor(host_ids)].to(dev)
                        exp[:, torch.as_tensor(dev_ids, device=dev)] = src
                        ok = ok and torch.equal(t.view(torch.int16), exp.view(torch.int16))
                        t.copy_(b)
                if not ok:
                    raise SystemExit(f"{name} moved wrong bytes ({case}, {direction})")
            times: dict = {name: [] for name in contenders}
            ceiling = []
            names = list(contenders)
            for rep in range(args.reps):
                ceiling.append(wall(contiguous))
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    times[name].append(wall(contenders[name]))
            mover.close()
            c = statistics.median(ceiling)
            row = {"case": case, "direction": direction, "chunk_bytes": chunk, "job_bytes": job,
                   **{k: c / statistics.median(v) for k, v in times.items()}}
            records.append(row)
            print(f"{case} {direction} {chunk >> 10} KiB: of the contiguous copy, kvswap {row['kvswap']:.2f}, "
                  f"reference {row['reference']:.2f}", flush=True)
        del kv, host, stage, contig_dev, contig_host
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "reps": args.reps, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
