"""BlockMover on a GPU with its issuing thread: what a job waits for (``after``) is
captured at submit, jobs in flight land in submission order, and work ordered after the
transfer stream once a job is issued sees its bytes; on the kernel and batch routes.

Host tensors are pinned; every check compares whole allocations (guards included) with a
reference computed by torch indexing on host copies, on random data.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvswap import BlockMover, Policy
from mover_layouts import Pool, expected_after, random_bytes, random_ids
from test_mover_gpu import ROUTES, SPIN
from test_mover_gpu import _pair as pinned_pair

pytestmark = pytest.mark.gpu


def _pair(name: str, direction: str, seed: int, src_blocks: int = 96, dst_blocks: int = 64) -> tuple[Pool, Pool]:
    return pinned_pair(name, direction, seed, src_blocks, dst_blocks)


def _mover(src: Pool, dst: Pool, direction: str, route, **kw) -> BlockMover:
    mover = BlockMover(src.tensors, dst.tensors, direction, block_dim=src.layout.block_dim,
                       policy=Policy(force=route) if route else None, **kw)
    if route:
        assert mover.swap_fn.impls == (route,)
    return mover


def _warm(mover: BlockMover, src: Pool, dst: Pool, rng: np.random.Generator, sizes=(1, 4, 8, 16)) -> None:
    """Compile and load every launch shape the test's jobs use, before a spin must outlast them."""
    for n in sizes:
        mover.submit(*random_ids(rng, n, src, dst), after=None)
    mover.wait()
    mover.poll()


