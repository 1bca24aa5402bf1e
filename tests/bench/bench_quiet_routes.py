"""Why a copy that crosses the link on the SMs slows the GEMMs beside it, and which routes
stay quiet (GPU; not a test: it prints, it asserts nothing but the bytes it checks).

Beside bf16 GEMMs (one CUDA graph on the compute stream, about ``--compute-ms`` long),
each contender copies for longer than the GEMMs run; the GEMMs' slowdown is their time
beside the copy over their time alone, interleaved, median of ``--reps``:

* ``ce contiguous``: one contiguous copy on the copy engines (the physical reference);
* ``ldst host``: a CUDA C copy kernel on ``k`` CTAs, per-thread 16-byte loads and stores,
  scattered 16 KiB chunks of a large pinned host pool to or from device memory;
* ``ldst host small``: the same kernel over 4 chunks of host memory, read again and again
  (the same link traffic, almost no distinct host pages: the GPU's address translation
  left out);
* ``ldst device``: the same kernel between two device buffers (SM traffic that never
  leaves the GPU);
* ``hold SM``: thread blocks that hold their SMs and touch no memory (the control);
* ``tma host``: a CUDA C kernel whose single thread keeps a ring of shared-memory stages
  full with bulk copies (``cp.async.bulk`` and mbarriers), the same chunks.

Then, without compute: host threads gathering chunks into a pinned buffer (``np.take``
on a thread pool; ``torch.index_select`` on torch's threads), alone and beside a
contiguous copy on the link; and the staged route's device side (scattered chunks to a
contiguous device buffer) by kvswap's kernel and by a CUDA C gather, GB/s of job bytes.

Needs CuPy (its NVRTC) for the CUDA C kernels; every copy's bytes are checked once.

    python3 tests/bench/bench_quiet_routes.py --json $OUT/quiet.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

CUDA_SRC = r"""
extern "C" __global__ void ldst_copy(const long long* __restrict__ srcs, const long long* __restrict__ dsts,
                                     long long n, int chunk, long long total) {
  // Items k = blockIdx.x, += gridDim.x, up to total: chunk bytes of srcs[k % n] to dsts[k % n].
  // Four items at a time, the CTA's threads side by side in 16-byte vectors.
  const int per = chunk / 16;
  for (long long k0 = blockIdx.x; k0 < total; k0 += 4LL * gridDim.x) {
    for (int v = threadIdx.x; v < per; v += blockDim.x) {
      uint4 a[4];
      #pragma unroll
      for (int u = 0; u < 4; ++u) {
        long long k = k0 + (long long)u * gridDim.x;
        if (k < total) a[u] = __ldcv((const uint4*)srcs[k % n] + v);
      }
      #pragma unroll
      for (int u = 0; u < 4; ++u) {
        long long k = k0 + (long long)u * gridDim.x;
        if (k < total) __stcg((uint4*)dsts[k % n] + v, a[u]);
      }
    }
  }
}

