"""The issuer thread on a real CUDA GPU: the copy is correct, ordered after the work
queued before the call, and seen by the work queued after it; a failed batch releases
the stream and is raised by the next call; the process exits with jobs in flight.

Every check compares whole pools of random bytes (poisoned destinations, random gaps)
with what they must hold, so bytes outside the blocks are checked too.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvswap import Direction
from test_cuda_gpu import ALL, BOTH, KiB, Pools


@pytest.fixture(autouse=True)
def issuer_on(monkeypatch):
    """The issuer thread is opt-in (KVSWAP_CUDA_ISSUER); these tests turn it on."""
    monkeypatch.setenv("KVSWAP_CUDA_ISSUER", "on")


pytestmark = pytest.mark.gpu
SPIN = 200_000_000  # torch.cuda._sleep cycles: ~0.1-0.2 s, longer than queueing what follows


@pytest.fixture(scope="module")
def cuda():
    import types

    import torch

    from kvswap.backends.cuda import batch, driver, issuer

    torch.cuda.init()
    torch.empty(1, device="cuda")
    return types.SimpleNamespace(torch=torch, batch=batch, issuer=issuer, driver=driver.get(),
                                 index=torch.cuda.current_device())


def issued(cuda, direction, threshold=64):
    inner = cuda.batch.bind(cuda.driver, direction, cuda.index)
    make = lambda: cuda.issuer.for_device(cuda.driver, cuda.index, inner._context)  # noqa: E731
    return cuda.issuer.IssuedCopy(inner, make, {"batch": threshold, "per-copy": threshold})


def later_snapshot(torch, pools, stream):
    """Queue on ``stream`` a copy of the destination pool into a fresh device tensor: work
    the caller enqueues after the call."""
    with torch.cuda.stream(stream):
        if pools.dst_t.is_cuda:
            return pools.dst_t.clone()
        return pools.dst_t.to("cuda", non_blocking=True)


@pytest.mark.parametrize("direction", ALL, ids=str)
@pytest.mark.parametrize("n, size", [(10_000, 4 * KiB), (700, 64 * KiB), (3000, 13)])
def test_later_work_on_the_callers_stream_sees_the_bytes(cuda, direction, n, size):
    torch = cuda.torch
    fn = issued(cuda, direction)
    side = torch.cuda.Stream()
    pools = Pools(direction, np.full(n, size), seed=n + size)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)  # the stream is busy: the call returns long before the copy
    fn(pools.src, pools.dst, pools.sizes, side)
    assert fn.last_issued == "issuer" and fn.last_path == "batch"
    snap = later_snapshot(torch, pools, side)
    side.synchronize()
    np.testing.assert_array_equal(snap.cpu().numpy(), pools.expected())
    pools.check(side)


def test_d2h_reads_sources_written_just_before_the_call(cuda):
    torch = cuda.torch
    fn = issued(cuda, Direction.D2H)
    side = torch.cuda.Stream()
    pools = Pools(Direction.D2H, np.full(4000, 16 * KiB), seed=5)
    fresh = torch.randint(0, 256, pools.gpu.shape, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)
        pools.gpu.copy_(fresh)  # prior work: the copy must read these bytes
    fn(pools.src, pools.dst, pools.sizes, side)
    assert fn.last_issued == "issuer"
    pools.src_bytes = fresh.cpu().numpy()
    pools.check(side)


def test_h2d_lands_after_a_fill_queued_before_the_call(cuda):
    torch = cuda.torch
    fn = issued(cuda, Direction.H2D)
    side = torch.cuda.Stream()
    pools = Pools(Direction.H2D, np.full(3000, 8 * KiB), seed=6)
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)
        pools.gpu.fill_(0x5A)
    fn(pools.src, pools.dst, pools.sizes, side)
    pools.before = np.full_like(pools.before, 0x5A)
    pools.check(side)


def test_jobs_from_two_streams_and_small_batches_keep_their_order(cuda):
    torch = cuda.torch
    fn = issued(cuda, Direction.H2D, threshold=256)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    rng = np.random.default_rng(7)
    jobs = []
    for k in range(8):
        stream = a if k % 2 else b
        n = int(rng.choice([40, 300, 2000]))  # 40: under the threshold, on this thread
        pools = Pools(Direction.H2D, rng.integers(1, 20_000, n), seed=100 + k)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SPIN // 8)
        fn(pools.src, pools.dst, pools.sizes, stream)
        assert fn.last_issued == ("caller" if n < 256 else "issuer")
        jobs.append((pools, later_snapshot(torch, pools, stream), stream))
    for pools, snap, stream in jobs:
        stream.synchronize()
        np.testing.assert_array_equal(snap.cpu().numpy(), pools.expected())
        pools.check(stream)


def test_resolved_function_issues_large_batches_off_the_thread(cuda):
    import kvswap
    from kvswap import Policy

    torch = cuda.torch
    side = torch.cuda.Stream()
    for direction in BOTH:
        fn = kvswap.resolve(direction, device=f"cuda:{cuda.index}", policy=Policy(force="cuda.batch"))
        assert "per-device thread" in fn.explain()
        pools = Pools(direction, np.full(5120, 16 * KiB), seed=9)
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)
        fn(pools.src, pools.dst, pools.sizes, stream=side)
        snap = later_snapshot(torch, pools, side)
        side.synchronize()
        np.testing.assert_array_equal(snap.cpu().numpy(), pools.expected())
        pools.check(side)


# A failed batch runs in a child process: should a bad copy fault instead of being refused,
# it would poison this process's context for the other tests.
_FAILED = textwrap.dedent("""
    import ctypes, json
    import numpy as np, torch
    from kvswap import Direction
    from kvswap.backends.cuda import batch, driver, issuer
    torch.cuda.init()
    torch.empty(1, device="cuda")
    d = driver.get()
    inner = batch.bind(d, Direction.D2H, 0)
    fn = issuer.IssuedCopy(inner, lambda: issuer.for_device(d, 0, inner._context), {"batch": 4, "per-copy": 4})
    alloc = d.proc("cuMemAlloc", 3020, ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t))
    base = ctypes.c_uint64()
    d.check("cuMemAlloc", alloc(ctypes.byref(base), 2 << 20))
    host = torch.zeros(1 << 20, dtype=torch.uint8).pin_memory()
    src = base.value + np.arange(8, dtype=np.int64) * 4096
    dst = host.data_ptr() + np.arange(8, dtype=np.int64) * 65536
    sizes = np.full(8, 4096, dtype=np.int64)
    bad_src, bad = src.copy(), sizes.copy()
    bad_src[5], bad[5] = base.value + (2 << 20) - 4096, 16384  # 12 KiB past the allocation: refused
    stream = torch.cuda.Stream()
    out = {}
    fn(bad_src, dst, bad, stream)
    out["issued"] = fn.last_issued
    stream.synchronize()  # must return: the flag was released
    out["synchronized"] = True
    try:
        fn(src, dst, sizes, stream)
        out["next"] = "no error"
    except issuer.DeferredDriverError as e:
        out["next"] = e.name or str(e)
        out["message"] = str(e)
    dev = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8, device="cuda")
    src = dev.data_ptr() + np.arange(8, dtype=np.int64) * 4096
    fn(src, dst, sizes, stream)
    stream.synchronize()
    got = host.numpy().reshape(-1)[(dst - host.data_ptr())[:, None] + np.arange(4096)]
    want = dev.cpu().numpy()[(src - dev.data_ptr())[:, None] + np.arange(4096)]
    out["third_ok"] = bool((got == want).all())
    print(json.dumps(out))
