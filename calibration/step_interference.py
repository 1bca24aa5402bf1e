"""Compute slowdown as an engine sees it: per direction, route and SM count, for the route
that takes no SMs per block size, and (``staged=True``) for the staged route per block size
with a block-major host cache, the host layout it is meant for.

The step benchmark's procedure (:mod:`kvswap.calibration.step`) on model-shaped workloads
(every route on one, the batch route again on two with other chunk sizes): bf16 GEMMs
launched on the compute stream, a BlockMover job submitted right after from the same
thread, the two started together. The slowdown is the fraction of
compute throughput lost while the job runs (:func:`lost_fraction`), the median over
repetitions that alternate with the compute alone; each job is sized to outlast the
compute alone (``covered`` says whether it outlasted the slowed compute), every byte checked.

:func:`profile_rows` turns the records into a profile's ``slowdown_by_sms`` (read into
:attr:`kvswap.Calibration.slowdown_by_sms`, which ``Policy(prefer="low_interference")``
ranks by). Run it alone with ``python -m kvswap.calibration.step_interference``.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from kvswap.cli.models import KVCache, get
from kvswap.types import DeviceInfo, Direction, Policy

from .progress import Progress
from .step import Contender, StepPools, compute_alone, make_mover, one_step, routes_available, transfer_alone
from .step_contiguous import ContiguousBuffers, ContiguousCopy
from .timing import median

SM_COUNTS = (4, 8, 12, 16, 32)
# 16 KiB chunks, 56 a block: the block size the earlier GEMM-beside-copy numbers used.
WORKLOAD = ("qwen2.5-7b", 1)
POOL_BLOCKS = 3000
# The route that takes no SMs measured again at 4 KiB and 32 KiB chunks: host to device,
# the copy engines' compute slowdown depends on the block size (in the step benchmark on an
# H100 and an H200: about 20% at 16-18 KiB, 5-13% at 4 KiB, under 1% at 32 KiB).
SIZE_WORKLOADS = (("llama-3.1-8b", 8), ("llama-3.1-8b", 1))
SIZE_POOL_BLOCKS = 1024
COVER = 1.3  # a job sized for this many times the compute alone
# The staged route's block-major pools hold at least this many bytes: at about 50 GB/s its job
# needs some 1.3 GB to outlast 20 ms of compute, and a job takes at most half the pool.
STAGED_POOL_BYTES = 3 << 30


def workload() -> KVCache:
    name, tp = WORKLOAD
    return get(name).at(tp)


def measure(env: Any, dev: DeviceInfo, directions: Sequence[Direction], sm_counts: Sequence[int] = SM_COUNTS,
            reps: int = 5, *, host: Any = None, cache: Optional[KVCache] = None, num_blocks: int = POOL_BLOCKS,
            progress: Optional[Progress] = None, seed: int = 0, by_size: Sequence[KVCache] = (),
            size_blocks: int = SIZE_POOL_BLOCKS, staged: bool = False,
            staged_pool_bytes: int = STAGED_POOL_BYTES, per_layer: bool = True) -> list[dict[str, Any]]:
    """One record per direction x route (the batch route, the kernel at each SM count) on
    ``cache``, and one per direction for the batch route on each of ``by_size`` (other
    block sizes; :func:`size_workloads`), all with per-layer host tensors; with ``staged``,
    also one per direction for the staged route on each of them with a block-major host
    cache (where a staged route is available), its pool at least ``staged_pool_bytes``, and
    one for a contiguous copy of the same bytes (kind ``contiguous``, a reference and no
    route: :mod:`.step_contiguous`); without ``per_layer``, only those (``kvswap calibrate
    --only staged``)."""
    cache = cache or workload()
    rng = np.random.default_rng(seed)
    records = []
    plan = [(cache, num_blocks, True)] + [(c, size_blocks, False) for c in by_size]

    def staged_blocks(c: KVCache, blocks: int) -> int:
        return max(blocks, staged_pool_bytes // c.block_bytes)

    # The contiguous copies' buffers, once: as large as the largest staged job (half its pool).
    buffers = ContiguousBuffers(env, max(staged_blocks(c, b) // 2 * c.block_bytes for c, b, _ in plan),
                                seed) if staged else None
    for c, blocks, kernels in plan:
        kinds = {"per-layer": ("batch", "kernel") if kernels else ("batch",)} if per_layer else {}
        if staged:
            kinds["block-major"] = ("staged",)
        for layout, measured in kinds.items():
            n = blocks if layout == "per-layer" else staged_blocks(c, blocks)
            pools = StepPools(env, c, n, seed, layout)
            try:
                for d in directions:
                    records += _measure_routes(env, dev, pools, d, sm_counts if kernels else (), reps, rng, host,
                                               progress, measured, buffers)
            finally:
                del pools
    return records


def size_workloads() -> list[KVCache]:
    """The workloads the batch route is measured on at other block sizes."""
    return [get(name).at(tp) for name, tp in SIZE_WORKLOADS]


def _measure_routes(env: Any, dev: DeviceInfo, pools: StepPools, d: Direction, sm_counts: Sequence[int], reps: int,
                    rng: np.random.Generator, host: Any, progress: Optional[Progress],
                    kinds: Sequence[str] = ("batch", "kernel"),
                    buffers: Optional[ContiguousBuffers] = None) -> list[dict[str, Any]]:
    """Of ``kinds``: the batch route, the kernel at ``sm_counts``, the staged route (on the
    SMs it is bound with), in direction ``d`` on ``pools``; after the staged route, a
    contiguous copy of its job's bytes through ``buffers`` (where given)."""
    cache = pools.cache
    pools.prepare(d)
    src, dst = pools.sides(d)
    available = routes_available(d, dev.torch_device, host)
    routes: list[tuple[str, str, Optional[int], Contender]] = []
    if available.batch and "batch" in kinds:
        routes.append((available.batch, "batch", 0, Contender("batch", Policy(force=available.batch))))
    if available.kernel and "kernel" in kinds:
        kernel = available.kernel
        cap = dev.compute_units or max(sm_counts, default=0)
        routes += [(kernel, "kernel", k, Contender(f"kernel@{k}", Policy(force=kernel, max_sms=k), exact_sms=k))
                   for k in sm_counts if k <= cap]
    if available.staged and "staged" in kinds:
        routes.append((available.staged, "staged", None, Contender("staged", Policy(force=available.staged))))
    if progress is not None:
        progress.add(len(routes))
    records: list[dict[str, Any]] = []
    for impl, kind, sms, c in routes:
        head = {"direction": str(d), "chunk_bytes": cache.chunk_bytes, "workload": cache.label,
                "host_layout": pools.host_layout}
        rec: dict[str, Any] = dict(head, route=impl, kind=kind, num_sms=sms)
        try:
            with env.context():
                mover = make_mover(src, dst, d, cache.block_dim, c, dev)
            if sms is None:  # the SMs its device side was bound with
                rec["num_sms"] = int(mover.swap_fn.plan.params.get(impl, {}).get("num_sms", 0))
            try:
                rec.update(_measure_route(env, pools, mover, d, reps, rng))
            finally:
                mover.close()
        except Exception as e:
            rec["error"] = f"{type(e).__name__}: {e}"
        records.append(rec)
        if progress is not None:
            progress.step(f"{d} {c.name} {cache.chunk_bytes // 1024} KiB")
        if kind == "staged" and "slowdown" in rec and buffers is not None:
            # What moving the staged job's bytes over the link at all costs the compute: the
            # floor its slowdown is read against, measured the same way.
            ref: dict[str, Any] = dict(head, route="contiguous copy", kind="contiguous", num_sms=0)
            try:
                copy = ContiguousCopy(buffers, d, cache.block_bytes)
                ref["route"] = copy.label(rec["blocks"])
                ids = np.arange(rec["blocks"])  # a copy's bytes: only the ids' count counts
                transfer_alone(env, copy, copy, d, ids, ids)  # warm-up
                ref.update(_measure_beside(env, pools, copy, d, rec["blocks"], reps, rng, side=copy))
            except Exception as e:
                ref["error"] = f"{type(e).__name__}: {e}"
            records.append(ref)
    return records


