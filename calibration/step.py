"""The step benchmark: what a KV transfer costs an engine's step, on a model's own layout.

For a model shape (:mod:`kvswap.models`) at a TP degree, one rank's per-layer KV tensors
are allocated on the device and in pinned host memory, filled with random bytes, and
BlockMover jobs of ``B`` random blocks are moved as an engine moves them, beside a compute
load on the compute stream (bf16 GEMMs sized to the step's length):

* the compute is launched first, then the job is submitted, from the same thread;
* host to device (a prefix load into free blocks) waits for nothing: it runs beside the
  step's compute;
* device to host (an offload) waits for the work queued before the step (the writes of
  the blocks it copies), as the default ordering does for a job submitted at the start of
  a step, and runs beside the step's compute too;
* the submit says how long the copy has beside the compute (``within``: the compute's
  time alone in the same repetition), as an engine that times its steps can: a job may
  then take the route that uses no SMs where that is predicted to end the step sooner.
  The table's route names that route "beside compute" where it differs.

Each contender is a :class:`~kvswap.Policy` (or a kernel bound at exactly 12 SMs) given
to a BlockMover over the same tensors. Per contender it reports the time ``submit`` held
the thread, the transfer's time alone (from an idle device) and beside the compute, the
compute's slowdown (its time beside the transfer over its time alone, in the same
repetition), and the step's makespan (from launching the compute to both done); every
job's destination is poisoned first and every moved byte checked against its source,
with the blocks not copied checked unchanged. Contenders take turns within each
repetition on the same random draw of blocks, and each number is the median over the
repetitions.

On a machine without an accelerator the same code runs on host tensors with the host
reference copy and a host callable standing in for the GEMMs (:class:`HostEnv`): what
the tests exercise. ``kvswap bench --model`` refuses that (its numbers would mean nothing).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from kvswap.errors import KvSwapError
from kvswap.models import KVCache
from kvswap.mover import BlockMover, TransferResult
from kvswap.thresholds import Calibration
from kvswap.types import DeviceInfo, Direction, Policy

from .bench import PEER_KERNEL, PEER_MAX_BLOCK, PEER_MIN_BATCH, PEER_SMS, label, peer_route
from .progress import Progress
from .step_workload import DeviceEnv, HostEnv, StepPools, WrongBytes
from .timing import median

KiB = 1024
KERNEL_SMS = PEER_SMS  # "kernel only": the SMs vLLM's Triton path runs its copy on
VLLM_POLICY = (f"vLLM's Triton path: h2d chunks under {PEER_MAX_BLOCK // KiB} KiB in jobs of at least "
               f"{PEER_MIN_BATCH} descriptors on the kernel at {PEER_SMS} SMs, else the batch route; "
               f"d2h always the batch route")
__all__ = ["CONTENDERS", "CaseResult", "Contender", "ContenderResult", "DeviceEnv", "HostEnv", "StepPools",
           "StepSettings", "WrongBytes", "bind", "compute_alone", "contenders_for", "make_mover", "one_step",
           "run_case", "run_step_bench", "transfer_alone"]
CONTENDERS = ("default", "low_interference", "batch", f"kernel@{KERNEL_SMS}", "vllm")


# -- contenders ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Contender:
    """One way to resolve the mover. ``exact_sms`` binds the forced kernel at exactly that
    many SMs (not the calibrated knee capped by it); ``same_as`` names the contender whose
    mover (and measurements) this one shares in a case."""

    name: str
    policy: Policy
    exact_sms: Optional[int] = None
    same_as: Optional[str] = None

    @property
    def key(self) -> tuple[Policy, Optional[int]]:
        return self.policy, self.exact_sms


def contenders_for(direction: Direction, cache: KVCache, blocks: int, batch_impl: Optional[str],
                   kernel_impl: Optional[str]) -> list[Contender]:
    """The contenders of one case. Routes that are not available here are left out
    (``batch_impl``/``kernel_impl`` None); vLLM's policy is the batch route or the kernel
    on 12 SMs, whichever its rule picks for this chunk size and job."""
    out = [Contender("default", Policy()), Contender("low_interference", Policy(prefer="low_interference"))]
    forced: dict[str, Contender] = {}
    if batch_impl:
        forced["batch"] = Contender("batch", Policy(force=batch_impl))
    if kernel_impl:
        name = f"kernel@{KERNEL_SMS}"
        forced[name] = Contender(name, Policy(force=kernel_impl, max_sms=KERNEL_SMS), exact_sms=KERNEL_SMS)
    out += forced.values()
    impl, _ = peer_route(str(direction), cache.chunk_bytes, blocks * cache.descriptors_per_block)
    # Where its kernel cannot run, vLLM copies on the batch route.
    twin = forced.get(f"kernel@{KERNEL_SMS}") if impl == PEER_KERNEL else None
    twin = twin or forced.get("batch")
    if twin is not None:
        out.append(Contender("vllm", twin.policy, twin.exact_sms, same_as=twin.name))
    return out


def routes_available(direction: Direction, device: Any, host: Any = None) -> tuple[Optional[str], Optional[str]]:
    """The batch-kind and kernel-kind implementations a mover can use here, by name (None:
    none). A kernel reads pinned host memory, which a machine without an accelerator has
    none of: there it is left out (Triton's interpreter included)."""
    from kvswap.resolver import resolve

    plan = resolve(direction, device=device, host=host).plan
    usable = [c for c in plan.candidates if c.available]
    batch = next((c.name for c in usable if c.kind == "batch"), None)
    kernel = next((c.name for c in usable if c.kind == "kernel"), None)
    return batch, None if plan.device.platform == "cpu" else kernel


def exact_sms_calibration(dev: DeviceInfo, num_sms: int) -> Calibration:
    """What the resolver decides by to bind a forced kernel at exactly ``num_sms`` SMs."""
    return Calibration(source=f"kvswap bench --model: kernel bound at {num_sms} SMs", platform=dev.platform,
                       scope="device", kernel_sms={str(d): num_sms for d in (Direction.H2D, Direction.D2H)},
                       identity=dev.identity)


def bind(contender: Contender, dev: DeviceInfo, target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``target(*args, policy=contender.policy, **kwargs)`` (BlockMover, resolve), with the
    kernel bound at exactly ``contender.exact_sms`` SMs where it asks for that."""
    if contender.exact_sms is not None:
        kwargs["calibration"] = exact_sms_calibration(dev, contender.exact_sms)
    return target(*args, policy=contender.policy, **kwargs)


def make_mover(src: list, dst: list, direction: Direction, block_dim: int, contender: Contender,
               dev: DeviceInfo) -> BlockMover:
    """A BlockMover for ``contender`` over these tensors."""
    return bind(contender, dev, BlockMover, src, dst, direction, block_dim=block_dim)


def route_label(mover: BlockMover, sid: np.ndarray, did: np.ndarray) -> str:
    """The route(s) this job takes, as the tables name them (``triton.kernel@12``)."""
    try:
        work = mover.swap_fn.assign(*mover.descriptors(sid, did))
        return "+".join(dict.fromkeys(label(name, sms) for name, sms, _ in work))
    except Exception:  # a label is a courtesy; the run says what failed
        return "+".join(mover.swap_fn.impls)


def beside_label(mover: BlockMover, cache: KVCache, blocks: int, within: float) -> Optional[str]:
    """The route a job of ``blocks`` takes beside ``within`` seconds of compute where that is
    not the mover's resolved route (:meth:`kvswap.SwapFn.quieter`), else None."""
    n = blocks * cache.descriptors_per_block
    return mover.swap_fn.quieter(cache.chunk_bytes, n, blocks * cache.block_bytes, within)


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
    over_compute: list[float] = field(default_factory=list)  # makespan / compute alone, same repetition
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
    gbps_alone: Optional[float] = None
    gbps_beside: Optional[float] = None
    bytes_checked: int = 0
    error: Optional[str] = None


@dataclass
class CaseResult:
    """One model x TP x direction x blocks case."""

    model: str
    layout: str
    tp: int
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
              did: np.ndarray, within: Optional[float] = None) -> tuple[float, float, float, float]:
    """Launch the compute, then submit: ``(submit s, transfer s, compute s, makespan s)``.
    ``within``: what the engine tells the mover about the time the copy has beside the
    compute (the step's compute time, for both a load the next step reads and an offload)."""
    pools.poison(direction)
    with env.context():
        env.sync()
        written = env.mark()  # the end of the work queued before the step
        c0 = env.mark()
        env.launch_compute()
        c1 = env.mark()
        h0 = time.perf_counter()
        job = env.submit(mover, sid, did, None if direction.src_is_host else written, within)
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
             progress: Optional[Progress] = None, ceiling: bool = True) -> CaseResult:
    """Every contender on ``blocks`` random blocks, ``reps`` times, taking turns."""
    cache = pools.cache
    if pools.prepared != direction:
        pools.prepare(direction)
    src, dst = pools.sides(direction)
    measured = [c for c in contenders if c.same_as is None]
    movers: dict[str, BlockMover] = {}
    errors: dict[str, str] = {}
    runs = {c.name: Runs() for c in measured}
    routes: dict[str, str] = {}
    beside_routes: dict[str, Optional[str]] = {}
    sid, did = pools.draw(rng, blocks)
    # The link's ceiling: the faster of a contiguous copy timed before the case and after
    # it, so that a moment when the machine was slow does not flatter the contenders.
    nbytes = blocks * cache.block_bytes
    link = pools.ceiling(direction, nbytes) if ceiling else None
    try:
        for c in measured:
            try:
                with env.context():
                    movers[c.name] = make_mover(src, dst, direction, cache.block_dim, c, dev)
                routes[c.name] = route_label(movers[c.name], sid, did)
                transfer_alone(env, pools, movers[c.name], direction, sid, did)  # warm-up (and kernel compile)
                pools.check(direction, sid, did)
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
                m, got = movers[c.name], runs[c.name]
                try:
                    got.alone.append(transfer_alone(env, pools, m, direction, sid, did))
                    got.bytes_checked += pools.check(direction, sid, did)
                    s, t, comp, span = one_step(env, pools, m, direction, sid, did, alone_c)
                    beside_routes.setdefault(c.name, beside_label(m, cache, blocks, alone_c))
                    got.bytes_checked += pools.check(direction, sid, did)
                except Exception as e:
                    errors[c.name] = f"{type(e).__name__}: {e}"
                    continue
                got.submit.append(s)
                got.beside.append(t)
                got.compute.append(comp)
                got.slowdown.append(comp / alone_c if alone_c > 0 else 1.0)
                got.makespan.append(span)
                got.over_compute.append(span / alone_c if alone_c > 0 else 1.0)
                if progress is not None:
                    progress.step(f"{cache.label} {direction} x{blocks}")
    finally:
        for m in movers.values():
            m.close()
    results = []
    for c in contenders:
        who = c.same_as or c.name
        got = runs[who]
        route = routes.get(who, "?")
        if beside_routes.get(who):
            route = f"{route}; {beside_routes[who]} beside compute"
        res = ContenderResult(c.name, route, c.same_as, error=errors.get(who))
        if got.makespan:
            alone, beside = median(got.alone), median(got.beside)
            res.submit_us = round(median(got.submit) * 1e6, 2)
            res.transfer_alone_ms, res.transfer_beside_ms = _ms(got.alone), _ms(got.beside)
            res.compute_beside_ms, res.makespan_ms = _ms(got.compute), _ms(got.makespan)
            res.slowdown = round(median(got.slowdown), 4)
            res.makespan_over_compute = round(median(got.over_compute), 4)
            res.gbps_alone = _sig(nbytes / alone / 1e9) if alone > 0 else None
            res.gbps_beside = _sig(nbytes / beside / 1e9) if beside > 0 else None
            res.bytes_checked = got.bytes_checked
        results.append(res)
    return CaseResult(
        model=cache.model.name, layout=cache.model.layout, tp=cache.tp, direction=str(direction), blocks=blocks,
        chunk_bytes=cache.chunk_bytes, descriptors=blocks * cache.descriptors_per_block, bytes=nbytes,
        compute_alone_ms=_ms(computes) or 0.0,
        ceiling_gbps=_sig(max(link, pools.ceiling(direction, nbytes))) if link is not None else None,
        reps=reps, contenders=results,
    )