""")


def test_a_failed_batch_releases_the_stream_and_raises_on_the_next_call():
    run = subprocess.run([sys.executable, "-c", _FAILED], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"child died ({run.returncode}): {run.stderr[-2000:]}"
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["issued"] == "issuer" and out["synchronized"], out
    assert out["next"].startswith("CUDA_ERROR_"), out
    assert "was not copied" in out["message"], out
    assert out["third_ok"] is True, out


_EXIT = textwrap.dedent("""
    import numpy as np, torch
    from kvswap import Direction
    from kvswap.backends.cuda import batch, driver, issuer
    torch.cuda.init()
    d = driver.get()
    inner = batch.bind(d, Direction.H2D, 0)
    iss = issuer.for_device(d, 0, inner._context)
    fn = issuer.IssuedCopy(inner, lambda: iss, {"batch": 4, "per-copy": 4})
    host = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).pin_memory()
    dev = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(100_000_000)
    n = 16384
    off = np.arange(n, dtype=np.int64) * 4096
    fn(host.data_ptr() + off, dev.data_ptr() + off, np.full(n, 4096, dtype=np.int64), stream)
    print("queued", iss.queued, flush=True)
    # no synchronize, no close: the exit handler issues the job and stops the thread
""")


def test_process_exits_with_a_job_in_flight():
    run = subprocess.run([sys.executable, "-c", _EXIT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"child died ({run.returncode}): {run.stderr[-2000:]}"
    assert run.stdout.split() == ["queued", "1"]