def lost_fraction(alone: float, beside: float, transfer: float) -> float:
    """The fraction of compute throughput a transfer of ``transfer`` seconds took while it
    ran beside compute that takes ``alone`` seconds alone and ``beside`` with it, both
    started together: the compute lost ``beside - alone`` seconds of work over the
    ``min(transfer, beside)`` they overlapped (where the transfer ends first, the compute's
    tail runs at full speed; timing against the whole compute would dilute the loss)."""
    overlap = min(transfer, beside)
    if overlap <= 0 or alone <= 0:
        return 0.0
    return min(max((beside - alone) / overlap, 0.0), 0.99)


def cover_blocks(blocks: int, seconds: float, compute: float, least: int, most: int) -> int:
    """Blocks for a job that lasts :data:`COVER` times ``compute`` at the speed a job of
    ``blocks`` blocks took ``seconds`` at, within ``[least, most]``."""
    return max(least, min(most, math.ceil(blocks * COVER * compute / max(seconds, 1e-9))))


def _measure_route(env: Any, pools: StepPools, mover: Any, d: Direction, reps: int,
                   rng: np.random.Generator) -> dict[str, Any]:
    probe = min(64, pools.num_blocks // 2)
    sid, did = pools.draw(rng, probe)
    transfer_alone(env, pools, mover, d, sid, did)  # warm-up
    t_probe = transfer_alone(env, pools, mover, d, sid, did)
    compute = compute_alone(env)
    most = pools.num_blocks // 2
    blocks = cover_blocks(probe, t_probe, compute, probe, most)
    # A route's fixed cost per job (the staged route's host work before its first link copy)
    # makes a small probe look slow, and a job sized from it ends before the compute: sized
    # once more from a job of the first estimate.
    if probe < blocks < most:
        sid, did = pools.draw(rng, blocks)
        blocks = cover_blocks(blocks, transfer_alone(env, pools, mover, d, sid, did), compute, probe, most)
    return _measure_beside(env, pools, mover, d, blocks, reps, rng)


def _measure_beside(env: Any, pools: Any, mover: Any, d: Direction, blocks: int, reps: int,
                    rng: np.random.Generator, side: Any = None) -> dict[str, Any]:
    """``mover``'s jobs of ``blocks`` blocks (drawn from ``pools``) beside the compute,
    ``reps`` times, each after the compute alone; ``side``: what poisons and checks the
    destination, where not ``pools`` (the contiguous copy's own buffer)."""
    side = pools if side is None else side
    ratios, lost, beside, comp, alone = [], [], [], [], []
    checked = 0
    for _ in range(reps):
        sid, did = pools.draw(rng, blocks)
        alone_c = compute_alone(env)
        alone.append(alone_c)
        _, t, c, _ = one_step(env, side, mover, d, sid, did)
        checked += side.check(d, sid, did)
        ratios.append(c / alone_c if alone_c > 0 else 1.0)
        lost.append(lost_fraction(alone_c, c, t))
        beside.append(t)
        comp.append(c)
    return {"blocks": blocks, "slowdown": round(median(lost), 4),
            "compute_ratio": round(median(ratios), 4), "transfer_beside_ms": round(median(beside) * 1e3, 4),
            "compute_beside_ms": round(median(comp) * 1e3, 4),
            # The compute alone rep to rep: the noise a slowdown is read against.
            "compute_alone_spread": round((max(alone) - min(alone)) / median(alone), 4),
            "covered": median(beside) >= median(comp),
            "bytes_checked": checked}


def profile_rows(records: Sequence[dict[str, Any]]) -> dict[str, list[list[Any]]]:
    """A profile's ``slowdown_by_sms``: per direction, ``[route, num_sms, fraction]`` rows
    for each impl and, the same numbers, for its kind (what a route of that kind without
    its own rows is judged by). The rows of the batch route and of the staged route name the
    chunk size they were measured at (``[route, num_sms, fraction, block_bytes]``): they
    were measured at several."""
    out: dict[str, dict[tuple, float]] = {}
    for r in records:
        if r.get("error") or "slowdown" not in r or r["kind"] == "contiguous":  # a reference, not a route
            continue
        rows = out.setdefault(r["direction"], {})
        sized = r["kind"] in ("batch", "staged") and r.get("chunk_bytes")
        for key in (r["route"], r["kind"]):
            k = (key, r["num_sms"], r["chunk_bytes"]) if sized else (key, r["num_sms"])
            rows[k] = max(r["slowdown"], rows.get(k, 0.0))
    return {d: [[k[0], k[1], v, *k[2:]] for k, v in sorted(rows.items())] for d, rows in out.items()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kvswap.cli import directions as parse_directions, write_json
    from kvswap.registry.platform import detect
    from kvswap.registry.plugins import plugin_host

    from .step import DeviceEnv
    from .step_report import interference_markdown
    from .timing import on_host

    p = argparse.ArgumentParser(prog="python -m kvswap.calibration.step_interference",
                                description="Compute slowdown per direction, route and SM count (and, for "
                                "the route that takes no SMs and the staged route on a block-major host cache, "
                                "block size), measured beside bf16 GEMMs the way an engine sees it.")
    p.add_argument("--device", default=None)
    p.add_argument("--directions", type=parse_directions, default=[Direction.H2D, Direction.D2H])
    p.add_argument("--sms", default=",".join(map(str, SM_COUNTS)), help="kernel SM counts")
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    host = plugin_host()
    dev = detect(host, args.device)
    if on_host(dev):
        print("step_interference: needs a GPU", file=sys.stderr)
        return 1
    progress = Progress.on_stderr("route")
    try:
        records = measure(DeviceEnv(dev, args.step_ms), dev, args.directions,
                          [int(x) for x in args.sms.split(",") if x.strip()], args.reps, host=host, progress=progress,
                          by_size=size_workloads(), staged=True)
    finally:
        progress.close()
    doc = {"kind": "kvswap step interference", "device": dev.name, "records": records,
           "slowdown_by_sms": profile_rows(records)}
    print(interference_markdown(doc))
    if args.json:
        write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
