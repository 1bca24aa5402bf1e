"""``kvswap bench --devices 0,1,2,3``: every listed GPU copying at once, against each alone.

Engines run one worker per GPU (tensor parallelism of 2-8 on one host), and all of them
share the host's memory and its PCIe switches: several GPUs copying at once can reach a
limit there before any reaches its link. This bench runs one process per device, as the
engines do (threads of one process would share one GIL, so each device's host work would
queue behind the others'), and times in windows that every process starts on one barrier:

* each device's contiguous ceiling, alone and all together;
* at each (direction, block size, batch) point, the resolved route and the batch route, on
  each device alone and on all of them at once;
* with the host pool on the device's NUMA node and on the farthest other node (where the
  host has one with CPUs and memory), the resolved route on each device alone: what the
  wrong node costs.

A window keeps :attr:`MultiSettings.depth` calls in flight for ``window_s`` seconds,
cycling through batches drawn over the whole host pool (so the host side is read from
memory, not from the CPU's caches); its GB/s is the bytes over the time until its last call
completed. A point reports the median of its windows. The aggregate is the sum of the
devices' GB/s in the windows they ran together, and is held (:data:`~.aggregate.BAR`)
against the sum of the ceilings each device reached alone and against the shared ceiling,
the contiguous copies of every device at once: where the host caps them together, only the
latter can be reached.
"""
from __future__ import annotations

import argparse
import multiprocessing
import queue
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional, Sequence

from kvswap.errors import ConfigurationError

from .aggregate import ROUTES, aggregate, multi_report

KiB, MiB = 1024, 1 << 20


@dataclass(frozen=True)
class MultiSettings:
    block_sizes: tuple[int, ...] = (4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB, 128 * KiB)
    batch_sizes: tuple[int, ...] = (1024,)
    windows: int = 3
    window_s: float = 0.2
    pool_bytes: int = 1024 * MiB
    ceiling_bytes: int = 256 * MiB
    # Distinct batches a window cycles through: together this many bytes, well past the
    # CPU caches, so every copy reads or writes host memory itself.
    cycle_bytes: int = 256 * MiB
    depth: int = 8
    numa: bool = True
    seed: int = 0
    # How long a process waits at a barrier for the others before it gives up on them.
    barrier_s: float = 600.0


def multi_settings(host_only: bool, block_sizes: Optional[Sequence[int]] = None,
                   batch_sizes: Optional[Sequence[int]] = None, windows: Optional[int] = None,
                   window_s: Optional[float] = None) -> MultiSettings:
    base = MultiSettings()
    if host_only:  # the host reference copies one block at a time in Python: keep it small
        base = replace(base, block_sizes=(4 * KiB, 16 * KiB), batch_sizes=(16,), windows=1, window_s=0.05,
                       pool_bytes=8 * MiB, ceiling_bytes=4 * MiB, cycle_bytes=1 * MiB)
    return replace(base, block_sizes=tuple(sorted(set(block_sizes or base.block_sizes))),
                   batch_sizes=tuple(sorted(set(batch_sizes or base.batch_sizes))),
                   windows=windows or base.windows, window_s=window_s or base.window_s)


@dataclass(frozen=True)
class Step:
    """One window: which processes (ranks) copy, what, from which host pool."""

    kind: str  # "ceiling", "point" or "numa"
    direction: str
    active: tuple[int, ...]
    window: int
    block_bytes: int = 0
    batch: int = 0
    route: str = ""
    host: str = "right"  # the pool on the device's node, or "wrong": on the farthest other


