"""Faults an engine meets, on a GPU: device memory really exhausted while movers are built
and used, a fork after CUDA is up, threads sharing a device mover; a short soak; and the
fuzz at the per-call limits in a child process (a fault inside the driver ends the child,
not the test run)."""
from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from bench_scripts import load_bench

pytestmark = pytest.mark.gpu

BENCH = Path(__file__).resolve().parent / "bench"
SHAPE = (16, 2, 64)  # block_size, heads, head_dim of bf16: 4 KiB per K or V chunk


def _caches(torch, blocks_host: int, blocks_dev: int, layers: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    host = [torch.randint(-30000, 30000, (2, blocks_host) + SHAPE, dtype=torch.int16, generator=gen)
            .view(torch.bfloat16).pin_memory() for _ in range(layers)]
    dev = [torch.randint(-30000, 30000, (2, blocks_dev) + SHAPE, dtype=torch.int16, generator=gen)
           .view(torch.bfloat16).cuda() for _ in range(layers)]
    return host, dev


def _exhaust(torch) -> list:
    """Allocate device memory until torch cannot, halving the size down to 512 bytes."""
    hog, size = [], 1 << 30
    while size >= 512:
        try:
            hog.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError:
            size //= 2
    return hog


def test_device_memory_exhausted_while_movers_are_built_and_used():
    import torch

    import kvswap

    rng = np.random.default_rng(1)
    host, dev = _caches(torch, 64, 48)
    routes = [c.name for c in kvswap.resolve("h2d", device="cuda").plan.candidates if c.available]
    assert "triton.kernel" in routes and "cuda.batch" in routes
    working = kvswap.BlockMover(host, dev, "h2d", block_dim=1, policy=kvswap.Policy(force="cuda.batch"))
    working.wait(working.submit([0], [0]))
    threads = threading.active_count()
    hog = _exhaust(torch)
    outcomes = {}
    try:
        held = torch.cuda.memory_allocated()
        for route in routes + ["default"]:
            policy = None if route == "default" else kvswap.Policy(force=route)
            try:
                mover = kvswap.BlockMover(host, dev, "h2d", block_dim=1, policy=policy)
            except kvswap.AllocationError as e:
                # A buffer names its size; a stream or an event the driver could not create has none.
                assert e.memory == "device" and (e.nbytes > 0 or "stream" in e.what or "event" in e.what), e
                assert "could not allocate" in str(e)
                outcomes[route] = f"not built: {e.what}"
                assert torch.cuda.memory_allocated() == held  # the failed build kept nothing
                continue
            sid, did = rng.choice(64, 8, replace=False), rng.choice(48, 8, replace=False)
            try:
                job = mover.submit(sid, did)
                mover.wait(job)
            except Exception as e:  # an event or launch the driver could not create: reported, not fatal
                assert isinstance(e, kvswap.AllocationError) or "out of memory" in str(e).lower(), e
                outcomes[route] = f"built; submit raised {type(e).__name__}: {str(e)[:80]}"
                continue
            (r,) = mover.poll()
            if r.ok:
                assert all(torch.equal(h[:, sid].view(torch.int16), d.cpu()[:, did].view(torch.int16))
                           for h, d in zip(host, dev))
                outcomes[route] = "built and copied"
            else:
                assert "out of memory" in r.error.lower() or r.error.startswith("AllocationError"), r.error
                outcomes[route] = f"built; job failed: {r.error[:80]}"
            mover.close()
        # The mover built before needs no new device memory: it keeps copying, bytes checked.
        sid, did = rng.choice(64, 16, replace=False), rng.choice(48, 16, replace=False)
        working.wait(working.submit(sid, did))
        assert all(r.ok for r in working.poll())
        assert all(torch.equal(h[:, sid].view(torch.int16), d.cpu()[:, did].view(torch.int16))
                   for h, d in zip(host, dev))
    finally:
        del hog
        torch.cuda.empty_cache()
    print(outcomes)
    # The kernel route uploads its block template when the mover is built.
    assert outcomes["triton.kernel"].startswith("not built: a by-id kernel's block template"), outcomes
    assert threading.active_count() <= threads + 1  # at most the working mover's issuing thread
    for route in routes:  # memory back: every route builds and copies again
        with kvswap.BlockMover(host, dev, "h2d", block_dim=1, policy=kvswap.Policy(force=route)) as mover:
            sid, did = rng.choice(64, 8, replace=False), rng.choice(48, 8, replace=False)
            mover.wait(mover.submit(sid, did))
            assert all(r.ok for r in mover.poll())
            assert all(torch.equal(h[:, sid].view(torch.int16), d.cpu()[:, did].view(torch.int16))
                       for h, d in zip(host, dev))
    working.close()


def _forked_child(mover, host, dev, conn) -> None:
    import torch

    import kvswap

    out = {}
    try:
        mover.submit([0], [1])
        out["parent's mover"] = "no error"
    except kvswap.ForkedProcessError:
        out["parent's mover"] = "refused"
    try:
        kvswap.BlockMover(host, dev, "h2d", block_dim=1)
        out["device mover"] = "built"
    except kvswap.ForkedProcessError as e:
        out["device mover"] = "refused" if "spawn" in str(e) else str(e)
    except Exception as e:  # any other error is a finding
        out["device mover"] = f"{type(e).__name__}: {e}"
    a = [torch.randint(0, 100, (2, 8, 4, 16), dtype=torch.int32) for _ in range(2)]
    b = [torch.zeros_like(t) for t in a]
    with kvswap.BlockMover(a, b, "h2d", block_dim=1) as host_mover:
        host_mover.wait(host_mover.submit([1, 5], [2, 3]))
        out["host mover"] = [r.ok for r in host_mover.poll()]
    out["bytes"] = all(torch.equal(y[:, [2, 3]], x[:, [1, 5]]) for x, y in zip(a, b))
    mover.close()
    out["closed"] = mover.closed
    conn.send(out)
    conn.close()


def test_a_fork_after_cuda_is_up_refuses_the_parents_mover_and_device_movers_in_the_child():
    import torch

    import kvswap

    host, dev = _caches(torch, 32, 32, seed=2)
    mover = kvswap.BlockMover(host, dev, "h2d", block_dim=1)
    mover.wait(mover.submit([3, 4], [5, 6]))
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_forked_child, args=(mover, host, dev, child))
    p.start()
    got = parent.recv() if parent.poll(120) else None
    p.join(120)
    if p.is_alive():
        p.kill()
    assert p.exitcode == 0 and got == {"parent's mover": "refused", "device mover": "refused",
                                       "host mover": [True], "bytes": True, "closed": True}, (p.exitcode, got)
    mover.wait(mover.submit([7, 8], [9, 10]))  # the parent's mover is unaffected
    assert [r.ok for r in mover.poll()] == [True, True]
    assert all(torch.equal(h[:, [7, 8]].view(torch.int16), d[:, [9, 10]].cpu().view(torch.int16))
               for h, d in zip(host, dev))
    mover.close()


