"""HiCache's copies beside compute, through kvswap's SGLang hooks and the other ways to make
them (GPU; a benchmark, not a test: it prints ratios measured in one run, it asserts nothing).

SGLang's own pools (``MHATokenToKVPool``, ``MHATokenToKVPoolHost`` pinned) hold llama-3.1-8b's
KV at TP 1 or TP 8 in pages of 16 or 64 tokens, laid out ``layer_first`` or
``page_first_direct`` on the host. Two operations, each beside a forward pass of the model's
per-layer GEMMs (QKV, O, gate-up, down for ``--tokens`` tokens, sharded like the TP):

* ``load``: a prefix of ``--prefix`` tokens, random host pages to device pages, loaded layer by
  layer on a load stream as HiCache does it: after each layer SGLang's ``LayerLoadingEvent``
  records that layer's event and the compute stream waits on it before the layer's GEMMs.
  The step ends with the last GEMM.
* ``backup``: the same pages device to host, all layers in one call on a write stream, beside
  the whole forward. The step ends when both have.

Contenders, each run in turn within every repetition (medians of ``--reps``), every one's bytes
checked once before timing:

* ``kvswap``: SGLang's host pool method with kvswap's hooks (loaded by SGLang's plugin loader);
* ``direct``: SGLang's ``direct`` io semantics rebuilt here on kvswap's CUDA driver binding:
  one ``cuMemcpyAsync`` per run of pages contiguous on both sides (``layer_first``), or one
  ``cuMemcpyBatchAsync`` call with a descriptor per page-layer (``page_first_direct``), each on
  the calling thread as SGLang's ops make them;
* ``jit``: SGLang's JIT transfer kernels (``hicache.cuh``, or ``hicache_tma.cuh`` where SGLang
  picks it), where they build here (nvcc) and take the layout (``layer_first``);
* ``reference``: a contiguous copy of the same bytes per layer (load) or at once (backup): the
  physical bound of the link;
* ``none``: the compute alone.

    python tests/bench/bench_sglang_hicache.py --out "$OUT"    # after: . tests/bench/sglang_env.sh
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, Q_HEADS, INTERMEDIATE = 32, 8, 128, 4096, 32, 14336  # llama-3.1-8b
OPS, LAYOUTS, CONTENDERS = ("load", "backup"), ("layer_first", "page_first_direct"), (
    "kvswap", "direct", "jit", "reference", "none")
DIRECT_BAR_RUN = 64 << 10  # kvswap's bar against direct holds where a page's run is shorter


@dataclass(frozen=True)
class Case:
    op: str
    tp: int
    page: int
    layout: str

    @property
    def heads(self) -> int:
        return max(1, KV_HEADS // self.tp)

    @property
    def run_bytes(self) -> int:
        """One page of one layer's K (or V): what SGLang's direct path copies as one run."""
        return self.page * self.heads * HEAD_DIM * 2


def cases(ops=OPS, tps=(1, 8), pages=(16, 64), layouts=LAYOUTS) -> list[Case]:
    return [Case(*c) for c in itertools.product(ops, tps, pages, layouts)]


def table(rows: list[dict], card: str) -> str:
    """The results as markdown, one line per case and contender, with the ratios of one run."""
    out = [f"{card}: llama-3.1-8b, medians; step/ref and step/direct are ratios within one run", "",
           "| op | TP | page | layout | run | contender | step ms | transfer ms | step/ref | step/direct |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["step_ms"] is None:
            continue  # skipped: said below the table
        ratio = (lambda k: "-" if r.get(k) is None else f"{r[k]:.3f}")
        transfer = "-" if r["transfer_ms"] is None else f"{r['transfer_ms']:.3f}"
        run = f"{r['run_bytes'] >> 10} KiB" if r["run_bytes"] >= 1024 else f"{r['run_bytes']} B"
        out.append(f"| {r['op']} | {r['tp']} | {r['page']} | {r['layout']} | {run} | "
                   f"{r['contender']} | {r['step_ms']:.3f} | {transfer} | {ratio('step_over_reference')} | "
                   f"{ratio('step_over_direct')} |")
    skipped = sorted({(r["contender"], r["skipped"]) for r in rows if r.get("skipped")})
    out += [f"* {c} skipped: {why}" for c, why in skipped]
    return "\n".join(out)


def summary(rows: list[dict], card: str) -> str:
    """One line per case: kvswap's and SGLang direct's step over the contiguous reference's,
    kvswap's over direct's, and the compute alone over the reference (what the link itself
    costs the step), each of one run; then the issue's bars, case by case."""
    cases_: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["step_ms"] is not None:
            cases_.setdefault((r["op"], r["tp"], r["page"], r["layout"], r["run_bytes"]), {})[r["contender"]] = r
    f = (lambda r, k: "-" if r is None or r.get(k) is None else f"{r[k]:.2f}")
    out = [f"{card}: llama-3.1-8b, steps over the contiguous reference's (ratios within one run)", "",
           "| op | TP | page | layout | run | kvswap / ref | direct / ref | kvswap / direct | compute alone / ref |",
           "|---|---|---|---|---|---|---|---|---|"]
    near = f"load: step <= 0.8 x direct (runs < {DIRECT_BAR_RUN >> 10} KiB)"
    verdicts = {"step <= 1.10 x reference": [0, 0], near: [0, 0]}
    for (op, tp, page, layout, run), got in cases_.items():
        kv = got.get("kvswap")
        out.append(f"| {op} | {tp} | {page} | {layout} | {run >> 10} KiB | {f(kv, 'step_over_reference')} | "
                   f"{f(got.get('direct'), 'step_over_reference')} | {f(kv, 'step_over_direct')} | "
                   f"{f(got.get('none'), 'step_over_reference')} |")
        if kv and kv.get("step_over_reference") is not None:
            v = verdicts["step <= 1.10 x reference"]
            v[0], v[1] = v[0] + (kv["step_over_reference"] <= 1.10), v[1] + 1
        if kv and op == "load" and run < DIRECT_BAR_RUN and kv.get("step_over_direct") is not None:
            v = verdicts[near]
            v[0], v[1] = v[0] + (kv["step_over_direct"] <= 0.8), v[1] + 1
    out += ["", "| kvswap's bar | cases passed |", "|---|---|"]
    out += [f"| {bar} | {ok} of {n} |" for bar, (ok, n) in verdicts.items()]
    return "\n".join(out)


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each row's step over its case's reference and direct steps (same run)."""
    by_case: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["step_ms"] is not None:
            by_case.setdefault((r["op"], r["tp"], r["page"], r["layout"]), {})[r["contender"]] = r["step_ms"]
    for r in rows:
        steps = by_case.get((r["op"], r["tp"], r["page"], r["layout"]), {})
        for name, key in (("reference", "step_over_reference"), ("direct", "step_over_direct")):
            r[key] = r["step_ms"] / steps[name] if r["step_ms"] is not None and steps.get(name) else None
    return rows


def write_json(path: Path, rows: list[dict], meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


# -- the device, or the host standing in for it ------------------------------------------------
class Clock:
    """Streams, markers and waits on a CUDA device, or synchronous stand-ins on the host."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch, self.device, self.cuda = torch, device, device.type == "cuda"
        mod = torch.cuda if self.cuda else torch.cpu
        self.compute, self.transfer = mod.Stream(), mod.Stream()
        self.mod = mod

    def stream(self, s: Any) -> Any:
        return self.mod.stream(s)

    def mark(self, stream: Any) -> Any:
        if not self.cuda:
            return time.perf_counter()
        e = self.torch.cuda.Event(enable_timing=True)
        e.record(stream)
        return e

    def wait(self, stream: Any, marker: Any) -> None:
        if self.cuda:
            stream.wait_event(marker)

    def seconds(self, a: Any, b: Any) -> float:
        return (b - a) if not self.cuda else a.elapsed_time(b) / 1e3

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)


