"""The host work of one call, and the modules it passes through (not a test: it prints,
it asserts nothing).

Two calls an engine makes all the time:

* ``swapfn``: a SwapFn call of N scattered descriptors (``--descriptors``), and the bound
  transfer it ends in, called alone (``raw``): the difference is kvswap's own work;
* ``submit``: ``BlockMover.submit`` of B random blocks (``--blocks``) over ``--layers``
  per-layer tensors a side in vLLM's FlashAttention layout (2 chunks a layer and block),
  with the copy built and launched in ``submit`` (``here``) and handed to the mover's
  issuing thread (``thread``: what holds the engine's thread on a device).

Per call: the median of ``--reps`` timed calls (``time.perf_counter_ns``), the *stops* (how
many times the call enters a kvswap module, counted by a profile hook over one call: a
module entered again after the call left it counts again), the modules, the returns (stops
into a module already left) and the µs per stop; ``--profile`` adds cProfile's own time per
kvswap module.

On a GPU the routes are the real ones (``cuda.batch`` or what ``resolve`` picks). On a CPU,
``cuda.batch`` is the CUDA backend's own Python bound to a stand-in libcuda
(tests/cuda_standin.py) whose batch call only counts the descriptors, so the times are
kvswap's Python plus one foreign call; ``host.reference`` copies with memmove.

    python tests/bench/bench_call_path.py [--device cuda:0] [--json out.json]
"""
from __future__ import annotations

import argparse
import bisect
import cProfile
import ctypes
import dataclasses
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

TESTS = Path(__file__).resolve().parents[1]
BLOCK = 4096
PACKAGE = ("kvswap", "core", "backends")


# -- the stand-in route on a CPU --------------------------------------------------------------

def standin_batch() -> Any:
    """A plugin host whose ``cpu`` platform offers the CUDA backend's ``cuda.batch`` on a
    stand-in libcuda that counts descriptors and copies nothing (``(host, lib)``)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from cuda_standin import P_BATCH_12080, StandInLibcuda

    from kvswap import hookimpl
    from kvswap.backends.cuda import batch, driver
    from kvswap.registry.plugins import create_plugin_host

    class Counting(StandInLibcuda):
        def __init__(self) -> None:
            super().__init__(batch_abis=(12080,))
            self.descriptors = 0
            fn = P_BATCH_12080(self._count)
            self._keep.append(fn)
            self.procs[("cuMemcpyBatchAsync", 12080)] = ctypes.cast(fn, ctypes.c_void_p).value

        def _count(self, d, s, n, count, a, ai, na, fi, st):
            self.descriptors += count
            return 0

    lib = Counting()
    drv = driver.Driver(lib, "stand-in libcuda")
    impl = dataclasses.replace(batch.CUDA_BATCH, platforms=("cpu",), requires_pinned=False,
                               availability=lambda device: None,
                               factory=lambda ctx: batch.bind(drv, ctx.direction, 0))

    class Plugin:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            if platform == "cpu":
                register(impl)

    return create_plugin_host(entry_points=[], env={}, extra=[("standin", Plugin())]), lib


# -- measuring ----------------------------------------------------------------------------------

def timed_us(call: Callable[[], Any], reps: int, after: Callable[[], Any] = lambda: None) -> float:
    """The median µs of ``reps`` calls (``after`` runs between them, untimed)."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        call()
        out.append(time.perf_counter_ns() - t0)
        after()
    return statistics.median(out) / 1e3


def _module(frame: Any) -> str:
    name = frame.f_globals.get("__name__", "")
    return name if name.split(".")[0] in PACKAGE else ""


def stops(call: Callable[[], Any]) -> list[str]:
    """The kvswap modules one call passes through, in order: a new entry each time the
    running kvswap frame's module changes (frames of other packages are skipped)."""
    seq: list[str] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        if event == "return":
            frame = frame.f_back
            while frame is not None and not _module(frame):
                frame = frame.f_back
            if frame is None:
                return
        mod = _module(frame)
        if mod and (not seq or seq[-1] != mod):
            seq.append(mod)

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seq


def by_module(call: Callable[[], Any], reps: int, after: Callable[[], Any] = lambda: None) -> dict[str, float]:
    """cProfile's own time per kvswap module, µs per call."""
    prof = cProfile.Profile()
    for _ in range(reps):
        prof.enable()
        call()
        prof.disable()
        after()
    out: dict[str, float] = {}
    for (path, _, _), (_, _, tt, _, _) in pstats.Stats(prof).stats.items():
        parts = Path(path).parts
        key = "/".join(parts[-2:]) if any(p in ("core", "backends", "kvswap") for p in parts) else "(other)"
        out[key] = out.get(key, 0.0) + tt * 1e6 / reps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def row(kind: str, route: str, n: int, us: float, raw: Any, seq: list[str], modules: Any) -> dict:
    visits = len(seq)
    r = dict(call=kind, route=route, n=n, us=round(us, 2), raw_us=None if raw is None else round(raw, 2),
             stops=visits, modules=len(set(seq)), returns=visits - len(set(seq)),
             us_per_stop=round(us / visits, 2) if visits else None, path=seq)
    if modules is not None:
        r["by_module_us"] = {k: round(v, 2) for k, v in modules.items()}
    extra = "" if raw is None else f"  raw {raw:8.2f} us"
    print(f"{kind:7s} {route:22s} n={n:6d}  {us:8.2f} us/call{extra}  stops {visits:3d} "
          f"({r['modules']} modules, {r['returns']} returns)  {r['us_per_stop'] or 0:6.2f} us/stop", flush=True)
    if modules is not None:
        print("        " + ", ".join(f"{k} {v:.1f}" for k, v in list(modules.items())[:8]))
    return r