@pytest.mark.parametrize("route", [None, "cuda.batch", "triton.kernel"])
def test_threads_sharing_a_device_mover(route):
    import torch

    import kvswap

    host, dev = _caches(torch, 256, 192, seed=3)
    mover = kvswap.BlockMover(host, dev, "h2d", block_dim=1,
                              policy=kvswap.Policy(force=route) if route else None)
    workers, per = 4, 60
    submitted: dict[int, list] = {k: [] for k in range(workers)}
    polled: list = []
    errors: list = []

    def work(k: int) -> None:
        rng = np.random.default_rng(k)
        mine = np.arange(k, 192, workers)
        try:
            for i in range(per):
                did = rng.permutation(mine)[:int(rng.integers(1, 12))].astype(np.int64)
                sid = rng.choice(256, len(did), replace=False).astype(np.int64)
                submitted[k].append((mover.submit(sid, did, after=None), sid, did))
                if i % 5 == 0:
                    polled.extend(mover.poll())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    mover.wait()
    results = polled + mover.poll()
    ids = sorted(j for js in submitted.values() for j, _, _ in js)
    assert ids == list(range(1, workers * per + 1)) and sorted(r.job_id for r in results) == ids
    assert all(r.ok for r in results)
    want = [h.view(torch.int16).clone() for h in host]  # the last job of each thread into a block wins
    final = [d.cpu().view(torch.int16).clone() for d in dev]
    for k in range(workers):
        last = {}
        for _, sid, did in submitted[k]:
            for s, d in zip(sid.tolist(), did.tolist()):
                last[d] = s
        for d, s in last.items():
            assert all(torch.equal(f[:, d], w[:, s]) for f, w in zip(final, want)), (k, d, s)
    mover.close()


def test_a_short_soak_on_the_gpu_moves_every_byte_right():
    soak = load_bench("soak.py", "kvswap_soak")
    report = soak.run(soak.Config(device="cuda:0", seconds=30, blocks=2048, layers=4))
    print(soak.table(report))
    t = report.totals()
    assert t["jobs"] > 100 and t["wrong"] == t["canaries"] == t["failed"] == 0
    assert all(r.jobs > 0 or r.skipped for r in report.rows)


def test_the_fuzz_at_the_per_call_limits_finds_nothing(tmp_path):
    out = tmp_path / "limits.json"
    p = subprocess.run([sys.executable, str(BENCH / "fuzz.py"), "--device", "cuda:0", "--limits", "--json", str(out)],
                       capture_output=True, text=True, timeout=480)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    totals = json.loads(out.read_text())["totals"]
    assert totals["wrong"] == totals["canaries"] == 0 and totals["transfers"] > 200_000