def schedule(settings: MultiSettings, directions: Sequence[str], count: int) -> list[Step]:
    """Every window of the run, in order: each device alone, then all together, window by
    window, so that a slow spell of the machine hits both alike."""
    ranks = tuple(range(count))
    steps: list[Step] = []

    def alone_then_all(**kw: Any) -> None:
        for w in range(settings.windows):
            steps.extend(Step(active=(r,), window=w, **kw) for r in ranks)
            if count > 1:
                steps.append(Step(active=ranks, window=w, **kw))

    for d in directions:
        alone_then_all(kind="ceiling", direction=d)
        for b in settings.block_sizes:
            for n in settings.batch_sizes:
                for route in ROUTES:
                    alone_then_all(kind="point", direction=d, block_bytes=b, batch=n, route=route)
    if settings.numa:
        for d in directions:
            for r in ranks:
                for b in settings.block_sizes:
                    for n in settings.batch_sizes:
                        for w in range(settings.windows):
                            steps += [Step("numa", d, (r,), w, b, n, "resolved", host) for host in ("right", "wrong")]
    return steps


def farthest_node(topo: Any, node: Optional[int]) -> Optional[int]:
    """The node with memory and CPUs farthest from ``node`` (sysfs ``distance``; ties: the
    lowest id), or None: no other such node, or ``node`` unknown."""
    if node is None:
        return None
    others = [n for n in topo.memory_nodes() if n != node and topo.node_cpus(n)]
    if not others:
        return None
    dist = topo.distances(node)
    return max(others, key=lambda n: (dist.get(n, 0), -n))


# -- in each device's process -------------------------------------------------------

