"""Where a staged job's time goes: one job's device timeline, from its submit to its end.

Per-layer FlashAttention-shaped device KV against a block-major pinned host cache
(``kvswap.host_cache``), the staged route forced. For each direction and each way of
issuing (on the mover's issuing thread, or in ``submit``), one warm job is traced with
``torch.profiler`` and printed as a timeline relative to ``submit``'s start: the host
calls (kernel launches, batch copies, event records), the gathers or scatters, and the link
copies per stream. The job's measured time (its start and end markers) and the contiguous
copy of the same bytes are printed with it, so the gap between them can be read off.

``python3 tests/bench/diag_staged_timeline.py --layers 32 --heads 1 --blocks 512 --out DIR``
(llama-3.1-8b at TP 8: 4 KiB chunks, 256 KiB blocks). Writes ``DIR/timeline-<dir>-<way>.txt``
and the Chrome traces beside them with ``--traces``. ``--gap-ms`` leaves the machine idle before each
timed and traced job (a cold issuing thread and GPU), ``--pool`` spreads the blocks over larger pools.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import kvswap
from kvswap import BlockMover, Policy


def contiguous_seconds(nbytes: int, to_host: bool, reps: int = 5) -> float:
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        (h.copy_(d, non_blocking=True) if to_host else d.copy_(h, non_blocking=True))
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def summarize(trace: dict, t0_us: float) -> list[str]:
    """The trace's device and host events, relative to ``t0_us`` (submit's start, in the
    trace's clock), one line each, in time order."""
    rows = []
    for e in trace.get("traceEvents", []):
        cat = e.get("cat", "")
        if cat not in ("kernel", "gpu_memcpy", "cuda_runtime", "cuda_driver", "gpu_memset"):
            continue
        name = e.get("name", "")
        if cat in ("cuda_runtime", "cuda_driver") and not any(
                k in name for k in ("Launch", "Memcpy", "EventRecord", "StreamWait", "Batch")):
            continue
        ts, dur = float(e["ts"]) - t0_us, float(e.get("dur", 0))
        where = f"stream {e['args'].get('stream')}" if "stream" in e.get("args", {}) else f"tid {e.get('tid')}"
        rows.append((ts, f"{ts:9.1f} +{dur:8.1f} us  {cat:12s} {where:14s} {name[:70]}"))
    return [r for _, r in sorted(rows)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=1, help="KV heads a chunk holds (128-wide bf16, 16 tokens)")
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--reps", type=int, default=5, help="timed jobs per case (median)")
    p.add_argument("--out", type=Path, default=Path("staged-timeline"))
    p.add_argument("--traces", action="store_true", help="keep the Chrome traces")
    p.add_argument("--pool", type=int, default=0, help="blocks in each pool (default twice --blocks)")
    p.add_argument("--gap-ms", type=float, default=0.0,
                   help="idle time before each timed submit (the threads and the GPU left to go quiet)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda:0")
    pool = args.pool or 2 * args.blocks
    device = [torch.randint(-9, 9, (2, pool, 16, args.heads, 128), dtype=torch.int16, device=dev).view(torch.bfloat16)
              for _ in range(args.layers)]
    cache = kvswap.host_cache(device, pool, block_dim=1)
    cache.buffer.copy_(torch.randint(0, 256, cache.buffer.shape, dtype=torch.uint8))
    nbytes = args.blocks * cache.block_bytes
    rng = np.random.default_rng(0)
    summary = []
    for direction in ("d2h", "h2d"):
        src, dst = (list(cache.views), device) if direction == "h2d" else (device, list(cache.views))
        ceiling = contiguous_seconds(nbytes, direction == "d2h")
        sid = rng.choice(pool, args.blocks, replace=False)
        did = rng.choice(pool, args.blocks, replace=False)
        for way, thread in (("thread", True), ("submit", False)):
            mover = BlockMover(src, dst, direction, block_dim=1, policy=Policy(force="triton.staged"),
                               issuing_thread=thread)
            mover.wait(mover.submit(sid, did))  # warm-up (compiles, allocates the staging buffer)
            for t_src, t_dst in zip(src, dst):
                assert torch.equal(t_dst[:, did].view(torch.int16).cpu(), t_src[:, sid].view(torch.int16).cpu())
            measured, host = [], []
            for _ in range(args.reps):
                torch.cuda.synchronize()
                time.sleep(args.gap_ms / 1e3)
                a = time.perf_counter()
                job = mover.submit(sid, did)
                host.append(time.perf_counter() - a)
                mover.wait(job)
                (r,) = [x for x in mover.poll() if x.job_id == job]
                measured.append(r.seconds)
            torch.cuda.synchronize()
            med = statistics.median(measured)
            head = (f"{direction} {way}, gap {args.gap_ms:g} ms, pool {pool}: {args.blocks} blocks x {cache.block_bytes} B "
                    f"= {nbytes / 2**20:.1f} MiB; job {med * 1e3:.3f} ms (median of {args.reps}), contiguous copy "
                    f"{ceiling * 1e3:.3f} ms, ratio {ceiling / med:.3f}; submit held the thread "
                    f"{statistics.median(host) * 1e6:.0f} us")
            summary.append(head)
            print(head, flush=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                torch.cuda.synchronize()
                time.sleep(args.gap_ms / 1e3)
                with torch.profiler.record_function("kvswap.submit"):
                    job = mover.submit(sid, did)
                mover.wait(job)
                torch.cuda.synchronize()
            mover.poll()
            path = args.out / f"trace-{direction}-{way}.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
            t0 = min(float(e["ts"]) for e in trace["traceEvents"] if e.get("name") == "kvswap.submit")
            lines = summarize(trace, t0)
            if not args.traces:
                path.unlink()
            (args.out / f"timeline-{direction}-{way}.txt").write_text(head + "\n" + "\n".join(lines) + "\n")
            mover.close()
    (args.out / "summary.txt").write_text("\n".join(summary) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