class Compute:
    """One layer's forward GEMMs for ``tokens`` tokens, sharded over ``tp`` ranks."""

    def __init__(self, torch: Any, device: Any, tokens: int, tp: int, scale: int = 1) -> None:
        h = HIDDEN // scale
        shapes = [(h, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM // scale // tp), (Q_HEADS * HEAD_DIM // scale // tp, h),
                  (h, 2 * INTERMEDIATE // scale // tp), (INTERMEDIATE // scale // tp, h)]
        self.x = torch.randn(tokens, max(max(s) for s in shapes), device=device, dtype=torch.bfloat16)
        self.w = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]

    def layer(self) -> None:
        for w in self.w:
            self.x[:, :w.shape[0]] @ w


# -- one case: SGLang's pools, the prefix, the contenders ---------------------------------------
class Setup:
    def __init__(self, case: Case, args: argparse.Namespace, clock: Clock) -> None:
        import torch
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host import mha

        self.case, self.torch, self.clock = case, torch, clock
        device = clock.device
        self.layers, P = args.layers, case.page
        n = args.prefix // P
        dev = MHATokenToKVPool(size=(2 * n + 2) * P, page_size=P, dtype=torch.bfloat16, head_num=case.heads,
                               head_dim=HEAD_DIM // args.scale, layer_num=self.layers, device=str(device),
                               enable_memory_saver=False)
        info = dev.get_device_pool_infos()[0].buffer_info
        jit = mha.can_use_hicache_jit_kernel, mha.can_use_write_back_jit_kernel
        mha.can_use_hicache_jit_kernel = mha.can_use_write_back_jit_kernel = lambda **kw: False  # built below if asked
        try:
            self.host = mha.MHATokenToKVPoolHost(
                info, host_to_device_ratio=2.0, host_size=0, page_size=P, layout=case.layout, pin_memory=clock.cuda,
                device="cpu", device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer)
        finally:
            mha.can_use_hicache_jit_kernel, mha.can_use_write_back_jit_kernel = jit
        self.dev = dev
        rng = np.random.default_rng(case.page * 31 + case.tp)
        self.host_pages = rng.choice(np.arange(1, self.host.page_num - 1), n, replace=False)
        self.dev_pages = np.arange(1, n + 1)
        tok = np.arange(P)
        self.h_tok = torch.from_numpy((self.host_pages[:, None] * P + tok).reshape(-1))
        self.d_tok = torch.from_numpy((self.dev_pages[:, None] * P + tok).reshape(-1))
        self.page_bytes = case.run_bytes // args.scale
        self.layer_bytes = 2 * n * self.page_bytes
        self.compute = Compute(torch, device, args.tokens, case.tp, args.scale)
        for t in list(dev.k_buffer) + list(dev.v_buffer):
            t.copy_(torch.randint(-30000, 30000, t.shape, dtype=torch.int16, device=device).view(torch.bfloat16))
        flat = self.host.kv_buffer.view(-1).view(torch.int16)
        flat.copy_(torch.randint(-30000, 30000, flat.shape, dtype=torch.int16))

    # what each contender enqueues on the current stream
    def contenders(self, args: argparse.Namespace) -> dict[str, Any]:
        """Per contender: its ``load(layer)`` and ``backup()``, None (the compute alone) or why
        it does not run here."""
        return {"kvswap": self.kvswap(), "direct": self.direct(), "jit": self.jit(args),
                "reference": self.reference(), "none": None}

    def kvswap(self) -> dict[str, Callable]:
        """SGLang's host pool methods, hooked; each step with index tensors of its own, as each
        HiCache transfer has (the hooks map a transfer's indices to pages once, at its first layer)."""
        host, dev = self.host, self.dev
        ids: list[Any] = [self.h_tok, self.d_tok]

        def begin() -> None:
            ids[:] = [self.h_tok.clone(), self.d_tok.clone()]
        return {"begin": begin,
                "load": lambda l: host.load_to_device_per_layer_physical(dev, ids[0], ids[1], l, "direct"),
                "backup": lambda: host.backup_from_device_all_layer_physical(dev, ids[0], ids[1], "direct")}

    def direct(self) -> dict[str, Callable]:
        """SGLang's ``direct`` io: ``layer_first``, one ``cudaMemcpyAsync`` per run of pages
        consecutive on both sides (``transfer_kv_direct``); ``page_first_direct``, one batch DMA
        call with a descriptor per page-layer. Through kvswap's CUDA driver binding, called on
        the caller's thread as SGLang calls its op (on a CPU, kvswap's host copy stands in)."""
        import kvswap

        host, dev, pb, lf = self.host, self.dev, self.page_bytes, self.case.layout == "layer_first"
        pairs = [(host.k_buffer, dev.k_buffer), (host.v_buffer, dev.v_buffer)]
        item = 2  # bf16

        def descriptors(layers: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            host_a, dev_a = [], []
            for hb, db in pairs:
                for l in layers:
                    if lf:  # [L, S, H, D]: page p of layer l at rows p * P
                        host_a.append(hb.data_ptr() + (l * hb.stride(0) + self.host_pages * self.case.page * hb.stride(1)) * item)
                    else:  # [pages, L, P, H, D]
                        host_a.append(hb.data_ptr() + (self.host_pages * hb.stride(0) + l * hb.stride(1)) * item)
                    dev_a.append(db[l].data_ptr() + self.dev_pages * pb)
            h, d = np.concatenate(host_a).astype(np.int64), np.concatenate(dev_a).astype(np.int64)
            return h, d, np.full(len(h), pb, dtype=np.int64)

        if self.clock.cuda:
            from kvswap.backends.cuda import driver as drv
            from kvswap.backends.cuda.batch import BatchCopy, bind

            index, d = self.clock.device.index or 0, drv.get()
            copy = {direction: (BatchCopy(direction, index, abi=None, batch_fn=None, memcpy_fn=d.memcpy_async(),
                                          error=d.error, context=d.context_guard(index)) if lf  # one call a run
                                else bind(d, direction, index))  # one batch call
                    for direction in ("h2d", "d2h")}
            stream = self.torch.cuda.current_stream

            def call(direction: str, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
                if lf:  # runs of pages consecutive on both sides, found per call as SGLang's op does
                    src, dst, sizes = kvswap.coalesce(src, dst, sizes)
                copy[direction](src, dst, sizes, stream())
        else:
            host_fn = {direction: kvswap.resolve(direction, device="cpu") for direction in ("h2d", "d2h")}

            def call(direction: str, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> None:
                host_fn[direction].call_validated(src, dst, sizes)

        per_layer = [descriptors([l]) for l in range(self.layers)]
        every = descriptors(list(range(self.layers)))
        return {"load": lambda l: call("h2d", *per_layer[l]),
                "backup": lambda: call("d2h", every[1], every[0], every[2])}

    def jit(self, args: argparse.Namespace) -> Any:
        if not self.clock.cuda:
            return "needs CUDA"
        if self.case.layout != "layer_first":
            return "SGLang's JIT kernels take per-layer views of rows (layer_first, page_first)"
        if args.no_jit:
            return "--no-jit"
        if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
            return "nvcc not found"
        try:
            from sglang.kernels.ops.kvcache import hicache as k

            element = self.case.heads * HEAD_DIM // args.scale
            h_gpu, d_gpu = self.h_tok.cuda(), self.d_tok.cuda()
            host, dev = self.host, self.dev
            kp, vp = host.k_data_ptrs, host.v_data_ptrs  # SGLang's own pointer tables, as its backup passes them
            dkp, dvp = host.device_k_data_ptrs, host.device_v_data_ptrs
            row = element * 2

            def load(l: int) -> None:
                k.transfer_hicache_one_layer(k_cache_dst=dev.k_buffer[l], v_cache_dst=dev.v_buffer[l], indices_dst=d_gpu,
                                             k_cache_src=host.k_buffer[l], v_cache_src=host.v_buffer[l],
                                             indices_src=h_gpu, element_dim=element, page_size=self.case.page)

            def backup() -> None:
                k.transfer_hicache_all_layer(k_ptr_dst=kp, v_ptr_dst=vp, indices_dst=h_gpu, k_ptr_src=dkp, v_ptr_src=dvp,
                                             indices_src=d_gpu, kv_cache_src_stride_bytes=row,
                                             kv_cache_dst_stride_bytes=row, element_size=row,
                                             page_size=self.case.page)
            load(0)  # builds it (nvcc) here, outside any timing
            self.torch.cuda.synchronize()
            return {"load": load, "backup": backup}
        except Exception as e:  # no nvcc, no ninja, a build error: say so
            return f"did not build: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"

    def reference(self) -> dict[str, Callable]:
        torch, device = self.torch, self.clock.device
        nbytes = self.layer_bytes
        host = torch.empty(nbytes * self.layers, dtype=torch.uint8, pin_memory=self.clock.cuda)
        dev = torch.empty(nbytes * self.layers, dtype=torch.uint8, device=device)
        host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
        self.ref = (host, dev)
        return {"load": lambda l: dev[l * nbytes:(l + 1) * nbytes].copy_(host[l * nbytes:(l + 1) * nbytes],
                                                                         non_blocking=True),
                "backup": lambda: host.copy_(dev, non_blocking=True)}

    # every byte, once
    def check(self, name: str, op: str, run: Callable[[], None]) -> None:
        torch = self.torch
        if name == "reference":
            host, dev = self.ref
            (dev if op == "load" else host).random_(0, 256)  # poison the destination
            run()
            self.clock.sync()
            assert torch.equal(host, dev.cpu()), f"{name} {op}: wrong bytes"
            return
        host, dev = self.host, self.dev
        side = list(dev.k_buffer) + list(dev.v_buffer) if op == "load" else [host.kv_buffer]
        for t in side:  # poison the destination
            t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, dtype=torch.int16, device=t.device))
        run()
        self.clock.sync()
        for hb, db in ((host.k_buffer, dev.k_buffer), (host.v_buffer, dev.v_buffer)):
            for l in range(self.layers):
                if self.case.layout == "layer_first":
                    h = hb[l][self.h_tok]
                else:
                    h = hb[torch.from_numpy(self.host_pages), l].reshape(-1, *hb.shape[-2:])
                d = db[l][self.d_tok.to(db[l].device)].cpu()
                assert torch.equal(h.view(torch.int16), d.view(torch.int16)), f"{name} {op}: layer {l} wrong bytes"


def step(setup: Setup, op: str, fn: Any) -> tuple[float, Optional[float]]:
    """One step: the contender's copy beside the forward; (step seconds, transfer seconds)."""
    from sglang.srt.managers.cache_controller import LayerLoadingEvent

    clock, comp, L = setup.clock, setup.compute, setup.layers
    events = LayerLoadingEvent(L) if op == "load" and fn is not None else None
    start = clock.mark(clock.compute)
    clock.wait(clock.transfer, start)
    t_end = None
    if fn is not None:
        fn.get("begin", lambda: None)()
        with clock.stream(clock.transfer):
            if op == "load":
                for l in range(L):
                    fn["load"](l)
                    events.complete(l)  # SGLang's on_layer_done: the layer's event on the load stream
            else:
                fn["backup"]()
            t_end = clock.mark(clock.transfer)
    with clock.stream(clock.compute):
        for l in range(L):
            if events is not None:
                events.wait(l)  # the forward waits for the layer it reads
            comp.layer()
        end = clock.mark(clock.compute)
    clock.sync()
    total = clock.seconds(start, end)
    transfer = None if t_end is None else clock.seconds(start, t_end)
    return (max(total, transfer) if transfer is not None and op == "backup" else total), transfer


def measure(case: Case, args: argparse.Namespace, clock: Clock) -> list[dict]:
    setup = Setup(case, args, clock)
    try:
        return _measure(setup, case, args)
    finally:
        # SGLang registers a pinned pool with cudaHostRegister and unregisters it only in destroy():
        # a pool freed while registered would make the next case's registration fail.
        clock.sync()
        setup.host.destroy()


def _measure(setup: Any, case: Case, args: argparse.Namespace) -> list[dict]:
    found = setup.contenders(args)
    live = {n: f for n, f in found.items() if not isinstance(f, str)}
    for name, fn in live.items():
        if fn is not None:
            setup.check(name, case.op, (lambda f=fn: [f["load"](l) for l in range(setup.layers)])
                        if case.op == "load" else fn["backup"])
    times: dict[str, list[tuple[float, Optional[float]]]] = {n: [] for n in live}
    names = list(live)
    for _ in range(args.warmup):
        for n in names:
            step(setup, case.op, live[n])
    for rep in range(args.reps):
        for n in names[rep % len(names):] + names[:rep % len(names)]:  # turns rotate: drift hits all alike
            times[n].append(step(setup, case.op, live[n]))
    from kvswap.integrations.sglang import explain

    route = explain(setup.host)
    rows = []
    for name in CONTENDERS:
        row = dict(asdict(case), run_bytes=setup.page_bytes, contender=name, step_ms=None, transfer_ms=None,
                   bytes=setup.layer_bytes * setup.layers, skipped=found[name] if isinstance(found[name], str) else None)
        if name in times:
            row["step_ms"] = statistics.median(t for t, _ in times[name]) * 1e3
            tr = [x for _, x in times[name] if x is not None]
            row["transfer_ms"] = statistics.median(tr) * 1e3 if tr else None
            row["verified"] = found[name] is not None
        if name == "kvswap":
            row["route"] = route
        rows.append(row)
    return rows


def main(argv: Optional[list[str]] = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where bench_sglang_hicache.json goes")
    ap.add_argument("--device", default="cuda", help="cuda (or cpu: the code path only, tiny sizes)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--tp", default="1,8")
    ap.add_argument("--pages", default="16,64", help="page sizes in tokens")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--prefix", type=int, default=4096, help="tokens loaded or backed up per step")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens the forward's GEMMs compute per layer")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--scale", type=int, default=1, help="divide head_dim and the GEMMs by this (CPU runs)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-jit", action="store_true", help="leave SGLang's JIT kernels out")
    ap.add_argument("--render", type=Path, metavar="FILE.json",
                    help="measure nothing: print the summary of a JSON this script wrote (docs/sglang.md's table)")
    args = ap.parse_args(argv)
    if args.render:
        doc = json.loads(args.render.read_text())
        print(summary(doc["rows"], doc["meta"]["card"]))
        return doc["rows"]
    import torch
    import sglang.srt.plugins as plugins

    os.environ.setdefault("SGLANG_PLUGINS", "kvswap")
    plugins.load_plugins()  # kvswap's hooks, as a server gets them
    device = torch.device(args.device)
    clock = Clock(device)
    grid = cases(args.ops.split(","), [int(t) for t in args.tp.split(",")], [int(p) for p in args.pages.split(",")],
                 args.layouts.split(","))
    rows: list[dict] = []
    for case in grid:
        got = measure(case, args, clock)
        rows += got
        print(f"done: {case}: " + ", ".join(f"{r['contender']} {r['step_ms']:.3f} ms" for r in got
                                            if r.get("step_ms") is not None), file=sys.stderr, flush=True)
    rows = with_ratios(rows)
    card = torch.cuda.get_device_name(device) if clock.cuda else platform.processor() or "cpu"
    print(table(rows, card))
    print()
    print(summary(rows, card))
    meta = {"card": card, "torch": torch.__version__, "args": vars(args), "direct_bar_run_bytes": DIRECT_BAR_RUN}
    write_json(Path(args.out) / "bench_sglang_hicache.json", rows, meta)
    return rows


if __name__ == "__main__":
    main()