def _fifo_behind_a_spin(mover: BlockMover, src: Pool, dst: Pool, rng: np.random.Generator) -> list:
    """96 jobs of 1-16 blocks queued behind a spin on the transfer stream, most writing
    blocks earlier jobs wrote: only first-in-first-out leaves the last writer's bytes in
    every block. Returns the results."""
    _warm(mover, src, dst, rng)
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = [random_ids(rng, int(rng.choice([1, 4, 8, 16])), src, dst) for _ in range(96)]
    with torch.cuda.stream(mover.stream):
        torch.cuda._sleep(SPIN)
    ids = [mover.submit(sid, did, after=None) for sid, did in jobs]
    assert mover.poll() == []
    mover.wait()
    results = mover.poll()
    assert [r.job_id for r in results] == ids and all(r.ok for r in results), results[:3]
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)
    return results


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "default")
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_many_jobs_in_flight_land_in_submission_order(direction, route):
    """Jobs queue behind a spin on the transfer stream, most writing blocks earlier jobs
    wrote too: only first-in-first-out leaves the last writer's bytes in every block."""
    rng = np.random.default_rng(zlib.crc32(f"{direction}/{route}".encode()))
    src, dst = _pair("flash", direction, seed=1, dst_blocks=24)
    mover = _mover(src, dst, direction, route)
    assert mover.issuing_thread
    results = _fifo_behind_a_spin(mover, src, dst, rng)
    assert all(r.seconds >= 0 for r in results) and sum(r.seconds for r in results) > 0
    mover.close()


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_by_id_launches_in_submit_and_jobs_on_the_thread_keep_submission_order(direction, monkeypatch):
    """The kernel route by id for jobs of 8 or more blocks (launched in submit while the
    thread holds nothing), descriptors for smaller ones (built and issued on the thread):
    96 such jobs queued behind a spin, most writing blocks earlier jobs wrote, land in
    submission order."""
    import kvswap
    from kvswap.calibration.step import exact_sms_calibration

    from kvswap.mover.plan import IdSteps

    monkeypatch.setattr("kvswap.mover.build.LAUNCH_HERE_FROM", 0)  # these jobs are small
    rng = np.random.default_rng(zlib.crc32(f"mixed/{direction}".encode()))
    src, dst = _pair("flash", direction, seed=5, dst_blocks=24)
    # 32 SMs: the kernel reads the ids where submit staged them, so a call is only a launch.
    mover = BlockMover(src.tensors, dst.tensors, direction, block_dim=src.layout.block_dim,
                       policy=Policy(force="triton.kernel", max_sms=32),
                       calibration=exact_sms_calibration(kvswap.resolve(direction).plan.device, 32))
    ids = mover._plan.ids
    fn = ids.fns[0]
    assert fn is not None and fn.launch_only(16) and not fn.launch_only(0) and mover._plan.here_from == 0
    mover._plan.ids = IdSteps((0, 8 * mover.chunks_per_block), (None, fn), (ids.names[0], ids.names[0]))
    _fifo_behind_a_spin(mover, src, dst, rng)
    # With the thread idle, a by-id job is on the stream when submit returns.
    sid, did = random_ids(rng, 16, src, dst)
    job = mover.submit(sid, did, after=None)
    assert mover._jobs.inflight[-1].job_id == job and mover._jobs.inflight[-1].end is not None
    mover.wait()
    assert all(r.ok for r in mover.poll())
    mover.close()


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "default")
def test_an_offload_sees_what_the_compute_stream_wrote_before_submit(route):
    """d2h, ``after`` left out: the compute stream rewrites the device blocks behind a
    long spin; the job, handed to the thread at once, must copy the rewritten bytes."""
    gen, rng = torch.Generator().manual_seed(2), np.random.default_rng(2)
    src, dst = _pair("flash", "d2h", seed=2)
    mover = _mover(src, dst, "d2h", route)
    _warm(mover, src, dst, rng, sizes=(48,))
    sid, did = random_ids(rng, 48, src, dst)
    fresh = [random_bytes(f.numel(), gen).to("cuda") for f in src.flats]
    before = dst.snapshot()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    for f, new in zip(src.flats, fresh):
        f.copy_(new)                                       # queued behind the spin
    job = mover.submit(sid, did)
    mover.wait(job)
    assert dst.matches(expected_after(dst, before, [n.cpu() for n in fresh], src, [(sid, did)]))
    mover.close()


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "default")
def test_an_offload_waits_for_the_event_it_was_given(route):
    """d2h with ``after=event``: a side stream writes the blocks behind a spin and records
    the event; the current stream is idle, so only the event orders the copy."""
    gen, rng = torch.Generator().manual_seed(3), np.random.default_rng(3)
    src, dst = _pair("mla", "d2h", seed=3)
    mover = _mover(src, dst, "d2h", route)
    _warm(mover, src, dst, rng, sizes=(32,))
    sid, did = random_ids(rng, 32, src, dst)
    fresh = [random_bytes(f.numel(), gen).to("cuda") for f in src.flats]
    before = dst.snapshot()
    side, written = torch.cuda.Stream(), torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SPIN)
        for f, new in zip(src.flats, fresh):
            f.copy_(new)
        written.record(side)
    job = mover.submit(sid, did, after=written)
    mover.wait(job)
    assert written.query()
    assert dst.matches(expected_after(dst, before, [n.cpu() for n in fresh], src, [(sid, did)]))
    mover.close()


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "default")
def test_a_load_with_after_none_does_not_wait_for_the_compute_stream(route):
    """h2d with ``after=None`` into free blocks: done while the compute stream (the current
    stream at submit) still spins."""
    rng = np.random.default_rng(4)
    src, dst = _pair("flash", "h2d", seed=4)
    mover = _mover(src, dst, "h2d", route)
    _warm(mover, src, dst, rng, sizes=(40,))
    sid, did = random_ids(rng, 40, src, dst)
    before, src_before = dst.snapshot(), src.snapshot()
    compute, compute_done = torch.cuda.Stream(), torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(compute):
        torch.cuda._sleep(2 * SPIN)
        compute_done.record(compute)
        job = mover.submit(sid, did, after=None)
    mover.wait(job)
    assert not compute_done.query()                        # the copy did not wait for it
    (r,) = mover.poll()
    assert r.ok and r.job_id == job
    torch.cuda.synchronize()
    assert dst.matches(expected_after(dst, before, src_before, src, [(sid, did)]))
    mover.close()


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "default")
def test_compute_ordered_after_an_issued_load_reads_the_loaded_blocks(route):
    """The engine's pattern: ``wait_issued(job)``, then ``wait_stream(mover.stream)``; a
    read on the compute stream then sees the bytes even though the copy ran late (the
    transfer stream spun first)."""
    rng = np.random.default_rng(5)
    src, dst = _pair("mla", "h2d", seed=5)
    mover = _mover(src, dst, "h2d", route)
    _warm(mover, src, dst, rng, sizes=(24,))
    sid, did = random_ids(rng, 24, src, dst)
    before, src_before = dst.snapshot(), src.snapshot()
    with torch.cuda.stream(mover.stream):
        torch.cuda._sleep(SPIN)
    job = mover.submit(sid, did, after=None)
    mover.wait_issued(job)
    compute = torch.cuda.current_stream()
    compute.wait_stream(mover.stream)
    seen = [f.clone() for f in dst.flats]                  # on the compute stream
    compute.synchronize()
    assert all(torch.equal(s.cpu(), e) for s, e in
               zip(seen, expected_after(dst, before, src_before, src, [(sid, did)])))
    mover.close()


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_without_the_thread_the_caller_issues_as_before(direction):
    rng = np.random.default_rng(6)
    src, dst = _pair("flash", direction, seed=6)
    before, src_before = dst.snapshot(), src.snapshot()
    mover = _mover(src, dst, direction, None, issuing_thread=False)
    assert not mover.issuing_thread
    jobs = [random_ids(rng, n, src, dst) for n in (3, 17, 33)]
    for job in jobs:
        mover.submit(*job)
    assert mover._jobs.thread is None and all(j.end is not None for j in mover._jobs.inflight)
    mover.close()
    assert all(r.ok for r in mover.poll())
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
