"""The step benchmark: what a KV transfer costs an engine's step, on a model's own layout.

For a model shape (:mod:`kvswap.cli.models`) at a TP degree, one rank's per-layer KV tensors
are allocated on the device and in pinned host memory, in either host layout (one tensor
per layer in the device's layout, or block-major: :func:`kvswap.host_cache`), filled with
random bytes, and BlockMover jobs of ``B`` random blocks are moved as an engine moves them,
beside a compute load on the compute stream (bf16 GEMMs sized to the step's length):

* the compute is launched first (one CUDA graph, as engines launch a step), then the job
  is submitted, from the same thread;
* host to device (a prefix load into free blocks) waits for nothing: it runs beside the
  step's compute;
* device to host (an offload) waits for the work queued before the step (the writes of
  the blocks it copies), as the default ordering does for a job submitted at the start of
  a step, and runs beside the step's compute too.

Each contender (:mod:`.step_contenders`) is a :class:`~kvswap.Policy` (or a kernel bound at
exactly 12 SMs) given to a BlockMover over the same tensors. Beside them runs the reference,
``contiguous`` (:mod:`.step_contiguous`): one contiguous copy of the job's bytes across the
link, launched beside the same compute the same way. Per contender it reports the time
``submit`` held the thread, the transfer's time alone (from an idle device) and beside the
compute, the compute's slowdown (its time beside the transfer over its time alone, in the
same repetition), and the step's makespan (from launching the compute to both done), also
over the compute alone of its repetition and over the reference's makespan in the same
repetition (``span_over_contiguous``, the ratio the bars judge). Every job's destination is
poisoned first and every moved byte checked against its source, with the blocks not copied
checked unchanged (the reference's buffer likewise). Contenders and the reference take turns
within each repetition on the same random draw of blocks, and each number is the median over
the repetitions.

On a machine without an accelerator the same code runs on host tensors with the host
reference copy and a host callable standing in for the GEMMs (:class:`HostEnv`): what
the tests exercise. ``kvswap bench --model`` refuses that (its numbers would mean nothing).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from kvswap.errors import ConfigurationError, KvSwapError
from kvswap.cli.models import KVCache
from kvswap import BlockMover, TransferResult
from kvswap.types import DeviceInfo, Direction, Policy

from .progress import Progress
from .step_contenders import (CONTENDERS, KERNEL_SMS, VARIANTS, VLLM_POLICY, Contender, Routes, bind,
                              contenders_for, exact_sms_calibration, is_staged, make_mover, route_label,
                              routes_available)
from .step_contiguous import CONTIGUOUS, ContiguousBuffers, ContiguousCopy
from .step_workload import HOST_LAYOUTS, DeviceEnv, HostEnv, StepPools, WrongBytes
from .timing import median

__all__ = ["CONTENDERS", "CONTIGUOUS", "HOST_LAYOUTS", "KERNEL_SMS", "VARIANTS", "CaseResult", "Contender", "ContenderResult",
           "ContiguousBuffers", "DeviceEnv",
           "HostEnv", "Routes", "StepPools", "StepSettings", "WrongBytes", "bind", "compute_alone", "contenders_for",
           "exact_sms_calibration", "make_mover", "one_step", "route_label", "routes_available", "run_case",
           "run_step_bench", "transfer_alone"]


# -- one case -------------------------------------------------------------------------------

@dataclass
class Runs:
    """Raw timings of one contender over the repetitions (seconds)."""

    submit: list[float] = field(default_factory=list)
    alone: list[float] = field(default_factory=list)
    beside: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    slowdown: list[float] = field(default_factory=list)
    makespan: list[float] = field(default_factory=list)
    compute_alone: list[float] = field(default_factory=list)  # of the repetition each step ran in
    reps: list[int] = field(default_factory=list)  # the repetition each step ran in
    bytes_checked: int = 0


@dataclass
class ContenderResult:
    """One contender in one case; times are medians over the repetitions."""

    name: str
    route: str
    same_as: Optional[str]
    submit_us: Optional[float] = None
    transfer_alone_ms: Optional[float] = None
    transfer_beside_ms: Optional[float] = None
    compute_beside_ms: Optional[float] = None
    slowdown: Optional[float] = None  # compute time beside the transfer / alone (1.0: none)
    makespan_ms: Optional[float] = None
    # Per repetition, the makespan over the compute alone timed in that repetition: the
    # GPU's clock moves the GEMMs' time between repetitions, and this ratio cancels it.
    makespan_over_compute: Optional[float] = None
    # Per repetition, the makespan over the contiguous reference's in that repetition: what
    # the step costs beyond moving the job's bytes over the link at all.
    span_over_contiguous: Optional[float] = None
    gbps_alone: Optional[float] = None
    gbps_beside: Optional[float] = None
    bytes_checked: int = 0
    staged: bool = False  # its jobs went through a staged-kind route
    error: Optional[str] = None


@dataclass
class CaseResult:
    """One model x TP x host layout x direction x blocks case. ``contenders``: the
    contiguous reference first, then the contenders; ``ceiling_gbps``: the faster of a
    contiguous copy timed from an idle device before the case and after it."""

    model: str
    layout: str
    tp: int
    host_layout: str
    direction: str
    blocks: int
    chunk_bytes: int
    descriptors: int
    bytes: int
    compute_alone_ms: float
    ceiling_gbps: Optional[float]
    reps: int
    contenders: list[ContenderResult]

    def by_name(self) -> dict[str, ContenderResult]:
        return {c.name: c for c in self.contenders}


def _sig(x: float) -> float:
    """``x`` to 5 significant digits: a JSON that stays readable at any scale."""
    return float(f"{x:.5g}")


def _ms(values: Sequence[float]) -> Optional[float]:
    return _sig(median(values) * 1e3) if values else None


def one_step(env: Any, pools: StepPools, mover: BlockMover, direction: Direction, sid: np.ndarray,
             did: np.ndarray) -> tuple[float, float, float, float]:
    """Launch the compute, then submit: ``(submit s, transfer s, compute s, makespan s)``."""
    pools.poison(direction)
    with env.context():
        env.sync()
        written = env.mark()  # the end of the work queued before the step
        c0 = env.mark()
        env.launch_compute()
        c1 = env.mark()
        h0 = time.perf_counter()
        job = env.submit(mover, sid, did, None if direction.src_is_host else written)
        h1 = time.perf_counter()
        mover.wait_issued(job)  # the job's copy is on the transfer stream before t1 is
        t1 = env.mark(mover.stream)
        env.sync()
    result = _result(mover, job)
    compute = env.elapsed(c0, c1)
    return h1 - h0, result.seconds, compute, max(compute, env.elapsed(c0, t1))


def transfer_alone(env: Any, pools: StepPools, mover: BlockMover, direction: Direction, sid: np.ndarray,
           did: np.ndarray) -> float:
    pools.poison(direction)
    with env.context():
        env.sync()
        job = env.submit(mover, sid, did, None)
        env.sync()
    return _result(mover, job).seconds


def compute_alone(env: Any) -> float:
    with env.context():
        env.sync()
        a = env.mark()
        env.launch_compute()
        b = env.mark()
        env.sync()
    return env.elapsed(a, b)


def _result(mover: BlockMover, job: int) -> TransferResult:
    mover.wait(job)
    done = [r for r in mover.poll() if r.job_id == job]
    if not done or not done[0].ok:
        raise KvSwapError(f"job {job} failed: {done[0].error if done else 'no result'}")
    return done[0]


def run_case(env: Any, pools: StepPools, dev: DeviceInfo, direction: Direction, blocks: int,
             contenders: Sequence[Contender], reps: int, rng: np.random.Generator,
             progress: Optional[Progress] = None, ceiling: bool = True,
             buffers: Optional[ContiguousBuffers] = None) -> CaseResult:
    """Every contender on ``blocks`` random blocks, ``reps`` times, taking turns with the
    contiguous reference. ``buffers``: the reference's, allocated once per run (for this
    case alone where None)."""
    cache = pools.cache
    if any(c.name == CONTIGUOUS for c in contenders):
        raise ConfigurationError(f"a contender may not be named {CONTIGUOUS!r}: the reference has that name")
    if pools.prepared != direction:
        pools.prepare(direction)
    src, dst = pools.sides(direction)
    nbytes = blocks * cache.block_bytes
    if buffers is None:
        buffers = ContiguousBuffers(env, nbytes, pools.seed)
    copy = ContiguousCopy(buffers, direction, cache.block_bytes)
    reference = Contender(CONTIGUOUS, Policy())  # no mover is built for it
    measured = [reference] + [c for c in contenders if c.same_as is None]
    movers: dict[str, Any] = {CONTIGUOUS: copy}
    sides: dict[str, Any] = {c.name: copy if c is reference else pools for c in measured}  # what poisons, checks
    errors: dict[str, str] = {}
    runs = {c.name: Runs() for c in measured}
    routes: dict[str, str] = {CONTIGUOUS: copy.label(blocks)}
    staged: dict[str, bool] = {}
    sid, did = pools.draw(rng, blocks)
    # The link's ceiling: the faster of a contiguous copy timed before the case and after
    # it, so that a moment when the machine was slow does not flatter the contenders.
    link = buffers.ceiling(direction, nbytes) if ceiling else None
    try:
        for c in measured:
            try:
                if c is not reference:
                    with env.context():
                        movers[c.name] = make_mover(src, dst, direction, cache.block_dim, c, dev)
                    routes[c.name] = route_label(movers[c.name], sid, did)
                    staged[c.name] = is_staged(movers[c.name], routes[c.name])
                transfer_alone(env, sides[c.name], movers[c.name], direction, sid, did)  # warm-up (and kernel compile)
                sides[c.name].check(direction, sid, did)
            except Exception as e:
                errors[c.name] = f"{type(e).__name__}: {e}"
        computes: list[float] = []
        for r in range(reps):
            sid, did = pools.draw(rng, blocks)
            alone_c = compute_alone(env)
            computes.append(alone_c)
            live = [c for c in measured if c.name in movers and c.name not in errors]
            order = live[r % len(live):] + live[:r % len(live)] if live else []
            for c in order:
                m, got, side = movers[c.name], runs[c.name], sides[c.name]
                try:
                    got.alone.append(transfer_alone(env, side, m, direction, sid, did))
                    got.bytes_checked += side.check(direction, sid, did)
                    s, t, comp, span = one_step(env, side, m, direction, sid, did)
                    got.bytes_checked += side.check(direction, sid, did)
                except Exception as e:
                    errors[c.name] = f"{type(e).__name__}: {e}"
                    continue
                got.submit.append(s)
                got.beside.append(t)
                got.compute.append(comp)
                got.slowdown.append(comp / alone_c if alone_c > 0 else 1.0)
                got.makespan.append(span)
                got.compute_alone.append(alone_c)
                got.reps.append(r)
                if progress is not None:
                    progress.step(f"{cache.label} {direction} x{blocks}")
    finally:
        for m in movers.values():
            m.close()
    ceiling_gbps = max(link, buffers.ceiling(direction, nbytes)) if link is not None else None
    # A reference that failed in any repetition leaves every ratio to it undefined.
    ref = {} if CONTIGUOUS in errors else dict(zip(runs[CONTIGUOUS].reps, runs[CONTIGUOUS].makespan))
    results = []
    for c in [reference, *contenders]:
        who = c.same_as or c.name
        got = runs[who]
        route = routes.get(who, "?")
        res = ContenderResult(c.name, route, c.same_as, staged=staged.get(who, False), error=errors.get(who))
        if got.makespan:
            alone, beside = median(got.alone), median(got.beside)
            res.submit_us = round(median(got.submit) * 1e6, 2)
            res.transfer_alone_ms, res.transfer_beside_ms = _ms(got.alone), _ms(got.beside)
            res.compute_beside_ms, res.makespan_ms = _ms(got.compute), _ms(got.makespan)
            res.slowdown = round(median(got.slowdown), 4)
            res.makespan_over_compute = round(median(_over(got.makespan, got.compute_alone)), 4)
            same_rep = [(s, ref[r]) for r, s in zip(got.reps, got.makespan) if r in ref]
            if same_rep:
                res.span_over_contiguous = round(median(_over(*zip(*same_rep))), 4)
            res.gbps_alone = _sig(nbytes / alone / 1e9) if alone > 0 else None
            res.gbps_beside = _sig(nbytes / beside / 1e9) if beside > 0 else None
            res.bytes_checked = got.bytes_checked
        results.append(res)
    compute_ms = _ms(computes) or 0.0
    return CaseResult(
        model=cache.model.name, layout=cache.model.layout, tp=cache.tp, host_layout=pools.host_layout,
        direction=str(direction), blocks=blocks, chunk_bytes=cache.chunk_bytes,
        descriptors=blocks * cache.descriptors_per_block, bytes=nbytes, compute_alone_ms=compute_ms,
        ceiling_gbps=_sig(ceiling_gbps) if ceiling_gbps else None, reps=reps, contenders=results,
    )


def _over(spans: Sequence[float], bases: Sequence[float]) -> list[float]:
    """Each repetition's makespan over its own base (1.0 where the base is 0)."""
    return [s / b if b > 0 else 1.0 for s, b in zip(spans, bases)]


