"""Host cost of one SwapFn call: resolved functions against forced ones on the same route.

Not a test. For a transfer of ``n`` 16 KiB blocks, microseconds of host time per call
(perf_counter over loops of calls enqueued on one stream; the loops of all contenders are
interleaved, round after round, and the median round is kept) for:

* two functions ``resolve()`` returns (``resolved``, ``resolved2``: a twin, to show the noise);
* two functions forced to the impl (and SM count) the resolved one takes (``forced``, ``forced2``);
* the bound transfer the route calls, without the SwapFn around it (``bound``);
* ``checked()`` alone: what the SwapFn's checks of the arrays cost.

Usage: KVSWAP_PROFILE=profile.json python tests/bench/bench_swapfn_overhead.py
"""
from __future__ import annotations

import statistics
import time

import torch

import kvswap
from kvswap.calibration.binding import bound_at
from kvswap.addressing.descriptors import checked
from kvswap.registry.platform import detect
from kvswap.registry.plugins import plugin_host

BLOCK = 16384


def per_call(fns, args, stream, loops=1000, rounds=15):
    """Median microseconds per call of each of ``fns`` (None: ``checked`` alone)."""
    def loop(fn):
        t = time.perf_counter()
        if fn is None:
            for _ in range(loops):
                checked(*args)
        else:
            for _ in range(loops):
                fn(*args, stream=stream)
        out = (time.perf_counter() - t) / loops
        stream.synchronize()
        return out

    for fn in fns:
        loop(fn)
    times = [[] for _ in fns]
    for r in range(rounds):
        order = list(range(len(fns)))
        if r % 2:
            order.reverse()
        for i in order:
            times[i].append(loop(fns[i]))
    return [statistics.median(t) * 1e6 for t in times]


def main() -> None:
    host = plugin_host()
    dev = detect(host, "cuda:0")
    stream = torch.cuda.Stream()
    pinned = torch.empty(1 << 26, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(1 << 26, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(stream):
        for d in ("h2d", "d2h"):
            src, dst = (pinned, gpu) if d == "h2d" else (gpu, pinned)
            resolved, resolved2 = (kvswap.resolve(d, block_bytes=BLOCK) for _ in range(2))
            print(f"{d}: {len(resolved.plan.routes)} routes; microseconds per call")
            print(f"  {'n':>5} {'route':<18} {'resolved':>9} {'resolved2':>9} {'forced':>9} {'forced2':>9} "
                  f"{'bound':>9} {'checked':>9}  resolved/forced")
            for n in (1, 4, 16, 256):
                s = torch.arange(n, dtype=torch.int64).numpy() * BLOCK * 2 + src.data_ptr()
                t = torch.arange(n, dtype=torch.int64).numpy() * BLOCK * 2 + dst.data_ptr()
                args = (s, t, torch.full((n,), BLOCK, dtype=torch.int64).numpy())
                ((impl, sms, _),) = resolved.assign(*args)
                forced, forced2 = (bound_at(d, dev, "cuda:0", host, impl, sms) if sms
                                   else kvswap.resolve(d, policy=kvswap.Policy(force=impl)) for _ in range(2))
                bound = resolved._fns[(impl, sms)]
                us = per_call([resolved, resolved2, forced, forced2, lambda *a, stream: bound(*a, stream), None],
                              args, stream)
                route = f"{impl}@{sms}" if sms else impl
                print(f"  {n:>5} {route:<18} " + " ".join(f"{u:>9.2f}" for u in us)
                      + f"  {us[2] / us[0]:.3f}", flush=True)


if __name__ == "__main__":
    main()
