"""How much compute a route costs: a reference GEMM stream timed alone and beside copies.

A copy kernel's SMs are not free, and even the copy engine competes for memory bandwidth
(docs/design.md). For each route this times a window of GEMMs alone, then the same window
while the route copies 16 KiB blocks on another stream, and records the fraction of GEMM
throughput lost. Both streams are held behind a short sleep kernel until everything is
enqueued, so they start together; a run in which the copies end before the GEMMs is
repeated with more copies, and flagged if it still is not covered.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from kvswap import Direction

from .binding import Bound, Failures
from .progress import Progress
from .records import Interference
from .timing import median
from .workload import Pools

KiB = 1024
GEMM_N = 4096  # the reference: a bf16 4096^3 GEMM, large enough to keep every SM busy
BLOCK = 16 * KiB  # a typical KV-cache block
WINDOW_S = 0.02  # GEMM window per measurement
COVER = 3.0  # copies enqueued for COVER x the GEMM window alone: tolerates a 3x slowdown
GATE_CYCLES = 200_000_000  # ~0.1 s at 2 GHz: time to enqueue both streams before either runs
ROUNDS = 3


def measure_interference(pools: Pools, timer: Any, direction: Direction, bounds: Sequence[Bound], *,
                         max_batch: int, seed: int, failures: Failures, progress: Progress) -> list[Interference]:
    """One :class:`Interference` per route in ``bounds`` (and the contiguous copy), each
    copying up to ``max_batch`` blocks of ``BLOCK`` from ``pools`` on ``timer``'s stream
    (a :class:`~.timing.DeviceTimer`); a route that fails goes to ``failures``."""
    import torch

    n = min(max_batch, pools.slots(BLOCK))
    batch = pools.batch(direction, BLOCK, n)
    contenders: list[tuple[str, str, Optional[int], Any]] = [
        ("contiguous", "ceiling", None, pools.contiguous(direction, batch.nbytes))
    ] + [(b.impl, b.kind, b.num_sms, b.call(batch.src, batch.dst, batch.sizes)) for b in bounds if b.accepts(BLOCK)]
    progress.add(len(contenders))

    index = timer.index
    where = torch.device(pools.device.torch_device)
    gen = torch.Generator(device=where).manual_seed(seed)
    a = torch.randn(GEMM_N, GEMM_N, device=where, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(GEMM_N, GEMM_N, device=where, dtype=torch.bfloat16, generator=gen)
    out = torch.empty_like(a)
    gstream = torch.cuda.Stream(device=index)
    flop = 2.0 * GEMM_N ** 3

    def event() -> Any:
        return torch.cuda.Event(enable_timing=True)

    def gemms(k: int) -> tuple[Any, Any]:
        start, end = event(), event()
        with torch.cuda.stream(gstream):
            start.record(gstream)
            for _ in range(k):
                torch.matmul(a, b, out=out)
            end.record(gstream)
        return start, end

    def alone(k: int) -> float:
        times = []
        for _ in range(ROUNDS):
            s, e = gemms(k)
            gstream.synchronize()
            times.append(s.elapsed_time(e) / 1e3 / k)
        return median(times)

    def beside(call: Any, k: int, reps: int) -> tuple[float, float, bool]:
        cs = timer.stream
        gate, c_end = event(), event()
        with torch.cuda.stream(cs):
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(GATE_CYCLES)
            gate.record(cs)
            for _ in range(reps):
                call(cs)
            c_end.record(cs)
        gstream.wait_event(gate)
        g_start, g_end = gemms(k)
        torch.cuda.synchronize(where)
        copy_s = gate.elapsed_time(c_end) / 1e3
        covered = gate.elapsed_time(c_end) >= gate.elapsed_time(g_end)
        return g_start.elapsed_time(g_end) / 1e3 / k, copy_s, covered

    records = []
    with torch.cuda.device(index):
        gemms(3)
        gstream.synchronize()
        k = max(10, int(WINDOW_S / alone(10)))
        for impl, kind, sms, call in contenders:
            try:
                t_alone = alone(k)
                t_copy = median(timer.measure([call], 3, 1)[0])
                reps = max(2, math.ceil(COVER * k * t_alone / t_copy))
                for attempt in range(2):  # reps stays what the kept runs enqueued
                    runs = [beside(call, k, reps) for _ in range(ROUNDS)]
                    covered = all(c for _, _, c in runs)
                    if covered or attempt == 1:
                        break
                    reps *= 2
                t_with = median([t for t, _, _ in runs])
                copy_s = median([c for _, c, _ in runs])
                records.append(Interference(
                    direction=str(direction), impl=impl, kind=kind, num_sms=sms, block_bytes=BLOCK, batch=n,
                    gemm_tflops_alone=round(flop / t_alone / 1e12, 2),
                    gemm_tflops_beside=round(flop / t_with / 1e12, 2),
                    slowdown=round(max(0.0, 1.0 - t_alone / t_with), 4),
                    copy_gbps_beside=round(reps * batch.nbytes / copy_s / 1e9, 3),
                    covered=covered,
                ))
            except Exception as e:
                failures.add(direction, impl, sms, BLOCK, e)
            progress.step(f"{direction} interference")
    return records
