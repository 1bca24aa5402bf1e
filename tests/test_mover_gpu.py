"""BlockMover on a GPU: every layout, both directions, on the default, kernel and batch routes.

Host tensors are pinned; every check compares whole allocations (guards included) with a
reference computed by torch indexing on host copies, on random data.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

import kvswap
from kvswap import BlockMover, Policy
from kvswap.errors import TensorPlacementError, UnpinnedMemoryError
from mover_layouts import Pool, expected_after, layouts, random_bytes, random_ids

pytestmark = pytest.mark.gpu

LAYOUTS = layouts(bs=16, heads=2, head_dim=64, layers=4)
ROUTES = [None, "triton.kernel", "cuda.batch"]
# torch.cuda._sleep spins this many GPU clock cycles: ~0.5-1 s at 1-2 GHz, far longer than
# the host needs to queue the work that follows it.
SPIN = 1_000_000_000


def _pair(name: str, direction: str, seed: int, src_blocks: int = 96, dst_blocks: int = 128,
          pinned: bool = True) -> tuple[Pool, Pool]:
    gen = torch.Generator().manual_seed(seed)
    h2d = direction == "h2d"
    src = Pool(LAYOUTS[name], src_blocks, gen, device="cpu" if h2d else "cuda", pinned=pinned and h2d)
    dst = Pool(LAYOUTS[name], dst_blocks, gen, device="cuda" if h2d else "cpu", pinned=pinned and not h2d)
    return src, dst



@pytest.mark.parametrize("by_ids", [True, False], ids=["ids", "descriptors"])
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "default")
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_both_directions_on_each_route(name, direction, route, by_ids):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{direction}/{route}".encode()))
    src, dst = _pair(name, direction, seed=1)
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = [random_ids(rng, n, src, dst) for n in (1, 7, 33, 64)]
    jobs.append((np.arange(20, 36), np.arange(90, 106)))   # a run that coalesces
    policy = Policy(force=route) if route else None
    with BlockMover(src.tensors, dst.tensors, direction, block_dim=src.layout.block_dim, policy=policy,
                    device_descriptors=by_ids) as mover:
        assert by_ids or mover.id_route(1) is None
        # Whether the last job (a run) goes as ids, the kernel deriving its addresses.
        ids_path = mover.id_route(len(jobs[-1][0])) is not None
        if route:
            assert mover.swap_fn.impls == (route,)
        assert mover.pool.pinned and mover.stream is not None
        ids = [mover.submit(sid, did) for sid, did in jobs]
        mover.wait()
        results = mover.poll()
    assert [r.job_id for r in results] == ids
    for r, (sid, _) in zip(results, jobs):
        assert r.ok and r.bytes == len(sid) * mover.block_bytes and r.seconds >= 0, r
    assert sum(r.seconds for r in results) > 0             # timed by device events
    if ids_path:
        assert results[-1].descriptors == len(jobs[-1][0]) * mover.chunks_per_block
    else:
        assert results[-1].descriptors < len(jobs[-1][0]) * mover.chunks_per_block
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_copy_runs_after_work_already_queued_on_the_compute_stream(direction):
    """The compute stream rewrites the device-side blocks behind a long spin; the copy,
    submitted at once, must see (d2h) or land after (h2d) the rewrite."""
    gen = torch.Generator().manual_seed(3)
    src, dst = _pair("flash", direction, seed=2)
    device_side = dst if direction == "h2d" else src
    mover = BlockMover(src.tensors, dst.tensors, direction, block_dim=1)
    sid, did = random_ids(np.random.default_rng(4), 48, src, dst)
    fresh = [random_bytes(f.numel(), gen).to("cuda") for f in device_side.flats]
    host_before = dst.snapshot() if direction == "d2h" else None
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    for f, new in zip(device_side.flats, fresh):
        f.copy_(new)                                       # queued behind the spin
    job = mover.submit(sid, did)
    mover.wait(job)
    fresh_host = [new.cpu() for new in fresh]
    if direction == "h2d":
        before, src_now = fresh_host, src.snapshot()
    else:
        before, src_now = host_before, fresh_host
    assert dst.matches(expected_after(dst, before, src_now, src, [(sid, did)]))
    mover.close()


def test_jobs_in_flight_keep_pinned_buffers_until_their_events_complete():
    rng = np.random.default_rng(5)
    src, dst = _pair("mla", "h2d", seed=6)
    # Descriptors for every job: a by-id job holds no descriptor buffer of the mover.
    mover = BlockMover(src.tensors, dst.tensors, "h2d", device_descriptors=False)
    jobs = [random_ids(rng, int(rng.integers(1, 9)), src, dst) for _ in range(64)]
    # Warm up first, so the spin below outlasts the 64 submits: compile and load every route
    # and launch shape these jobs use (a new Triton shape compiles on first use, ~1 s), and
    # grow the pinned pool to 64 buffers while the stream is held (a new pinned allocation
    # costs milliseconds). The snapshot is taken after these warm-up copies.
    with torch.cuda.stream(mover.stream):
        torch.cuda._sleep(8 * SPIN)
    for job in jobs:
        mover.submit(*job)
    mover.wait()
    mover.poll()
    warm = mover.pool.allocated
    before, src_before = dst.snapshot(), src.snapshot()
    with torch.cuda.stream(mover.stream):
        torch.cuda._sleep(4 * SPIN)                        # holds the transfer stream
    ids = [mover.submit(sid, did) for sid, did in jobs]
    assert mover.poll() == []
    mover.wait_issued()                                    # the issuing thread holds the buffers now
    assert (mover.in_flight, mover.pool.in_use, mover.pool.allocated) == (64, 64, max(64, warm))
    assert all(job.buffer.owner.is_pinned() for job in mover._jobs.inflight)
    mover.wait()
    results = mover.poll()
    assert [r.job_id for r in results] == ids and all(r.ok for r in results)
    assert (mover.pool.in_use, mover.pool.allocated) == (0, max(64, warm))
    more = [random_ids(rng, 4, src, dst) for _ in range(8)]
    for sid, did in more:
        mover.submit(sid, did)
    mover.close()
    assert mover.pool.allocated == max(64, warm)           # handed back, then reused
    assert dst.matches(expected_after(dst, before, src_before, src, jobs + more))


def test_pageable_host_tensors_refused_for_the_kernel_route_when_the_policy_is_strict():
    assert kvswap.resolve("h2d", device="cuda", policy=Policy(force="triton.kernel")).requires_pinned
    src, dst = _pair("flash", "h2d", seed=7, pinned=False)
    before = dst.snapshot()
    with pytest.raises(UnpinnedMemoryError, match="src_tensors\\[0\\] is pageable host memory"):
        BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1,
                   policy=Policy(force="triton.kernel", require_pinned=True))
    assert dst.matches(before)


def test_device_tensors_on_the_host_side_are_refused():
    src, dst = _pair("mla", "d2h", seed=8)
    before = src.snapshot()
    with pytest.raises(TensorPlacementError, match="src_tensors\\[0\\] is on cuda:0, but for direction h2d"):
        BlockMover(src.tensors, dst.tensors, "h2d")
    assert src.matches(before)


def test_movers_and_staged_links_never_share_a_stream_with_torchs_pool():
    """torch.cuda.Stream() hands out 32 pooled streams in turn; an engine's compute stream
    is one of them. kvswap's transfer and link streams are its own: none is pooled, and no
    two live movers share one, round after round of movers built and dropped."""
    import gc

    dev = torch.device("cuda:0")
    pooled = {torch.cuda.Stream(device=dev).cuda_stream for _ in range(64)}
    # 4 layers of 32 KiB a block: a block-major host holds each block as one 128 KiB run
    device = [torch.randn(64, 16, 8, 128, device=dev).to(torch.bfloat16) for _ in range(4)]
    cache = kvswap.host_cache(device, 64, block_dim=0)
    for _ in range(4):
        live, seen = [], []
        for i in range(6):
            src, dst = (device, list(cache.views)) if i % 2 else (list(cache.views), device)
            # forced: the streams are under test here, not the mover's choice of route
            m = BlockMover(src, dst, "d2h" if i % 2 else "h2d", block_dim=0, policy=Policy(force="triton.staged"))
            m.wait(m.submit([1, 2, 3], [4, 5, 6]))
            assert m.id_route(1) == "triton.staged", "a forced staged mover moves by ids through the staged route"
            fn = m._plan.ids.at(m.chunks_per_block)[0]
            seen += [m.stream.cuda_stream, *(s.cuda_stream for s in fn.staged.halves().links)]
            live.append(m)
        assert not set(seen) & pooled, "a mover queues on a pooled stream"
        assert len(set(seen)) == len(seen), "two live movers share a stream"
        for m in live:
            m.close()
        del live, m, fn
        gc.collect()  # their streams go back to kvswap's free list for the next round


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "default")
def test_a_d2d_mover_within_one_cache_refuses_a_job_that_writes_what_it_reads(route):
    """The same tensors on both sides: a swap is refused before any byte moves; blocks the
    job does not both read and write move, every byte checked, the rest untouched."""
    gen = torch.Generator().manual_seed(11)
    cache = [torch.randint(-9, 9, (2, 64, 16, 2, 64), dtype=torch.int16, generator=gen).view(torch.bfloat16)
             .to("cuda") for _ in range(3)]
    before = [t.clone() for t in cache]
    policy = None if route is None else Policy(force=route)
    with BlockMover(cache, cache, "d2d", block_dim=1, policy=policy) as mover:
        with pytest.raises(kvswap.BlockIdError, match="overlap in memory"):
            mover.submit([1, 2, 3], [3, 7, 1])
        torch.cuda.synchronize()
        assert all(torch.equal(t.view(torch.int16), b.view(torch.int16)) for t, b in zip(cache, before))
        sid, did = [4, 9, 30, 31], [40, 12, 5, 63]
        mover.wait(mover.submit(sid, did))
        assert mover.poll()[-1].ok
    for t, b in zip(cache, before):
        want = b.clone()
        want[:, did] = b[:, sid]
        assert torch.equal(t.view(torch.int16), want.view(torch.int16))  # bits: random bf16 holds NaNs
