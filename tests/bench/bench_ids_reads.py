"""Where the by-id kernel should read its block ids: from the pinned launch buffer the
call wrote them to, or from device memory after an upload (GPU; not a test: it prints,
it asserts nothing). The figures behind ``HOST_IDS_PROGRAMS`` in
``backends/triton_generic/by_ids.py``.

For each direction, SM count (4, 8, 16, 32) and batch (256 to 10,000 blocks of two 4 KiB
chunks), the kernel's GPU time is taken queued behind a sleep on its stream (so the launch's
host time is hidden), both ways, median of 9; ``device/host`` above 1 means reading in
place was faster. Writes ``$OUT/ids_reads.json``.

    OUT=results python3 tests/bench/bench_ids_reads.py
"""
from __future__ import annotations

import json
import os
import statistics

import numpy as np

NB = 20_000  # blocks in each pool
KiB = 1024


def gpu_ms(fn, sid, did, stream, torch, reps=9) -> float:
    """The call's GPU time, queued behind a sleep so its host time does not count."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(10_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn(sid, did, stream)
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    import torch

    import kvswap
    from kvswap import BlockMover, Policy
    from kvswap.backends.triton_generic.by_ids import IdsLaunch
    from kvswap.calibration.step import exact_sms_calibration

    info = kvswap.resolve("h2d").plan.device
    host = torch.randint(-99, 99, (2, NB, 16, 1, 128), dtype=torch.bfloat16).pin_memory()
    gpu = torch.randint(-99, 99, (2, NB, 16, 1, 128), dtype=torch.bfloat16, device="cuda")
    rng = np.random.default_rng(0)
    rows = []
    for direction in ("h2d", "d2h"):
        src, dst = ([host], [gpu]) if direction == "h2d" else ([gpu], [host])
        for sms in (4, 8, 16, 32):
            mover = BlockMover(src, dst, direction, block_dim=1, policy=Policy(force="triton.kernel", max_sms=sms),
                               calibration=exact_sms_calibration(info, sms), issuing_thread=False)
            for n in (256, 1000, 2500, 5000, 10_000):
                sid = rng.choice(NB, n, replace=False).astype(np.int64)
                did = rng.choice(NB, n, replace=False).astype(np.int64)
                mover.wait(mover.submit(sid, did, after=None))  # binds and compiles
                fn = mover._plan.ids.at(n * mover.chunks_per_block)[0]
                plan = fn._plan(n)
                ms = {}
                for where in ("host", "device"):
                    fn._launches[n] = IdsLaunch(plan.n, plan.items, plan.grid, plan.tile, where)
                    ms[where] = gpu_ms(fn, sid, did, mover.stream, torch)
                fn._launches[n] = plan
                per_program = -(-plan.items // plan.tile.jobs) / plan.grid
                rows.append(dict(direction=direction, sms=sms, blocks=n, grid=plan.grid, tiles_per_program=per_program,
                                 rule=plan.ids, host_ms=ms["host"], device_ms=ms["device"],
                                 device_over_host=ms["device"] / ms["host"]))
                print(f"{direction} {sms:2d} SMs {n:6,} blocks: {per_program:6.1f} tiles/program, rule {plan.ids:6s} "
                      f"host {ms['host']:.3f} ms, device {ms['device']:.3f} ms, device/host "
                      f"{ms['device'] / ms['host']:.3f}", flush=True)
            mover.close()
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "ids_reads.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
