"""Where the host->device batch call's thread time goes (a GPU diagnostic, not a test).

Through BlockMover on the ``cuda.batch`` route with 28-80 per-layer tensors a side, a
host->device submit held the thread 1.5-3.9 µs a descriptor and device->host 0.4 µs,
while a raw ``cuMemcpyBatchAsync`` over 1-160 pinned host tensors and ONE device
allocation cost 0.45-0.98 µs either way. This script times, with the stream kept busy
(so only the call's host work is timed, median of ``--reps``):

Part ``raw``: the driver call alone, over a grid of
  * ``allocs``: device memory in 1..160 separate ``cuMemAlloc`` allocations (``one``:
    the same count of regions cut from ONE allocation; ``torch``: torch tensors, as an
    engine's per-layer KV cache is);
  * ``host``: pinned host tensors, 1 or as many as the device allocations;
  * ``order``: ``srcAccessOrder`` STREAM / ANY (``--orders`` adds DURING_API_CALL; ANY
    is timed device->host too, on garbage bytes, to separate order from direction);
  * ``hints``: ``srcLocHint``/``dstLocHint`` unset, or set to the true locations;
  * ``desc``: descriptors grouped by allocation (as BlockMover orders a layer's blocks)
    or interleaved across allocations (a block's layers side by side);
  * ``arrays``: descriptor arrays in pageable numpy memory or in pinned memory (where
    BlockMover keeps them);
  * both directions.
Part ``kvswap``: BlockMover on model-like layouts (per-layer tensors on both sides,
``cuda.batch`` forced, the call on this thread), each
step timed alone: descriptor build + coalesce, the SwapFn call, the raw driver call on
the very same arrays with kvswap's attributes and with the other order, and the whole
submit.

It prints one table per part and, at the end, the factors that move the cost most; with
``--json FILE`` every row goes to FILE.

    python3 tests/bench/diag_batch_submit.py --json $OUT/diag.json
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import platform
import statistics
import sys
import time
from typing import Any, Callable, Optional

import numpy as np


ORDERS = {"stream": 1, "during": 2, "any": 3}
LOC_DEVICE, LOC_HOST = 1, 2  # CU_MEM_LOCATION_TYPE_DEVICE / _HOST
_MEM_ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)
_MEM_FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64)


class Caller:
    """The raw batch entry point, called the way backends/cuda/batch.py calls it."""

    def __init__(self, device_index: int) -> None:
        from kvswap.backends.cuda import driver as drv

        self.drv = drv
        self.driver = drv.get()
        self.abi, why = self.driver.batch_abi()
        if self.abi is None:
            raise SystemExit(f"no cuMemcpyBatchAsync here: {why}")
        self.fn = self.driver.batch_function(self.abi)
        self.device_index = device_index
        self.alloc = self.driver.proc("cuMemAlloc", 3020, _MEM_ALLOC)
        self.free = self.driver.proc("cuMemFree", 3020, _MEM_FREE)
        self.idx = (ctypes.c_size_t * 1)(0)

    def attributes(self, order: str, hints: bool, src_host: bool) -> Any:
        a = self.drv.MemcpyAttributes()
        a.srcAccessOrder = ORDERS[order]
        if hints:
            host = (LOC_HOST, 0)
            dev = (LOC_DEVICE, self.device_index)
            a.srcLocHint.type, a.srcLocHint.id = host if src_host else dev
            a.dstLocHint.type, a.dstLocHint.id = dev if src_host else host
        return a

    def call(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, attr: Any, stream: int) -> int:
        args = (dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, len(sizes), ctypes.addressof(attr),
                ctypes.addressof(self.idx), 1)
        if self.abi.has_fail_idx:
            failed = ctypes.c_size_t(0)
            return self.fn(*args, ctypes.addressof(failed), stream)
        return self.fn(*args, stream)

    def mem_alloc(self, nbytes: int) -> int:
        p = ctypes.c_uint64(0)
        rc = self.alloc(ctypes.byref(p), nbytes)
        if rc:
            raise self.driver.error("cuMemAlloc", rc)
        return int(p.value)


def busy_then(stream: Any, seconds: float, fn: Callable[[], Any]) -> float:
    """Keep ``stream`` busy ``seconds`` (a sleep kernel), then time ``fn()`` on the host (µs)."""
    import torch

    with torch.cuda.stream(stream):
        torch.cuda._sleep(int(seconds * 2.0e9))  # ~2 GHz SM clock: long enough either way
    gc.disable()
    t0 = time.perf_counter_ns()
    fn()
    t1 = time.perf_counter_ns()
    gc.enable()
    stream.synchronize()
    return (t1 - t0) / 1e3


def timed(stream: Any, fn: Callable[[], Any], reps: int) -> float:
    """Median host µs of ``fn`` over ``reps`` calls, each behind a busy stream sized from a first call."""
    first = busy_then(stream, 0.02, fn)
    busy = 1.5 * first / 1e6 + 0.002
    return statistics.median(busy_then(stream, busy, fn) for _ in range(reps))


# ---------------------------------------------------------------------------------------
# Part raw
# ---------------------------------------------------------------------------------------

class RawLayout:
    """``count`` descriptors of ``block`` bytes over ``allocs`` device regions and ``hosts``
    pinned host tensors, each block at a random slot of its region."""

    def __init__(self, caller: Caller, count: int, block: int, allocs: int, hosts: int, kind: str,
                 rng: np.random.Generator) -> None:
        import torch

        per = -(-count // allocs)
        slots = 2 * per  # half the slots used: scattered, never contiguous runs
        self.keep: list = []
        self.dev_ptrs: list[int] = []
        self._free: list[int] = []
        region = slots * block
        if kind == "one":
            base = caller.mem_alloc(region * allocs)
            self._free.append(base)
            self.dev_ptrs = [base + k * region for k in range(allocs)]
        elif kind == "torch":
            for _ in range(allocs):
                t = torch.empty(region, dtype=torch.uint8, device=f"cuda:{caller.device_index}")
                self.keep.append(t)
                self.dev_ptrs.append(t.data_ptr())
        else:
            for _ in range(allocs):
                p = caller.mem_alloc(region)
                self._free.append(p)
                self.dev_ptrs.append(p)
        host_per = -(-count // hosts)
        self.host_ptrs = []
        for _ in range(hosts):
            t = torch.empty(2 * host_per * block, dtype=torch.uint8, pin_memory=True)
            self.keep.append(t)
            self.host_ptrs.append(t.data_ptr())
        self.caller = caller
        # Descriptor k: region k % allocs or k // per, a random free slot there.
        dev_slot = np.concatenate([rng.permutation(slots)[:per] for _ in range(allocs)])[:count]
        host_slot = np.concatenate([rng.permutation(2 * host_per)[:host_per] for _ in range(hosts)])[:count]
        self.grouped_region = np.repeat(np.arange(allocs), per)[:count]
        self.grouped_host = np.repeat(np.arange(hosts), host_per)[:count]
        dev = np.array(self.dev_ptrs, dtype=np.int64)[self.grouped_region] + dev_slot * block
        host = np.array(self.host_ptrs, dtype=np.int64)[self.grouped_host] + host_slot * block
        self.dev, self.host = dev, host
        # Interleaved: the same descriptors, region by region round-robin.
        order = np.argsort(np.arange(count) % per * allocs + self.grouped_region, kind="stable")
        self.interleave = order
        self.sizes = np.full(count, block, dtype=np.int64)

    def arrays(self, direction: str, desc: str, pinned: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any]:
        import torch

        src, dst = (self.host, self.dev) if direction == "h2d" else (self.dev, self.host)
        if desc == "interleaved":
            src, dst = src[self.interleave], dst[self.interleave]
        if not pinned:
            return src.copy(), dst.copy(), self.sizes.copy(), None
        buf = torch.empty((3, len(src)), dtype=torch.int64, pin_memory=True)
        arr = buf.numpy()
        arr[0], arr[1], arr[2] = src, dst, self.sizes
        return arr[0], arr[1], arr[2], buf

    def close(self) -> None:
        for p in self._free:
            self.caller.free(p)
        self.keep.clear()


def raw_part(args: argparse.Namespace, caller: Caller, stream: Any, rows: list) -> None:
    rng = np.random.default_rng(0)
    handle = int(stream.cuda_stream)
    kinds = ["separate", "one"] + (["torch"] if args.torch_allocs else [])
    for kind, allocs in itertools.product(kinds, args.allocs):
        if kind == "one" and allocs == 1:
            continue  # the same as separate x 1
        for hosts in sorted({1, allocs}):
            layout = RawLayout(caller, args.descriptors, args.block, allocs, hosts, kind, rng)
            try:
                for direction, order, hints, desc, pinned in itertools.product(
                        ("h2d", "d2h"), args.orders, (False, True), ("grouped", "interleaved"), (False, True)):
                    # (ANY on a device source is unsafe for real data; the bytes here are
                    # garbage, and it tells whether the order or the direction costs.)
                    if not pinned and (hints or desc != "grouped"):
                        continue  # pageable arrays only at the baseline settings
                    s, d, z, keep = layout.arrays(direction, desc, pinned)
                    attr = caller.attributes(order, hints, direction == "h2d")
                    rc = caller.call(s, d, z, attr, handle)  # also warms up
                    stream.synchronize()
                    if rc:
                        rows.append(dict(part="raw", direction=direction, kind=kind, allocs=allocs, hosts=hosts,
                                         order=order, hints=hints, desc=desc, pinned_arrays=pinned, error=rc))
                        continue
                    us = timed(stream, lambda: caller.call(s, d, z, attr, handle), args.reps)
                    row = dict(part="raw", direction=direction, kind=kind, allocs=allocs, hosts=hosts, order=order,
                               hints=hints, desc=desc, pinned_arrays=pinned, descriptors=len(z), block=args.block,
                               us=round(us, 1), us_per_desc=round(us / len(z), 3))
                    rows.append(row)
                    print(f"raw {direction} {kind:8s} allocs={allocs:3d} hosts={hosts:3d} order={order:6s} "
                          f"hints={int(hints)} {desc:11s} arrays={'pinned' if pinned else 'numpy':6s} "
                          f"{row['us_per_desc']:.3f} us/desc", flush=True)
                    del keep
            finally:
                layout.close()


# ---------------------------------------------------------------------------------------
# Part kvswap
# ---------------------------------------------------------------------------------------

MODELS = {
    # name: (layers, tensor shape after num_blocks, dtype bytes, block_dim) -- FlashAttention
    # (2, num_blocks, 16, kv_heads, head_dim) per layer, or MLA (num_blocks, 16, 576).
    "qwen2.5-7b-tp4": (28, "flash", (16, 1, 128)),
    "llama-3.1-70b-tp8": (80, "flash", (16, 1, 128)),
    "deepseek-v3-mla": (61, "mla", (16, 576)),
}


def model_tensors(name: str, blocks: int, device: str, pinned: bool) -> tuple[list, int]:
    import torch

    layers, layout, inner = MODELS[name]
    out = []
    for _ in range(layers):
        shape = (2, blocks, *inner) if layout == "flash" else (blocks, *inner)
        if device == "cpu":
            t = torch.empty(shape, dtype=torch.bfloat16, pin_memory=pinned)
        else:
            t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        out.append(t)
    return out, 1 if layout == "flash" else 0


def kvswap_part(args: argparse.Namespace, caller: Caller, stream: Any, rows: list) -> None:
    import torch

    import kvswap
    from kvswap import Policy

    rng = np.random.default_rng(1)
    dev = f"cuda:{caller.device_index}"
    for name in args.models:
        host, bd = model_tensors(name, args.host_blocks, "cpu", True)
        gpu, _ = model_tensors(name, args.gpu_blocks, dev, False)
        for direction in ("h2d", "d2h"):
            src, dst = (host, gpu) if direction == "h2d" else (gpu, host)
            mover = kvswap.BlockMover(src, dst, direction, block_dim=bd, policy=Policy(force="cuda.batch"),
                                      stream=stream)
            nsrc, ndst = mover.num_src_blocks, mover.num_dst_blocks
            for blocks in args.blocks:
                sid = rng.integers(0, nsrc, blocks).astype(np.int64)
                did = rng.permutation(ndst)[:blocks].astype(np.int64)
                s, d, z = mover.descriptors(sid, did)
                # The same arrays in a pinned buffer, as submit hands them to the driver.
                pbuf = torch.empty((3, len(z)), dtype=torch.int64, pin_memory=True)
                parr = pbuf.numpy()
                parr[0], parr[1], parr[2] = s, d, z
                handle = int(stream.cuda_stream)
                fn = mover.swap_fn
                own = caller.attributes("any" if direction == "h2d" else "stream", False, direction == "h2d")
                other = caller.attributes("stream" if direction == "h2d" else "any", False, direction == "h2d")
                hinted = caller.attributes("any" if direction == "h2d" else "stream", True, direction == "h2d")
                steps = {
                    "descriptors()": lambda: mover.descriptors(sid, did),
                    "swapfn(pinned arrays)": lambda: fn(parr[0], parr[1], parr[2], stream=handle),
                    "raw kvswap attrs (pinned arrays)": lambda: caller.call(parr[0], parr[1], parr[2], own, handle),
                    "raw kvswap attrs (numpy arrays)": lambda: caller.call(s, d, z, own, handle),
                    "raw other order (pinned arrays)": lambda: caller.call(parr[0], parr[1], parr[2], other, handle),
                    "raw with location hints": lambda: caller.call(parr[0], parr[1], parr[2], hinted, handle),
                }
                for step, fn_ in (("build+coalesce", None), *steps.items()):
                    if fn_ is None:
                        us = _build_us(mover, sid, did, args.reps)
                    else:
                        fn_()
                        stream.synchronize()
                        us = timed(stream, fn_, args.reps)
                    rows.append(dict(part="kvswap", model=name, direction=direction, blocks=blocks,
                                     descriptors=len(z), chunks_per_block=mover.chunks_per_block, step=step,
                                     us=round(us, 1), us_per_desc=round(us / max(1, len(z)), 3)))
                    print(f"kvswap {name:18s} {direction} blocks={blocks:4d} desc={len(z):6d} {step:34s} "
                          f"{us:9.1f} us  {us / max(1, len(z)):.3f} us/desc", flush=True)
                us = timed(stream, lambda: mover.submit(sid, did), args.reps)
                mover.wait()
                mover.poll()
                rows.append(dict(part="kvswap", model=name, direction=direction, blocks=blocks, descriptors=len(z),
                                 chunks_per_block=mover.chunks_per_block, step="submit", us=round(us, 1),
                                 us_per_desc=round(us / max(1, len(z)), 3)))
                print(f"kvswap {name:18s} {direction} blocks={blocks:4d} desc={len(z):6d} {'submit':34s} "
                      f"{us:9.1f} us  {us / max(1, len(z)):.3f} us/desc", flush=True)
            mover.close()
        del host, gpu
        torch.cuda.empty_cache()


def _build_us(mover: Any, sid: np.ndarray, did: np.ndarray, reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter_ns()
        buf, _ = mover._plan.descriptors.build([(sid, did)])  # one KV group: build + coalesce, as the issuing thread does
        times.append((time.perf_counter_ns() - t0) / 1e3)
        mover.pool.release(buf)
    return statistics.median(times[1:])


# ---------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------

def summarize(rows: list) -> list[str]:
    """The factors that move the raw call's cost most, one line each."""
    raw = [r for r in rows if r.get("part") == "raw" and "us_per_desc" in r]
    lines = []

    def med(**match: Any) -> Optional[float]:
        v = [r["us_per_desc"] for r in raw if all(r.get(k) == x for k, x in match.items())]
        return statistics.median(v) if v else None

    base = dict(kind="separate", hints=False, desc="grouped", pinned_arrays=True)
    for direction in ("h2d", "d2h"):
        for order in sorted({r["order"] for r in raw if r["direction"] == direction}):
            cells = []
            for allocs in sorted({r["allocs"] for r in raw}):
                v = med(direction=direction, order=order, allocs=allocs, hosts=allocs, **base)
                cells.append(f"{allocs}:{v:.2f}" if v is not None else f"{allocs}:-")
            lines.append(f"{direction} order={order:6s} us/desc by device allocations (hosts = allocs): "
                         + "  ".join(cells))
    for label, a, b in (
        ("one allocation cut in regions vs separate allocations", dict(kind="one"), dict(kind="separate")),
        ("location hints on vs off", dict(hints=True), dict(hints=False)),
        ("interleaved vs grouped descriptors", dict(desc="interleaved"), dict(desc="grouped")),
        ("pinned vs numpy descriptor arrays", dict(pinned_arrays=True), dict(pinned_arrays=False)),
        ("ANY vs STREAM order (h2d)", dict(order="any", direction="h2d"), dict(order="stream", direction="h2d")),
    ):
        for direction in ("h2d", "d2h"):
            ratios = []
            for r in raw:
                if r["direction"] != direction or not all(r.get(k) == v for k, v in a.items()):
                    continue
                key = {k: r.get(k) for k in ("direction", "kind", "allocs", "hosts", "order", "hints", "desc",
                                             "pinned_arrays")}
                key.update(b)
                twin = [t for t in raw if all(t.get(k) == v for k, v in key.items())]
                if twin:
                    ratios.append(r["us_per_desc"] / twin[0]["us_per_desc"])
            if ratios:
                lines.append(f"{direction}: {label}: median x{statistics.median(ratios):.2f} "
                             f"(min x{min(ratios):.2f}, max x{max(ratios):.2f}, {len(ratios)} pairs)")
    kv = [r for r in rows if r.get("part") == "kvswap"]
    for key in sorted({(r["model"], r["direction"], r["blocks"]) for r in kv}):
        steps = {r["step"]: r["us"] for r in kv if (r["model"], r["direction"], r["blocks"]) == key}
        lines.append(f"kvswap {key[0]} {key[1]} {key[2]} blocks: " + ", ".join(f"{k} {v:.0f} us"
                                                                             for k, v in steps.items()))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write every row to this file")
    ap.add_argument("--part", choices=("raw", "kvswap", "both"), default="both")
    ap.add_argument("--descriptors", type=int, default=16384)
    ap.add_argument("--block", type=int, default=4096, help="bytes per descriptor in part raw")
    ap.add_argument("--allocs", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 28, 80, 160])
    ap.add_argument("--orders", type=lambda s: s.split(","), default=["stream", "any"],
                    help="srcAccessOrder values: stream, any, during")
    ap.add_argument("--no-torch-allocs", dest="torch_allocs", action="store_false",
                    help="skip device regions made of torch tensors (as an engine's KV cache is)")
    ap.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    ap.add_argument("--blocks", type=lambda s: [int(x) for x in s.split(",")], default=[32, 512])
    ap.add_argument("--host-blocks", type=int, default=2048)
    ap.add_argument("--gpu-blocks", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.cuda.init()
    index = torch.cuda.current_device()
    torch.empty(1, device=f"cuda:{index}")  # the primary context, current on this thread
    caller = Caller(index)
    stream = torch.cuda.Stream()
    rows: list = []
    started = time.time()
    if args.part in ("raw", "both"):
        raw_part(args, caller, stream, rows)
    if args.part in ("kvswap", "both"):
        kvswap_part(args, caller, stream, rows)
    lines = summarize(rows)
    print("\n== summary (us per descriptor; lower is better)")
    for line in lines:
        print(line)
    if args.json:
        meta = dict(device=torch.cuda.get_device_name(index), driver=caller.driver.version, abi=caller.abi.label,
                    torch=torch.__version__, python=platform.python_version(), host=platform.node(),
                    seconds=round(time.time() - started, 1), argv=sys.argv[1:])
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, summary=lines, rows=rows), f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