class DeviceRun:
    """One device's side of the run: its pools, its routes checked byte for byte, and the
    windows it is asked to time."""

    def __init__(self, spec: str, settings: MultiSettings, directions: Sequence[str]) -> None:
        from kvswap.memory import numa
        from kvswap.registry.platform import detect
        from kvswap.registry.plugins import plugin_host
        from kvswap.resolution.resolver import resolve
        from kvswap.types import Policy

        from .bench import label
        from .timing import make_timer, on_host
        from .workload import Pools

        self.s = settings
        host = plugin_host()
        self.dev = dev = detect(host, spec)
        self.host_only = on_host(dev)
        self.timer = make_timer(dev)
        self.failures: list[dict[str, Any]] = []
        topo = numa.topology()
        self.node = topo.device_node(dev)
        self.wrong = farthest_node(topo, self.node) if settings.numa and not self.host_only else None
        seed = settings.seed + (dev.index or 0)
        self.pools = {"right": Pools(dev, settings.pool_bytes, seed)}
        if self.wrong is not None:
            self.pools["wrong"] = Pools(dev, settings.pool_bytes, seed, host_node=self.wrong)
        self.fns: dict[tuple[str, int, str], Any] = {}
        self.labels: dict[tuple[str, int, int, str], str] = {}
        for d in directions:
            plan = resolve(d, device=spec, host=host).plan
            batch = next((c.name for c in plan.candidates if c.available and c.kind == "batch"), None)
            forced = resolve(d, device=spec, host=host, policy=Policy(force=batch)) if batch else None
            for b in settings.block_sizes:
                self.fns[(d, b, "resolved")] = resolve(d, device=spec, host=host, block_bytes=b)
                if forced is not None:
                    self.fns[(d, b, "batch")] = forced
        self.batches: dict[tuple[str, str, int, int], list[Any]] = {}
        for (d, b, route), fn in self.fns.items():
            for n in settings.batch_sizes:
                for where, pools in self.pools.items():
                    if n > pools.slots(b):
                        continue
                    key = (where, d, b, n)
                    if key not in self.batches:
                        k = max(1, min(64, settings.cycle_bytes // (n * b)))
                        self.batches[key] = [pools.batch(d, b, n) for _ in range(k)]
                    first = self.batches[key][0]
                    work = fn.assign(first.src, first.dst, first.sizes)
                    self.labels[(d, b, n, route)] = "+".join(dict.fromkeys(label(i, k) for i, k, _ in work))
                    try:
                        pools.verify(self.timer, self._call(fn, first), first)
                    except Exception as e:
                        self.failures.append({"device": spec, "direction": d, "block_bytes": b, "batch": n,
                                              "route": route, "host": where, "error": f"{type(e).__name__}: {e}"})
                        self.batches[key] = []
        self._events: list[Any] = []
        if not self.host_only:
            import torch

            with torch.cuda.device(dev.index or 0):
                self._events = [torch.cuda.Event() for _ in range(settings.depth)]

    @staticmethod
    def _call(fn: Any, batch: Any) -> Callable[[Any], None]:
        return lambda stream: fn(batch.src, batch.dst, batch.sizes, stream=stream)

    def describe(self) -> dict[str, Any]:
        return {"device": self.dev.to_dict(), "spec": self.dev.torch_device, "numa_node": self.node,
                "wrong_node": self.wrong, "timer": "monotonic clock around windows of calls in flight"}

    def measure(self, step: Step) -> Optional[dict[str, Any]]:
        """Time one window; None where this device has nothing to time for ``step``."""
        pools = self.pools.get(step.host)
        if pools is None:
            return None
        if step.kind == "ceiling":
            nbytes = min(self.s.ceiling_bytes, pools.pool_bytes)
            calls, label = [pools.contiguous(step.direction, nbytes)], "contiguous"
        else:
            batches = self.batches.get((step.host, step.direction, step.block_bytes, step.batch))
            fn = self.fns.get((step.direction, step.block_bytes, step.route))
            if not batches or fn is None:
                return None
            nbytes = batches[0].nbytes
            calls = [self._call(fn, b) for b in batches]
            label = self.labels[(step.direction, step.block_bytes, step.batch, step.route)]
        gbps, t0, t1, count = self._window(calls, nbytes)
        return {"gbps": round(gbps, 3), "t0": t0, "t1": t1, "calls": count, "label": label}

    def _window(self, calls: list[Callable[[Any], None]], nbytes: int) -> tuple[float, float, float, int]:
        clock, seconds, k = time.monotonic, self.s.window_s, 0
        if self.host_only:
            t0 = clock()
            while True:
                calls[k % len(calls)](None)
                k += 1
                if clock() - t0 >= seconds:
                    break
            t1 = clock()
        else:
            import torch

            stream, events, depth = self.timer.stream, self._events, self.s.depth
            with torch.cuda.device(self.dev.index or 0), torch.cuda.stream(stream):
                stream.synchronize()
                t0 = clock()
                while True:
                    ev = events[k % depth]
                    if k >= depth:
                        ev.synchronize()  # the call `depth` back has finished: keep `depth` in flight
                    calls[k % len(calls)](stream)
                    ev.record(stream)
                    k += 1
                    if clock() - t0 >= seconds:
                        break
                stream.synchronize()
                t1 = clock()
        return k * nbytes / (t1 - t0) / 1e9, t0, t1, k


def _worker(rank: int, spec: str, settings: MultiSettings, directions: Sequence[str], steps: Sequence[Step],
            barrier: Any, conn: Any, told: Any = None) -> None:
    """A device's process: set up, then time the windows the schedule gives it, meeting the
    other processes at the barrier before and after every window (a process whose setup
    failed still meets them, so that the others go on). It tells the parent through
    ``told`` (a queue) when its setup ends, ``(rank, "setup", seconds or error)``, and rank 0
    after each window, ``(0, "step", i)``, between windows, never inside one."""
    from kvswap.errors import DeviceNotFoundError

    out: dict[str, Any] = {"rank": rank, "spec": spec, "info": {"spec": spec}, "records": [], "failures": []}
    run = None
    t0 = time.monotonic()
    try:
        run = DeviceRun(spec, settings, directions)
        out["info"] = run.describe()
        out["failures"] += run.failures
        setup: Any = round(time.monotonic() - t0, 1)
    except BaseException as e:
        setup = f"{type(e).__name__}: {e}"
        out["failures"].append({"device": spec, "stage": "setup", "error": setup,
                                **({"no_device": True} if isinstance(e, DeviceNotFoundError) else {})})
    if told is not None:
        told.put((rank, "setup", setup))
    try:
        for i, step in enumerate(steps):
            if told is not None and rank == 0 and i:
                told.put((0, "step", i))
            barrier.wait()
            if run is not None and rank in step.active:
                try:
                    rec = run.measure(step)
                except Exception as e:
                    rec = None
                    out["failures"].append({"device": spec, "step": i, **asdict(step),
                                            "error": f"{type(e).__name__}: {e}"})
                if rec is not None:
                    out["records"].append({"step": i, "rank": rank, **rec})
            barrier.wait()
    except threading.BrokenBarrierError:
        out["failures"].append({"device": spec, "stage": "run",
                                "error": "another device's process stopped or timed out; the run ended early"})
    if told is not None and rank == 0:
        told.put((0, "step", len(steps)))
    conn.send(out)
    conn.close()


def run_multi(specs: Sequence[str], settings: MultiSettings, directions: Sequence[str],
              progress: Optional[Callable[[int, str, Any], None]] = None) -> dict[str, Any]:
    """Run every device of ``specs`` in its own process and return :func:`aggregate`'s result.

    :param progress: called in this process as the devices report: ``(rank, "setup",
        seconds or the error)`` once per device, and ``(0, "step", windows done)``.
    """
    if len(set(specs)) != len(specs) and not all(s == "cpu" for s in specs):
        raise ConfigurationError(f"--devices names a device twice: {list(specs)}")
    steps = schedule(settings, directions, len(specs))
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    barrier = ctx.Barrier(len(specs), timeout=settings.barrier_s)
    told = ctx.Queue() if progress is not None else None
    procs = []
    for rank, spec in enumerate(specs):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, args=(rank, spec, settings, list(directions), steps, barrier, send, told),
                        name=f"kvswap-bench-{spec}")
        p.start()
        send.close()
        procs.append((rank, spec, p, recv))

    def hear() -> None:
        while told is not None and progress is not None:
            try:
                progress(*told.get_nowait())
            except queue.Empty:
                return

    outs: dict[int, dict[str, Any]] = {}
    while len(outs) < len(procs):
        hear()
        for rank, spec, p, recv in procs:
            if rank in outs:
                continue
            if recv.poll(0.2):
                try:
                    outs[rank] = recv.recv()
                    continue
                except EOFError:
                    pass
            elif p.is_alive() or recv.poll():  # alive, or it sent its results and exited just now
                continue
            # Gone without its results (killed, crashed): the others stop waiting for it.
            p.join()
            barrier.abort()
            outs[rank] = {"rank": rank, "spec": spec, "info": {"spec": spec}, "records": [], "failures": [
                {"device": spec, "stage": "process", "error": f"the process exited with status {p.exitcode}"}]}
    for _, _, p, _ in procs:
        p.join()
    hear()
    return aggregate(list(outs.values()), steps, settings, directions)


# -- the command line ------------------------------------------------------------------

def device_indices(text: str) -> list[str]:
    """``"0,1,2,3"`` (or ``cuda:0,cuda:1``) -> ``["cuda:0", ...]``."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        spec = f"cuda:{part}" if part.isdigit() else part.lower()
        if spec != "cpu" and not (spec.startswith("cuda:") and spec[5:].isdigit()):
            raise argparse.ArgumentTypeError(f"{text!r}: {part!r} is not a device index (e.g. 0,1,2,3)")
        out.append(spec)
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} names no device; e.g. 0,1,2,3")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", type=device_indices, metavar="0,1,2,3",
                   help="run these devices at once, one process each, and report each device's GB/s and the "
                   "aggregate against the sum of each one's ceiling alone and against the shared ceiling (every "
                   "device's contiguous copy at once), for the resolved route and the batch route, and the "
                   "wrong-NUMA-node / right-node ratio; --passes is then the windows per point (default 3)")
    p.add_argument("--window", type=float, metavar="SECONDS",
                   help="with --devices: seconds a timed window lasts (default 0.2)")


def run(args: argparse.Namespace) -> int:
    """``kvswap bench --devices``."""
    from kvswap.cli import EXIT_FAILED, EXIT_NO_DEVICE, file_to_write, link_directions, write_json
    from kvswap.types import Direction

    from .progress import Progress

    if getattr(args, "device", None) is not None:
        raise ConfigurationError("--device and --devices cannot be used together")
    for name in ("repeats", "confirm"):
        if getattr(args, name, None) is not None:
            raise ConfigurationError(f"--{name} is not used with --devices (--passes: windows per point)")
    if args.window is not None and not 0 < args.window <= 60:
        raise ConfigurationError(f"--window {args.window!r} must be in (0, 60] seconds")
    dirs = [str(d) for d in link_directions(Direction.parse(d) for d in args.directions)]
    file_to_write(args.json, "--json")
    host_only = all(s == "cpu" for s in args.devices)
    settings = multi_settings(host_only, args.block_bytes, args.batches, args.passes, args.window)
    steps = schedule(settings, dirs, len(args.devices))
    print(f"kvswap bench --devices {','.join(args.devices)}: {len(steps)} windows of {settings.window_s} s "
          f"(about {len(steps) * settings.window_s / 60:.1f} min after setup)", file=sys.stderr)
    bar = Progress.on_stderr("window")
    try:
        result = run_multi(args.devices, settings, dirs, progress=progress_of(args.devices, steps, bar))
    finally:
        bar.close()
    if result["rows"]:
        print(multi_report(result))
    for f in result["failures"]:
        print(failure_line(f), file=sys.stderr)
    if args.json is not None:
        write_json(args.json, result)
    if not result["rows"]:
        print("kvswap: error: no device measured anything (the failures above say why)", file=sys.stderr)
        missing = all(f.get("no_device") for f in result["failures"] if f.get("stage") == "setup")
        return EXIT_NO_DEVICE if missing and result["failures"] else EXIT_FAILED
    return 0


def part(step: Step, names: Sequence[str]) -> str:
    """What a window times, in words: the part of the run, and on which device(s)."""
    who = names[step.active[0]] if len(step.active) == 1 else f"all {len(step.active)} devices"
    if step.kind == "ceiling":
        what = "contiguous ceiling"
    elif step.kind == "numa":
        what = f"{step.host} NUMA node, {step.block_bytes // 1024} KiB x {step.batch}"
    else:
        what = f"{step.route}, {step.block_bytes // 1024} KiB x {step.batch}"
    return f"{step.direction} {what} on {who}"


def progress_of(specs: Sequence[str], steps: Sequence[Step], bar: Any) -> Callable[[int, str, Any], None]:
    """What the parent does with the devices' reports (:func:`run_multi`'s ``progress``):
    a line per device when its setup ends, then the bar, window by window, naming the part."""
    done = [0]
    names = [s if list(specs).count(s) == 1 else f"{s}#{i}" for i, s in enumerate(specs)]

    def hear(rank: int, kind: str, what: Any) -> None:
        if kind == "setup":
            state = f"ready ({what} s of setup)" if isinstance(what, (int, float)) else f"setup failed: {what}"
            print(f"  {names[rank]}: {state}", file=sys.stderr, flush=True)
            return
        if done[0] == 0:
            bar.add(len(steps))
        for i in range(done[0], min(what, len(steps))):
            bar.step(part(steps[i], names))
        done[0] = max(done[0], what)

    return hear


def failure_line(f: dict[str, Any]) -> str:
    """One failure of a device's process, in one line: the device, where, and the error."""
    where = ", ".join(f"{k} {v}" for k, v in f.items() if k not in ("device", "error", "rank", "no_device"))
    return f"kvswap: {f.get('device', '?')} failed{f' ({where})' if where else ''}: {f.get('error', 'no error recorded')}"