#define MAXST 32
extern "C" __global__ void tma_copy(const long long* __restrict__ srcs, const long long* __restrict__ dsts,
                                    long long n, int chunk, long long total, int stages) {
  // One thread a CTA: a ring of `stages` shared-memory stages, each a bulk load (global to shared,
  // completing on its mbarrier) then a bulk store (shared to global); a stage is refilled once its
  // store has read it.
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bars[MAXST];
  if (threadIdx.x != 0) return;
  const unsigned sbase = (unsigned)__cvta_generic_to_shared(smem);
  for (int s = 0; s < stages; ++s) {
    unsigned b = (unsigned)__cvta_generic_to_shared(&bars[s]);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(b));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  long long count = total > blockIdx.x ? (total - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  for (long long k = 0; k < count + stages; ++k) {
    if (k >= stages) {  // drain item k - stages
      long long q = k - stages;
      int s = (int)(q % stages);
      unsigned b = (unsigned)__cvta_generic_to_shared(&bars[s]);
      unsigned phase = (unsigned)((q / stages) & 1);
      unsigned done = 0;
      while (!done) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done) : "r"(b), "r"(phase) : "memory");
      }
      long long i = (blockIdx.x + q * gridDim.x) % n;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(dsts[i]), "r"(sbase + s * chunk), "r"(chunk) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    if (k < count) {  // fill item k into stage k % stages, once the store of k - stages has read it
      int s = (int)(k % stages);
      if (k >= stages) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      unsigned b = (unsigned)__cvta_generic_to_shared(&bars[s]);
      long long i = (blockIdx.x + k * gridDim.x) % n;
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(b), "r"(chunk) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(sbase + s * chunk), "l"(srcs[i]), "r"(chunk), "r"(b) : "memory");
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

extern "C" __global__ void hold(long long ns) {
  // A thread block that holds its SM for ns nanoseconds and touches no memory.
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { __nanosleep(1000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns);
}

extern "C" __global__ void gather(const long long* __restrict__ srcs, const long long* __restrict__ dsts,
                                  long long n, int chunk) {
  // Device side of a staged copy: one warp a chunk, 16-byte vectors, UNROLL in flight per lane.
  const int lane = threadIdx.x & 31;
  const int warps = blockDim.x >> 5;
  const int per = chunk / 16;
  for (long long k = (long long)blockIdx.x * warps + (threadIdx.x >> 5); k < n; k += (long long)gridDim.x * warps) {
    const uint4* s = (const uint4*)srcs[k];
    uint4* d = (uint4*)dsts[k];
    for (int v = lane; v < per; v += 32 * 8) {
      uint4 a[8];
      #pragma unroll
      for (int u = 0; u < 8; ++u) { int j = v + u * 32; if (j < per) a[u] = __ldcs(s + j); }
      #pragma unroll
      for (int u = 0; u < 8; ++u) { int j = v + u * 32; if (j < per) __stcs(d + j, a[u]); }
    }
  }
}
"""


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compute-ms", type=float, default=20.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pool-gib", type=float, default=2.0)
    ap.add_argument("--parts", default="interference,gather,device")
    ap.add_argument("--only", default="", help="interference: only contenders whose name holds this text")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    import torch
    import cupy as cp

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    name = torch.cuda.get_device_name()
    print(f"# {name}", flush=True)
    out = {"device": name, "rows": []}
    mod = cp.RawModule(code=CUDA_SRC, options=("-std=c++17", "-arch=sm_90a"), backend="nvrtc")
    ldst, tma, gat = mod.get_function("ldst_copy"), mod.get_function("tma_copy"), mod.get_function("gather")
    hold = mod.get_function("hold")
    tma.max_dynamic_shared_size_bytes = 160 * KiB
    comp, side = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    rng = np.random.default_rng(0)

    def cps(s):
        return cp.cuda.ExternalStream(s.cuda_stream)

    def launch(fn, grid, block, argv_, s, smem=0):
        with cps(s):  # a RawKernel launches on CuPy's current stream
            fn((grid,), (block,), argv_, shared_mem=smem)

    # -- compute: one graph of bf16 GEMMs --------------------------------------------------------
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    with torch.cuda.stream(comp):
        for _ in range(5):
            torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(comp)
    with torch.cuda.stream(comp):
        for _ in range(20):
            torch.mm(a, b, out=c)
    e1.record(comp)
    torch.cuda.synchronize()
    per = e0.elapsed_time(e1) / 20
    ngemm = max(1, int(args.compute_ms / per))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=comp):
        for _ in range(ngemm):
            torch.mm(a, b, out=c)
    torch.cuda.synchronize()

    def compute_alone() -> float:
        torch.cuda.synchronize()
        x, y = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        x.record(comp)
        with torch.cuda.stream(comp):  # replay() launches on the current stream
            g.replay()
        y.record(comp)
        torch.cuda.synchronize()
        return x.elapsed_time(y)

    def beside(copy_fn) -> tuple[float, float]:
        """(compute ms beside the copy, copy ms): the copy launched first, the graph right after."""
        torch.cuda.synchronize()
        x, y = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cx, cy = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cx.record(side)
        copy_fn(side)
        cy.record(side)
        x.record(comp)
        with torch.cuda.stream(comp):  # replay() launches on the current stream
            g.replay()
        y.record(comp)
        torch.cuda.synchronize()
        return x.elapsed_time(y), cx.elapsed_time(cy)

    def copy_alone(copy_fn) -> float:
        torch.cuda.synchronize()
        cx, cy = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cx.record(side)
        copy_fn(side)
        cy.record(side)
        torch.cuda.synchronize()
        return cx.elapsed_time(cy)

    calone = compute_alone()
    print(f"# compute: {ngemm} GEMMs 4096^3 bf16, {calone:.2f} ms alone", flush=True)
    out["compute_ms"] = calone
    parts = set(args.parts.split(","))

    pool_bytes = int(args.pool_gib * GiB)
    host = torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    devbuf = torch.empty(pool_bytes, dtype=torch.uint8, device=dev)
    devbuf.random_(0, 256)
    dev2 = torch.empty(pool_bytes, dtype=torch.uint8, device=dev)

    def row(**kw):
        out["rows"].append(kw)
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)

    if "interference" in parts:
        chunk = 16 * KiB
        nchunks = pool_bytes // chunk
        # Random chunk order; the device side its own random chunks of dev2 (distinct slots).
        perm_h = rng.permutation(nchunks)[: min(nchunks, 65536)]
        perm_d = rng.permutation(nchunks)[: len(perm_h)]
        n = len(perm_h)

        def addrs(base, idx):
            return cp.asarray(base + idx.astype(np.int64) * chunk)

        H = addrs(host.data_ptr(), perm_h)
        Hsmall = addrs(host.data_ptr(), np.arange(n) % 4)
        D = addrs(devbuf.data_ptr(), perm_d)
        D2 = addrs(dev2.data_ptr(), perm_h)

        def kernel_copy(fn_kind, src, dst, ctas, total):
            if fn_kind == "ldst":
                return lambda s: launch(ldst, ctas, 1024, (src, dst, np.int64(len(src)), np.int32(chunk),
                                                           np.int64(total)), s)
            stages = 8
            return lambda s: launch(tma, ctas, 32, (src, dst, np.int64(len(src)), np.int32(chunk),
                                                    np.int64(total), np.int32(stages)), s, stages * chunk)

        # Bytes right once per kernel and direction (h2d: host chunks land in dev2's slots).
        for kind in ("ldst", "tma"):
            for d in ("h2d", "d2h"):
                m = 2048
                if d == "h2d":
                    dev2[: m * chunk].fill_(0x5A)
                    fn = kernel_copy(kind, H[:m], addrs(dev2.data_ptr(), np.arange(m)), 2, m)
                    copy_alone(fn)
                    want = host.view(-1, chunk)[torch.as_tensor(perm_h[:m])].to(dev)
                    ok = torch.equal(dev2[: m * chunk].view(m, chunk), want)
                else:
                    scratch = torch.empty(m * chunk, dtype=torch.uint8, pin_memory=True).fill_(0x5A)
                    fn = kernel_copy(kind, D[:m], addrs(scratch.data_ptr(), np.arange(m)), 2, m)
                    copy_alone(fn)
                    want = devbuf.view(-1, chunk)[torch.as_tensor(perm_d[:m], device=dev)].cpu()
                    ok = torch.equal(scratch.view(m, chunk), want)
                print(f"# bytes {kind} {d}: {'exact' if ok else 'WRONG'}", flush=True)
                if not ok:
                    out["wrong"] = out.get("wrong", 0) + 1

        contenders = []
        ce_bytes = int(min(pool_bytes, 60e9 * calone * 1.5 / 1e3)) // MiB * MiB
        contenders.append(("ce contiguous", "h2d", 0,
                           lambda s: _on(s, lambda: dev2[:ce_bytes].copy_(host[:ce_bytes], non_blocking=True)), ce_bytes))
        contenders.append(("ce contiguous", "d2h", 0, lambda s: _on(s, lambda: host[:ce_bytes].copy_(devbuf[:ce_bytes],
                                                                                                      non_blocking=True)),
                           ce_bytes))
        for ctas in (1, 2, 4):
            for kind in ("ldst", "tma"):
                # Sized to outlast the compute: ~25 GB/s a CTA for 1.5x the compute.
                total = int(min(8, ctas) * 25e9 * calone * 1.5 / 1e3 / chunk)
                contenders.append((f"{kind} host", "h2d", ctas, kernel_copy(kind, H, D2, ctas, total), total * chunk))
                contenders.append((f"{kind} host", "d2h", ctas, kernel_copy(kind, D, H, ctas, total), total * chunk))
                if ctas <= 2:
                    contenders.append((f"{kind} host small", "h2d", ctas, kernel_copy(kind, Hsmall, D2, ctas, total),
                                       total * chunk))
                    contenders.append((f"{kind} device", "d2d", ctas, kernel_copy(kind, D, D2, ctas, 4 * total),
                                       4 * total * chunk))
        # The staged route's device side run back to back (a gather at ~1 TB/s on k SMs): what
        # it costs per byte, to scale by its duty cycle beside the link.
        from kvswap.backends.triton_generic.by_ids import KernelCopyByIds
        from kvswap.backends.triton_generic.launch import DEFAULT_PLANS, TilePlan

        class One:  # a template of one piece: chunk-sized blocks of devbuf to dev2
            src_base, src_stride = np.array([devbuf.data_ptr()]), np.array([chunk])
            dst_base, dst_stride = np.array([dev2.data_ptr()]), np.array([chunk])
            sizes = np.array([chunk])
        sid_, did_ = perm_d.astype(np.int64), perm_h.astype(np.int64)
        reps_k = int(calone * 1.5 * 1e9 / 1e3 / (n * chunk)) + 1
        for sms_ in (8, 16, 32, 64, 132):
            def dev_side(s, k=sms_, r=reps_k):
                for _ in range(r):
                    launch(gat, k, 1024, (D, D2, np.int64(n), np.int32(chunk)), s)
            contenders.append(("cuda gather device", "d2d", sms_, dev_side, reps_k * n * chunk))
        for sms_ in (32, 64, 132):
            kfn = KernelCopyByIds(num_sms=sms_, device_index=0,
                                  tiles=TilePlan.from_params({}, DEFAULT_PLANS["d2d"])).by_ids(One())

            def tri_side(s, f=kfn, r=reps_k):
                for _ in range(r):
                    f(sid_, did_, s)
            contenders.append(("kvswap gather device", "d2d", sms_, tri_side, reps_k * n * chunk))
        for ctas in (1, 4):  # SMs held, no memory touched: the control for everything above
            contenders.append(("hold SM, no traffic", "-", ctas,
                               lambda s, k=ctas: launch(hold, k, 32, (np.int64(int(calone * 1.5e6)),), s), 0))
        for label, d, ctas, fn, nbytes in contenders:
            if args.only and args.only not in label:
                continue
            copy_alone(fn)  # warm-up
            t_alone = [copy_alone(fn) for _ in range(2)]
            slows, covered = [], []
            for _ in range(args.reps):
                ca = compute_alone()
                cb, tc = beside(fn)
                slows.append(cb / ca - 1)
                covered.append(tc >= cb)
            per_gb = (med(slows) * calone / (nbytes / 1e9 * min(1.0, calone / med(t_alone)))) if nbytes else float("nan")
            row(part="interference", contender=label, direction=d, ctas=ctas, gbps_alone=nbytes / med(t_alone) / 1e6,
                slowdown=med(slows), covered=all(covered), ms_lost_per_gb=per_gb)

    if "gather" in parts:
        # Host threads gathering chunks of a pinned pool into a pinned buffer (h2d's host side).
        threads_list = (1, 2, 4, 8, 12, 16)
        job = 512 * MiB
        bounce = torch.empty(job, dtype=torch.uint8, pin_memory=True)
        hnp = host.numpy()
        bnp = bounce.numpy()
        for chunk in (4 * KiB, 16 * KiB, 32 * KiB):
            rows = pool_bytes // chunk
            n = job // chunk
            ids = rng.choice(rows, n, replace=False).astype(np.int64)
            src2 = hnp.reshape(rows, chunk)
            dst2 = bnp.reshape(n, chunk)
            for t in threads_list:
                parts_ = np.array_split(np.arange(n), t)
                pool = ThreadPoolExecutor(t)

                def go():
                    list(pool.map(lambda p: np.take(src2, ids[p[0]:p[-1] + 1], axis=0, out=dst2[p[0]:p[-1] + 1], mode="clip"),
                                  parts_))
                go()
                assert np.array_equal(dst2[:64], src2[ids[:64]]) and np.array_equal(dst2[-64:], src2[ids[-64:]])
                ts = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    go()
                    ts.append(time.perf_counter() - t0)
                # The same beside a contiguous h2d copy on the link: does the gather slow the link?
                link_bytes = 2 * GiB if pool_bytes >= 2 * GiB else pool_bytes
                torch.cuda.synchronize()
                lx, ly = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                lx.record(side)
                with torch.cuda.stream(side):
                    dev2[:link_bytes].copy_(host[:link_bytes], non_blocking=True)
                ly.record(side)
                t0 = time.perf_counter()
                go()
                tb = time.perf_counter() - t0
                torch.cuda.synchronize()
                link_beside = link_bytes / (lx.elapsed_time(ly) / 1e3) / 1e9
                pool.shutdown()
                row(part="gather", how="np.take pool", chunk_kib=chunk // KiB, threads=t,
                    gbps=job / med(ts) / 1e9, gbps_beside_link=job / tb / 1e9, link_gbps_beside=link_beside)
            srct = host.view(rows, chunk)
            dstt = bounce.view(n, chunk)
            idt = torch.as_tensor(ids)
            for t in (1, 4, 8, 16):
                torch.set_num_threads(t)
                torch.index_select(srct, 0, idt, out=dstt)
                ts = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    torch.index_select(srct, 0, idt, out=dstt)
                    ts.append(time.perf_counter() - t0)
                row(part="gather", how="torch.index_select", chunk_kib=chunk // KiB, threads=t, gbps=job / med(ts) / 1e9)
        link_alone = []
        for _ in range(3):
            lx, ly = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            lx.record(side)
            with torch.cuda.stream(side):
                dev2[:2 * GiB].copy_(host[:2 * GiB], non_blocking=True)
            ly.record(side)
            torch.cuda.synchronize()
            link_alone.append(2 * GiB / (lx.elapsed_time(ly) / 1e3) / 1e9)
        row(part="gather", how="link alone", gbps=med(link_alone))

    if "device" in parts:
        # The staged route's device side: 512 random blocks x 32 layers x K/V of a 1024-block
        # per-layer cache, gathered to (d2h) or scattered from (h2d) a contiguous buffer.
        from kvswap.backends.triton_generic.by_ids import KernelCopyByIds
        from kvswap.backends.triton_generic import by_ids as by_ids_mod
        from kvswap.backends.triton_generic.launch import DEFAULT_PLANS, TilePlan
        layers, blocks, cache_blocks = 32, 512, 1024
        for chunk in (4 * KiB, 16 * KiB, 32 * KiB):
            kv = [torch.empty((2, cache_blocks, chunk), dtype=torch.uint8, device=dev).random_(0, 256)
                  for _ in range(layers)]
            nitems = blocks * layers * 2
            job = nitems * chunk
            staging = torch.empty(job, dtype=torch.uint8, device=dev)
            ids = rng.choice(cache_blocks, blocks, replace=False).astype(np.int64)
            bases = np.array([[t[0].data_ptr(), t[1].data_ptr()] for t in kv], dtype=np.int64).ravel()
            scattered = (ids[:, None] * chunk + bases[None, :]).ravel()
            packed = staging.data_ptr() + np.arange(nitems, dtype=np.int64) * chunk
            S, P = cp.asarray(scattered), cp.asarray(packed)
            ref = torch.cat([kv[l][k][torch.as_tensor(ids, device=dev)].reshape(blocks, 1, chunk)
                             for l in range(layers) for k in range(2)], dim=1).reshape(-1)
            contig = torch.empty_like(staging)

            class T:  # a BlockMover-like template: pieces = layers x K/V
                pass
            slot_ids = np.arange(blocks, dtype=np.int64)

            def time_fn(fn, reps=5):
                fn(side)
                torch.cuda.synchronize()
                return med([copy_alone(fn) for _ in range(reps)])

            # (label, sms, direction, prepare) where prepare() does the host half and returns
            # launch(stream): the start marker goes between the two, so each times its device part.
            variants = []
            for d in ("gather", "scatter"):
                tm = T()
                slot_base = staging.data_ptr() + np.arange(len(bases), dtype=np.int64) * chunk
                slot_stride = np.full(len(bases), len(bases) * chunk, dtype=np.int64)
                kv_stride = np.full(len(bases), chunk, dtype=np.int64)
                if d == "gather":
                    tm.src_base, tm.src_stride, tm.dst_base, tm.dst_stride = bases, kv_stride, slot_base, slot_stride
                else:
                    tm.src_base, tm.src_stride, tm.dst_base, tm.dst_stride = slot_base, slot_stride, bases, kv_stride
                tm.sizes = np.full(len(bases), chunk, dtype=np.int64)
                for sms in (16, 32):
                    for label, plan in (("kvswap default", {}), ("kvswap tile 16k 32w", {"tile_elems": 16384, "warps": 32}),
                                        ("kvswap tile 4096", {"tile_elems": 4096}),
                                        ("kvswap prefetch", {"prefetch": True}), ("kvswap no .cg", {"cache": ""})):
                        try:
                            kc = KernelCopyByIds(num_sms=sms, device_index=0,
                                                 tiles=TilePlan.from_params(plan, DEFAULT_PLANS["d2d"]))
                            fn_ids = kc.by_ids(tm)
                        except Exception as e:  # a plan this Triton build refuses
                            print(f"# {label}: {type(e).__name__}: {e}", flush=True)
                            continue
                        for where in ("host", "device"):
                            a_, b_ = (ids, slot_ids) if d == "gather" else (slot_ids, ids)
                            variants.append((f"{label} ids@{where}", sms, d,
                                             (lambda f=fn_ids, w=where, a_=a_, b_=b_: _ids_pack(f, a_, b_, by_ids_mod, w))))
                    for warps in (8, 16, 32):
                        sa, da = (S, P) if d == "gather" else (P, S)
                        variants.append((f"cuda gather {warps}w", sms, d,
                                         (lambda w=warps, k=sms, sa=sa, da=da: lambda s: launch(
                                             gat, k, 32 * w, (sa, da, np.int64(nitems), np.int32(chunk)), s))))
            saved = [t.clone() for t in kv]
            for label, sms, d, prepare in variants:
                if d == "gather":
                    staging.fill_(0x5A)
                else:
                    staging.copy_(ref)
                    idt = torch.as_tensor(ids, device=dev)
                    for t in kv:
                        t[:, idt] = 0x5A
                prepare()(side)
                torch.cuda.synchronize()
                ok = torch.equal(staging, ref) if d == "gather" else all(torch.equal(t, u) for t, u in zip(kv, saved))
                ts = []
                for _ in range(6):
                    go = prepare()
                    torch.cuda.synchronize()
                    cx, cy = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    cx.record(side)
                    go(side)
                    cy.record(side)
                    torch.cuda.synchronize()
                    ts.append(cx.elapsed_time(cy))
                row(part="device", variant=label, direction=d, sms=sms, chunk_kib=chunk // KiB,
                    gbps=job / med(ts[1:]) / 1e6, exact=ok)
                if not ok:
                    out["wrong"] = out.get("wrong", 0) + 1
            del saved
            tc = time_fn(lambda s: _on(s, lambda: contig.copy_(staging)))
            row(part="device", variant="contiguous d2d", sms=0, chunk_kib=chunk // KiB, gbps=job / tc / 1e6, exact=True)
            del kv, staging, contig, ref
            torch.cuda.empty_cache()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 1 if out.get("wrong") else 0


def _on(s, fn):
    import torch
    with torch.cuda.stream(s):
        return fn()


def _ids_pack(fn_ids, src_ids, dst_ids, mod, where):
    """The host half of a by-id call with the ids read from pinned host memory or uploaded
    first; returns its launch(stream)."""
    old = mod.HOST_IDS_PROGRAMS
    mod.HOST_IDS_PROGRAMS = 16 if where == "host" else 10**9
    fn_ids._launches.clear()
    try:
        return fn_ids.pack(src_ids, dst_ids)
    finally:
        mod.HOST_IDS_PROGRAMS = old


if __name__ == "__main__":
    sys.exit(main())