# -- a whole run -----------------------------------------------------------------------------

@dataclass(frozen=True)
class StepSettings:
    blocks: tuple[int, ...] = (32, 512)
    step_ms: float = 20.0
    reps: int = 7
    seed: int = 0
    pool_factor: int = 2  # blocks in each pool: this many times the largest job, at least 64


def pool_blocks(settings: StepSettings) -> int:
    return max(64, settings.pool_factor * max(settings.blocks))


def run_step_bench(env: Any, dev: DeviceInfo, caches: Iterable[KVCache], directions: Sequence[Direction],
                   settings: StepSettings, *, host: Any = None, progress: Optional[Progress] = None,
                   ceiling: bool = True) -> dict[str, Any]:
    """Every case of ``caches`` x ``directions`` x ``settings.blocks``: a JSON-ready document."""
    caches = list(caches)
    rng = np.random.default_rng(settings.seed)
    available = {d: routes_available(d, dev.torch_device, host) for d in directions}
    doc: dict[str, Any] = {
        "kind": "kvswap step bench",
        "device": {"name": dev.name, "platform": dev.platform, "identity": dev.identity,
                   "compute_units": dev.compute_units, "driver": dev.driver_version, "link": dev.link},
        "env": env.name,
        "settings": asdict(settings),
        "compute": {"gemm": env.gemm_label, "gemms": env.gemms,
                    "gemm_ms": round(env.gemm_seconds * 1e3, 4)},
        "contenders": list(CONTENDERS),
        "vllm_policy": VLLM_POLICY,
        "cases": [],
        "notes": [],
    }
    for d, (b, k) in available.items():
        if not b or not k:
            doc["notes"].append(f"{d}: no {'batch' if not b else 'kernel'}-kind route here; its contenders "
                                f"are left out")
    if progress is not None:
        per_case = {d: sum(c.same_as is None for c in contenders_for(d, caches[0], 1, *available[d]))
                    for d in directions} if caches else {}
        progress.add(sum(per_case[d] * settings.reps for d in directions) * len(settings.blocks) * len(caches))
    for cache in caches:
        pools = StepPools(env, cache, pool_blocks(settings), settings.seed)
        try:
            for d in directions:
                for b in settings.blocks:
                    cs = contenders_for(d, cache, b, *available[d])
                    case = run_case(env, pools, dev, d, b, cs, settings.reps, rng, progress, ceiling)
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