# -- a whole run -----------------------------------------------------------------------------

@dataclass(frozen=True)
class StepSettings:
    blocks: tuple[int, ...] = (32, 512)
    host_layouts: tuple[str, ...] = HOST_LAYOUTS
    step_ms: float = 20.0
    reps: int = 7
    seed: int = 0
    pool_factor: int = 2  # blocks in each pool: this many times the largest job, at least 64
    variants: bool = False  # also the default without each older mechanism (step_contenders.VARIANTS)


def pool_blocks(settings: StepSettings) -> int:
    return max(64, settings.pool_factor * max(settings.blocks))


def run_step_bench(env: Any, dev: DeviceInfo, caches: Iterable[KVCache], directions: Sequence[Direction],
                   settings: StepSettings, *, host: Any = None, progress: Optional[Progress] = None,
                   ceiling: bool = True) -> dict[str, Any]:
    """Every case of ``caches`` x ``settings.host_layouts`` x ``directions`` x
    ``settings.blocks``: a JSON-ready document."""
    caches = list(caches)
    bad = [h for h in settings.host_layouts if h not in HOST_LAYOUTS]
    if bad or not settings.host_layouts:
        raise ConfigurationError(f"host_layouts={settings.host_layouts!r}: each must be one of "
                                 f"{', '.join(HOST_LAYOUTS)}, and at least one given")
    rng = np.random.default_rng(settings.seed)
    available = {d: routes_available(d, dev.torch_device, host) for d in directions}
    doc: dict[str, Any] = {
        "kind": "kvswap step bench",
        "device": {"name": dev.name, "platform": dev.platform, "identity": dev.identity,
                   "compute_units": dev.compute_units, "driver": dev.driver_version, "link": dev.link},
        "env": env.name,
        "settings": asdict(settings),
        "compute": {"gemm": env.gemm_label, "gemms": env.gemms,
                    "gemm_ms": round(env.gemm_seconds * 1e3, 4), "launch": env.launch},
        "contenders": [CONTIGUOUS, *CONTENDERS],
        "vllm_policy": VLLM_POLICY,
        "cases": [],
        "notes": [],
    }
    for d, routes in available.items():
        for kind, impl in routes._asdict().items():
            if not impl:
                doc["notes"].append(f"{d}: no {kind}-kind route here; its contenders are left out")
    if progress is not None:
        per_case = {d: 1 + sum(c.same_as is None for c in contenders_for(d, caches[0], 1, *available[d],
                                                                          with_variants=settings.variants))
                    for d in directions} if caches else {}  # the reference, and each measured contender
        progress.add(sum(per_case[d] * settings.reps for d in directions) * len(settings.blocks) * len(caches)
                     * len(settings.host_layouts))
    # The reference's buffers, once per run: as large as the largest job, at most BUFFER_MAX.
    buffers = ContiguousBuffers(env, max((max(settings.blocks) * c.block_bytes for c in caches), default=1),
                                settings.seed) if caches else None
    for cache in caches:
        for layout in settings.host_layouts:
            pools = StepPools(env, cache, pool_blocks(settings), settings.seed, layout)
            try:
                for d in directions:
                    for b in settings.blocks:
                        cs = contenders_for(d, cache, b, *available[d], with_variants=settings.variants)
                        case = run_case(env, pools, dev, d, b, cs, settings.reps, rng, progress, ceiling, buffers)
                        doc["cases"].append(asdict(case))
            finally:
                del pools
                _free_memory(env)
    return doc


def _free_memory(env: Any) -> None:
    if env.name != "device":
        return
    torch = env.torch
    torch.cuda.synchronize(env.device)
    torch.cuda.empty_cache()
    empty_host = getattr(torch._C, "_host_emptyCache", None)  # torch's cached pinned blocks
    if empty_host is not None:
        empty_host()
