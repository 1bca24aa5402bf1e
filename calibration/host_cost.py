"""How long one call of each route holds the calling thread, by descriptor count.

An engine issues transfers from the thread that launches its model: a call that holds it
delays the step. This times one SwapFn call per route (``time.perf_counter_ns`` around it)
on an engine's layout, many separate per-layer tensors on both sides (by default
llama-3.1-70b at TP 8: 80 tensors a side, 4 KiB chunks, 160 descriptors a block), with
descriptors built from random block ids the way BlockMover builds them, and called the way
BlockMover calls it (``SwapFn.call_validated``: the routing and the route's own work; the
check of a whole batch, which every route shares, is not in it). On an accelerator
the transfer stream is kept busy first (a sleep kernel queued before the call), so only
host work counts; between calls unrelated host work runs over a buffer larger than the
caches, as an engine's step does, so no call finds its data warm. Every route's bytes are
checked once per descriptor count (every byte of the job, and nothing else written).

:func:`fit_line` fits ``host_us(n) = a + b * n`` per route and direction from the medians
(Theil-Sen: the median of the slopes between every two counts, so one disturbed count
cannot tilt the line); :func:`profile_field` writes them as a profile's ``host_cost``, read
into :attr:`kvswap.Calibration.host_cost`. Run it alone with
``python -m kvswap.calibration.host_cost``.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from kvswap import resolve
from kvswap.cli.models import KVCache, get
from kvswap.addressing.regions import pair_regions
from kvswap.types import DeviceInfo, Direction

from .binding import Failures, bound_at
from .progress import Progress
from .timing import held_us, median, on_host

MiB = 1 << 20
# Seconds of sleep kernel per second of the longest call seen at a count, and at least this
# much more: the stream must still be busy when the call returns.
SLEEP_COVER, SLEEP_MIN_S = 2.0, 0.002
# Cycles per second the sleep kernel is sized by: at or above the SM clock of the GPUs
# kvswap ships profiles for (H100, H200: 1.98 GHz at most), so it sleeps at least as long.
SLEEP_HZ = 2.0e9
clock = time.perf_counter_ns
# The kinds timed on per-layer host tensors; a staged route is timed on a block-major host
# cache (``kinds=STAGED_KINDS, host_layout="block-major"``), the only layout it serves.
PER_LAYER_KINDS, STAGED_KINDS = ("batch", "kernel"), ("staged",)  # what times a call (a modelled device in the tests has a clock of its own)


@dataclass(frozen=True)
class HostCostSettings:
    """What :func:`measure` times: ``counts`` descriptors a call on ``workload`` (a model
    name and TP), ``reps`` calls per count and route, with ``scratch_bytes`` of unrelated
    host work between calls."""

    counts: tuple[int, ...]
    workload: tuple[str, int]
    reps: int
    scratch_bytes: int
    kernel_sms: int = 8

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def settings_for(device: DeviceInfo, quick: bool = False, kernel_sms: Optional[int] = None) -> HostCostSettings:
    """64-32,768 descriptors on an accelerator (engines move 32-512 blocks of 64-160
    descriptors a step); on a CPU-only machine, where the host reference copies every byte
    inside the call, a small layout and small counts."""
    if on_host(device):
        return HostCostSettings(counts=(16, 64, 256) if quick else (16, 64, 256, 1024), workload=("llama-3.1-70b", 8),
                                reps=3 if quick else 5, scratch_bytes=4 * MiB, kernel_sms=kernel_sms or 8)
    return HostCostSettings(counts=(64, 512, 4096, 32768) if quick else (64, 256, 1024, 4096, 16384, 32768),
                            workload=("llama-3.1-70b", 8), reps=5 if quick else 9, scratch_bytes=64 * MiB,
                            kernel_sms=kernel_sms or 8)


def workload(settings: HostCostSettings, device: DeviceInfo) -> KVCache:
    name, tp = settings.workload
    cache = get(name).at(tp)
    if on_host(device):  # a few layers: the host reference copies every byte inside the call
        from kvswap.cli.models import ModelShape

        m = cache.model
        cache = ModelShape(f"{m.name} (8 layers)", 8, m.kv_heads, m.head_dim, m.dtype, m.layout).at(tp)
    return cache


def fit_line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b * n`` through ``(n, y)`` points (Theil-Sen: the median slope
    over every two distinct counts, then the median intercept), both clamped at 0."""
    pts = sorted((int(n), float(y)) for n, y in points)
    if not pts:
        raise ValueError("no points to fit")
    slopes = [(y1 - y0) / (n1 - n0) for i, (n0, y0) in enumerate(pts) for n1, y1 in pts[i + 1:] if n1 != n0]
    b = max(median(slopes), 0.0) if slopes else 0.0
    a = max(median([y - b * n for n, y in pts]), 0.0)
    return a, b