# -- the two calls --------------------------------------------------------------------------------

def swapfn_rows(args: argparse.Namespace, env: dict) -> list[dict]:
    import kvswap

    rng = np.random.default_rng(0)
    rows = []
    n_max = max(args.descriptors)
    slot = 2 * BLOCK
    src_pool, dst_pool = env["pools"](n_max * slot)
    for route in env["routes"]:
        fn = kvswap.resolve("h2d", policy=kvswap.Policy(force=route), **env["resolve"])
        for n in args.descriptors:
            s = rng.permutation(n_max)[:n].astype(np.int64) * slot + src_pool
            d = rng.permutation(n_max)[:n].astype(np.int64) * slot + dst_pool
            z = np.full(n, BLOCK, dtype=np.int64)
            stream = env["stream"]
            steps = fn.whole_batch_steps(BLOCK, BLOCK)
            bound = steps.fns[bisect.bisect_right(steps.starts, n) - 1]  # the transfer this batch ends in
            call = lambda: fn(s, d, z, stream=stream)  # noqa: E731
            for _ in range(3):
                call()
            us = timed_us(call, args.reps)
            raw = timed_us(lambda: bound(s, d, z, stream), args.reps)
            env["sync"]()
            mods = by_module(call, args.reps) if args.profile else None
            rows.append(row("swapfn", route, n, us, raw, stops(call), mods))
            env["sync"]()
    return rows


def submit_rows(args: argparse.Namespace, env: dict) -> list[dict]:
    import torch

    import kvswap

    rng = np.random.default_rng(1)
    nb = max(2 * max(args.blocks), 64)
    shape = (2, nb, 16, 2, BLOCK // 64)  # bf16: a chunk of 16 x 2 x 64 x 2 bytes = 4 KiB
    host = [torch.randint(-9, 9, shape, dtype=torch.bfloat16) for _ in range(args.layers)]
    host = [t.pin_memory() for t in host] if env["device"] != "cpu" else host
    dev = [torch.randint(-9, 9, shape, dtype=torch.bfloat16, device=env["device"]) for _ in range(args.layers)]
    rows = []
    for route in env["routes"]:
        for threaded in (False, True):
            mover = kvswap.BlockMover(host, dev, "h2d", block_dim=1, policy=kvswap.Policy(force=route),
                                      issuing_thread=threaded, **env["mover"])
            if env["device"] == "cpu":  # host tensors: the stand-in driver gets a stream handle all the same
                mover._plan.completion.stream = env["stream"]
            for b in args.blocks:
                draws = [(rng.permutation(nb)[:b].astype(np.int64), rng.permutation(nb)[:b].astype(np.int64))
                         for _ in range(8)]
                k = iter(range(1 << 30))

                def call() -> int:
                    return mover.submit(*draws[next(k) % 8])

                def settle() -> None:
                    mover.wait()
                    mover.poll()

                for _ in range(3):
                    call()
                    settle()
                us = timed_us(call, args.reps, settle)
                seq = stops(call)
                settle()
                mods = by_module(call, args.reps, settle) if args.profile else None
                rows.append(row("submit", f"{route}/{'thread' if threaded else 'here'}", b, us, None, seq, mods))
            mover.close()
    return rows


def environment(device: str) -> dict:
    if device == "cpu":
        host, lib = standin_batch()
        keep: list = []

        def pools(nbytes: int) -> tuple[int, int]:
            a, b = np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)
            keep.extend((a, b))
            return a.ctypes.data, b.ctypes.data

        from kvswap.registry.plugins import reset_plugin_host

        reset_plugin_host(host)
        return dict(device="cpu", routes=("cuda.batch", "host.reference"), resolve=dict(host=host),
                    mover={}, stream=0x777000, pools=pools, sync=lambda: None, lib=lib)
    import torch

    held: list = []

    def gpu_pools(nbytes: int) -> tuple[int, int]:
        a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        b = torch.empty(nbytes, dtype=torch.uint8, device=device)
        held.extend((a, b))
        return a.data_ptr(), b.data_ptr()

    stream = torch.cuda.Stream(device=device)
    return dict(device=device, routes=("cuda.batch", "triton.kernel"), resolve=dict(device=device), mover={},
                stream=stream, pools=gpu_pools, sync=torch.cuda.synchronize)


def main(argv: Any = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, help="cpu (stand-ins) or cuda:N; default: cuda:0 where there is one")
    p.add_argument("--descriptors", default="1,64,5120", help="SwapFn batch sizes")
    p.add_argument("--blocks", default="1,64", help="submit job sizes, in blocks")
    p.add_argument("--layers", type=int, default=40, help="per-layer tensors a side (2 chunks each per block)")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="also cProfile's own time per module")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.descriptors = [int(x) for x in args.descriptors.split(",")]
    args.blocks = [int(x) for x in args.blocks.split(",")]
    if args.device is None:
        import torch

        args.device = "cuda:0" if torch.cuda.is_available() else "cpu"
    env = environment(args.device)
    print(f"device {args.device}; median of {args.reps} calls; stops: kvswap modules entered along one call")
    rows = swapfn_rows(args, env) + submit_rows(args, env)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=args.device, rows=rows), indent=1))
    return rows


if __name__ == "__main__":
    main()
