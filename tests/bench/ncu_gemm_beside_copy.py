"""The workload Nsight Compute profiles to find which unit a copy kernel's host traffic takes
from the GEMMs beside it (GPU; run under ``ncu``, see tests/bench/ncu_gemm_beside_copy.sh).

Between ``cudaProfilerStart`` and ``cudaProfilerStop`` (one range in ``ncu --replay-mode
range``): bf16 4096^3 GEMMs on one stream, and with ``--copy KIND`` a one-CTA copy kernel of
tests/bench/bench_quiet_routes.py on another, sized to outlast them:

* ``none``: the GEMMs alone;
* ``host``: 16 KiB chunks of pinned host memory to device memory (per-thread loads);
* ``host-d2h``: device memory to pinned host memory;
* ``small``: the same host chunks, 4 of them read again and again;
* ``device``: device to device;
* ``tma``: host to device with bulk copies.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copy", default="none", choices=("none", "host", "host-d2h", "small", "device", "tma"))
    ap.add_argument("--gemms", type=int, default=24)
    args = ap.parse_args(argv)
    import cupy as cp
    import torch

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from bench_quiet_routes import CUDA_SRC

    dev = torch.device("cuda:0")
    mod = cp.RawModule(code=CUDA_SRC, options=("-std=c++17", "-arch=sm_90a"), backend="nvrtc")
    ldst, tma = mod.get_function("ldst_copy"), mod.get_function("tma_copy")
    tma.max_dynamic_shared_size_bytes = 160 << 10
    chunk, n = 16 << 10, 32768
    host = torch.empty(n * chunk, dtype=torch.uint8, pin_memory=True).random_(0, 256)
    d1 = torch.empty(n * chunk, dtype=torch.uint8, device=dev).random_(0, 256)
    d2 = torch.empty(n * chunk, dtype=torch.uint8, device=dev)
    rng = np.random.default_rng(0)
    perm = rng.permutation(n).astype(np.int64) * chunk
    H = cp.asarray(host.data_ptr() + perm)
    Hs = cp.asarray(host.data_ptr() + (np.arange(n) % 4) * chunk)
    D1 = cp.asarray(d1.data_ptr() + perm)
    D2 = cp.asarray(d2.data_ptr() + rng.permutation(n).astype(np.int64) * chunk)
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    c = torch.empty_like(a)
    comp, side = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    total = 4 * n
    src, dst = {"host": (H, D2), "host-d2h": (D1, H), "small": (Hs, D2), "device": (D1, D2), "tma": (H, D2)}.get(
        args.copy, (None, None))

    def copy():
        with cp.cuda.ExternalStream(side.cuda_stream):  # CuPy's current stream
            if args.copy == "tma":
                tma((1,), (32,), (src, dst, np.int64(n), np.int32(chunk), np.int64(total), np.int32(8)),
                    shared_mem=8 * chunk)
            elif src is not None:
                ldst((1,), (1024,), (src, dst, np.int64(n), np.int32(chunk), np.int64(total)))

    with torch.cuda.stream(comp):
        for _ in range(4):
            torch.mm(a, b, out=c)
    copy()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    copy()
    with torch.cuda.stream(comp):
        for _ in range(args.gemms):
            torch.mm(a, b, out=c)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