class _Thread:
    """What surrounds each timed call: the busy stream on an accelerator, and the
    unrelated host work between calls."""

    def __init__(self, env: Any, scratch_bytes: int) -> None:
        self.env = env
        self.device = getattr(env, "name", "host") == "device"
        self.scratch = np.zeros(max(scratch_bytes // 8, 1), dtype=np.int64)
        self.stream = None
        if self.device:
            torch = env.torch
            with torch.cuda.device(env.index):
                self.stream = torch.cuda.Stream(device=env.index)

    def cool(self) -> None:
        """Unrelated host work: one write per cache line of a buffer larger than the caches."""
        self.scratch[::8] += 1

    def held_us(self, call: Any, expect_us: float) -> float:
        """Microseconds ``call(stream)`` held this thread after unrelated host work; on an
        accelerator with the stream kept busy for longer than ``expect_us``."""
        cycles = int(SLEEP_HZ * (SLEEP_COVER * expect_us / 1e6 + SLEEP_MIN_S))
        self.cool()
        if self.stream is None:
            return held_us(lambda: call(None), clock=clock)
        with self.env.torch.cuda.device(self.env.index):
            return held_us(lambda: call(self.stream), self.stream, cycles, clock=clock)

    def sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


def routes_to_time(direction: Direction, dev: DeviceInfo, spec: Any, host: Any, kernel_sms: int,
                   failures: Failures, kinds: Sequence[str] = PER_LAYER_KINDS) -> list[tuple[str, str, Optional[int], Any]]:
    """``(impl, kind, num_sms, SwapFn)`` for every usable route of ``kinds`` on the device
    ``spec`` names (detected as ``dev``), each forced through ``resolve()`` as an engine
    gets it; kernels at ``kernel_sms`` (capped by the device)."""
    plan = resolve(direction, device=spec, host=host, profiles=False).plan
    out = []
    for c in plan.candidates:
        if not c.available or c.kind not in kinds:
            continue
        k = min(kernel_sms, dev.compute_units or kernel_sms) if c.kind == "kernel" else None
        try:
            out.append((c.name, c.kind, k, bound_at(direction, dev, spec, host, c.name, k)))
        except Exception as e:
            failures.add(direction, c.name, k, None, e)
    return out


def measure(env: Any, dev: DeviceInfo, directions: Sequence[Direction], settings: HostCostSettings, *,
            spec: Any = None, host: Any = None, cache: Optional[KVCache] = None, progress: Optional[Progress] = None,
            failures: Optional[Failures] = None, seed: int = 0, kinds: Sequence[str] = PER_LAYER_KINDS,
            host_layout: str = "per-layer") -> list[dict[str, Any]]:
    """One record per direction, route of ``kinds`` and descriptor count: the median of
    ``reps`` calls' held microseconds (``held_us``), each call on fresh random block ids,
    over a host side of ``host_layout``. A staged route is called by ids, as a BlockMover
    calls it (:func:`kvswap.mover.plan.bind_ids`); the others on descriptors.

    :param spec: the device as the caller named it (default ``dev.torch_device``)."""
    from kvswap.mover.plan import bind_ids

    from .step_workload import StepPools

    cache = cache or workload(settings, dev)
    failures = failures if failures is not None else Failures()
    per_block = cache.descriptors_per_block
    counts = sorted({max(1, round(n / per_block)) for n in settings.counts})
    num_blocks = 2 * max(counts)  # twice the largest job: scattered ids, and blocks left to stay poison
    pools = StepPools(env, cache, num_blocks, seed, host_layout)
    thread = _Thread(env, settings.scratch_bytes)
    rng = np.random.default_rng(seed)
    records: list[dict[str, Any]] = []
    for d in directions:
        d = Direction.parse(d)
        pools.prepare(d)
        src, dst = pools.sides(d)
        template = pair_regions(src, dst, cache.block_dim)
        buf = np.empty((3, template.count * max(counts)), dtype=np.int64)
        routes = routes_to_time(d, dev, dev.torch_device if spec is None else spec, host, settings.kernel_sms,
                                failures, kinds)
        if progress is not None:
            progress.add(len(routes) * len(counts))
        for impl, kind, sms, fn in routes:
            expect = 0.0
            ids_steps = bind_ids(fn, template) if kind == "staged" else None
            for blocks in counts:
                def draw() -> tuple[np.ndarray, np.ndarray, Any]:
                    sid, did = pools.draw(rng, blocks)
                    if ids_steps is not None:
                        by_ids, _ = ids_steps.at(blocks * per_block)
                        return sid, did, lambda stream: by_ids.pack(sid, did)(stream)
                    m = template.fill(sid, did, buf)
                    s, t, z = (np.ascontiguousarray(buf[i, :m]) for i in range(3))
                    return sid, did, lambda stream: fn.call_validated(s, t, z, stream=stream)

                try:
                    sid, did, call = draw()
                    pools.poison(d)
                    first = thread.held_us(call, max(expect, 1e4))  # untimed: warms up, and is checked
                    checked = pools.check(d, sid, did)
                    expect = max(expect, first)
                    held = []
                    for _ in range(settings.reps):
                        _, _, call = draw()
                        held.append(thread.held_us(call, expect))
                        expect = max(expect, held[-1])
                except Exception as e:
                    thread.sync()
                    failures.add(d, impl, sms, cache.chunk_bytes, e)
                    break
                finally:
                    if progress is not None:
                        progress.step(f"{d} host cost")
                records.append({"direction": str(d), "route": impl, "kind": kind, "num_sms": sms,
                                "descriptors": blocks * per_block, "held_us": round(median(held), 2),
                                "spread_us": round(float(np.median(np.abs(np.array(held) - median(held)))), 2),
                                "reps": len(held), "workload": cache.label, "chunk_bytes": cache.chunk_bytes,
                                "tensors_a_side": len(src), "host_layout": host_layout, "bytes_checked": checked,
                                "note": " ".join(n.removeprefix(f"{impl}: ") for n in fn.plan.notes
                                                 if n.startswith(f"{impl}: "))})
    return records


def profile_field(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """A profile's ``host_cost``: per direction and route, ``[a_us, b_us]`` fitted over the
    descriptor counts measured (:func:`fit_line`)."""
    points: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in records:
        points.setdefault((r["direction"], r["route"]), []).append((r["descriptors"], r["held_us"]))
    out: dict[str, dict[str, list[float]]] = {}
    for (d, route), pts in sorted(points.items()):
        a, b = fit_line(pts)
        out.setdefault(d, {})[route] = [round(a, 2), round(b, 5)]
    return out


def route_notes(records: Sequence[dict[str, Any]]) -> dict[str, str]:
    """What each timed route said of itself when bound (``{direction impl: note}``): where
    it issues its calls from, for one, which decides what its host cost is."""
    return {f"{r['direction']} {r['route']}": r["note"] for r in records if r.get("note")}


def describe(field: dict[str, dict[str, list[float]]], at: Sequence[int] = (2048, 32768)) -> list[str]:
    """Lines a person reads: per direction and route, the fit and what it predicts."""
    out = []
    for d, routes in field.items():
        for route, (a, b) in routes.items():
            each = ", ".join(f"{a + b * n:,.0f} µs at {n:,}" for n in at)
            out.append(f"{d} {route}: holds the calling thread {a:.1f} µs + {b * 1e3:.1f} ns per descriptor ({each})")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvswap.cli import directions as parse_directions, write_json
    from kvswap.registry.platform import detect
    from kvswap.registry.plugins import plugin_host

    from .step_workload import DeviceEnv, HostEnv

    p = argparse.ArgumentParser(prog="python -m kvswap.calibration.host_cost",
                                description="How long one call of each route holds the calling thread, by "
                                "descriptor count, on many per-layer tensors a side; fitted as a + b * n.")
    p.add_argument("--device", default=None)
    p.add_argument("--directions", type=parse_directions, default=[Direction.H2D, Direction.D2H])
    p.add_argument("--quick", action="store_true", help="fewer counts and calls")
    p.add_argument("--json", type=Path, help="write the records and the fitted host_cost here")
    args = p.parse_args(argv)
    host = plugin_host()
    dev = detect(host, args.device)
    env = HostEnv(lambda: None) if on_host(dev) else DeviceEnv(dev, 1.0)
    settings = settings_for(dev, quick=args.quick)
    progress = Progress.on_stderr("count")
    failures = Failures()
    try:
        records = measure(env, dev, args.directions, settings, spec=args.device, host=host, progress=progress,
                          failures=failures)
    finally:
        progress.close()
    for r in records:
        print(f"{r['direction']} {r['route']:<16} {r['descriptors']:>7,} descriptors: {r['held_us']:>10,.1f} µs")
    field = profile_field(records)
    print("\n".join(describe(field)))
    for f in failures.records:
        print(f"failed: {f.describe()}")
    if args.json:
        write_json(args.json, {"kind": "kvswap host cost", "device": dev.name, "settings": settings.to_dict(),
                               "records": records, "host_cost": field})
    return 0 if records else 1


if __name__ == "__main__":
    sys.exit(main())
