"""BlockMover's issuing thread, exercised on the host: movers between host tensors built
with ``issuing_thread=True`` build and copy every job on the thread, through the host
reference or a gated route that holds the thread until the test lets it go.

Every check compares whole allocations (guard bytes included) with a reference computed
by torch indexing, on random data.
"""
from __future__ import annotations

import gc
import threading
import weakref
from typing import Any, Callable

import numpy as np
import pytest
import torch

from kvswap import BlockMover, CopyImpl, Direction, KVGroup, Policy, hookimpl
from kvswap.errors import BlockIdError, ConfigurationError, InvalidTransferError
from kvswap.registry.plugins import create_plugin_host, reset_plugin_host
from kvswap.registry.reference import host_copy
from fakes import DeferredStream
from mover_layouts import Pool, expected_after, layouts, pool_pair, random_ids

LAYOUTS = layouts()
HOLD_S = 10.0  # a gate that was never opened fails the test instead of hanging it


def _pools(name: str, seed: int, src_blocks: int = 40, dst_blocks: int = 24) -> tuple[Pool, Pool]:
    return pool_pair(LAYOUTS[name], seed, src_blocks, dst_blocks)



class Gated:
    """A copy route that copies with the host reference once its gate is open, and raises
    on the calls listed in ``fail_on`` (1-based), before copying anything."""

    def __init__(self, fail_on: tuple[int, ...] = ()) -> None:
        self.gate = threading.Event()
        self.fail_on = set(fail_on)
        self.calls = 0
        self.threads: set[str] = set()

    def __call__(self, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray, stream: Any) -> None:
        self.threads.add(threading.current_thread().name)
        assert self.gate.wait(HOLD_S), "the test never opened the gate"
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError(f"call {self.calls} refused")
        host_copy(src, dst, sizes)


def _install(fn: Callable) -> None:
    class Plugin:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            if platform == "cpu":
                register(CopyImpl(name="test.gated", kind="batch", platforms=("cpu",),
                                  directions=(Direction.H2D, Direction.D2H), factory=lambda ctx: fn))

    reset_plugin_host(create_plugin_host(entry_points=[], env={}, extra=[("testplugin", Plugin())]))


@pytest.fixture(autouse=True)
def _fresh_plugins():
    yield
    reset_plugin_host()


def _gated_mover(src: Pool, dst: Pool, route: Gated, direction: str = "h2d") -> BlockMover:
    _install(route)
    return BlockMover(src.tensors, dst.tensors, direction, block_dim=src.layout.block_dim,
                      policy=Policy(force="test.gated"), issuing_thread=True)


def _open_later(route: Gated, after_s: float = 0.05) -> threading.Timer:
    timer = threading.Timer(after_s, route.gate.set)
    timer.start()
    return timer


def test_a_host_mover_copies_in_submit_unless_asked_for_the_thread():
    src, dst = _pools("mla", 1)
    with BlockMover(src.tensors, dst.tensors, "h2d") as mover:
        assert not mover.issuing_thread
        mover.submit([1], [2])
        assert mover._jobs.thread is None
    with BlockMover(src.tensors, dst.tensors, "h2d", issuing_thread=True) as mover:
        assert mover.issuing_thread
    with pytest.raises(ConfigurationError, match="issuing_thread='yes' must be None, True or False"):
        BlockMover(src.tensors, dst.tensors, "h2d", issuing_thread="yes")


def test_groups_that_share_destinations_refuse_the_thread_and_issue_in_submit():
    gen = torch.Generator().manual_seed(2)
    src, dst = Pool(LAYOUTS["mla"], 20, gen), Pool(LAYOUTS["mla"], 20, gen)
    groups = [KVGroup(src.tensors, dst.tensors), KVGroup(src.tensors, dst.tensors)]
    with pytest.raises(ConfigurationError, match="share destination tensors.*leave issuing_thread out"):
        BlockMover.groups(groups, "h2d", issuing_thread=True)
    mover = BlockMover.groups(groups, "h2d")
    assert not mover.issuing_thread
    with pytest.raises(BlockIdError, match="two KV groups write the same destination bytes"):
        mover.submit([[1], [2]], [[3], [3]])
    mover.close()


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_jobs_run_in_submission_order_on_the_thread(name, direction):
    """Sixty jobs queue behind a closed gate, most writing blocks earlier jobs wrote too:
    only first-in-first-out leaves the last writer's bytes in every block. The caller
    scribbles over its id arrays right after each submit: the job keeps the ids it got."""
    rng = np.random.default_rng(3)
    src, dst = _pools(name, 4, dst_blocks=12)
    before, src_before = dst.snapshot(), src.snapshot()
    route = Gated()
    mover = _gated_mover(src, dst, route, direction)
    jobs, ids = [], []
    for _ in range(60):
        sid, did = random_ids(rng, int(rng.integers(1, 9)), src, dst)
        jobs.append((sid.copy(), did.copy()))
        ids.append(mover.submit(sid, did))
        sid[:] = 0
        did[:] = did[::-1]
    assert mover.poll() == [] and mover.in_flight == 60 and dst.matches(before)
    route.gate.set()
    mover.wait()
    results = mover.poll()
    assert [r.job_id for r in results] == ids and all(r.ok for r in results)
    assert [r.bytes for r in results] == [len(s) * mover.block_bytes for s, _ in jobs]
    assert all(r.seconds >= 0 for r in results) and mover.poll() == []
    assert route.threads == {f"kvswap-{direction}-mover"}
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)
    mover.close()


def test_an_error_on_the_thread_fails_that_job_and_the_next_jobs_still_run():
    rng = np.random.default_rng(5)
    src, dst = _pools("flash", 6)
    before, src_before = dst.snapshot(), src.snapshot()
    route = Gated(fail_on=(2, 5))
    mover = _gated_mover(src, dst, route)
    jobs = [random_ids(rng, 3, src, dst) for _ in range(7)]
    ids = [mover.submit(*job) for job in jobs]
    route.gate.set()
    mover.wait()
    results = mover.poll()
    assert [r.job_id for r in results] == ids
    assert [r.ok for r in results] == [True, False, True, True, False, True, True]
    for k in (1, 4):
        assert results[k].bytes == 0 and results[k].error == f"BackendError: test.gated failed: RuntimeError: call {k + 1} refused"
    assert mover._jobs.thread.alive
    copied = [job for k, job in enumerate(jobs) if k not in (1, 4)]
    assert dst.matches(expected_after(dst, before, src_before, src, copied))
    mover.close()
    assert not mover._jobs.thread.alive


def test_close_issues_every_queued_job_then_stops_the_thread():
    rng = np.random.default_rng(7)
    src, dst = _pools("cross", 8)
    before, src_before = dst.snapshot(), src.snapshot()
    route = Gated()
    mover = _gated_mover(src, dst, route)
    jobs = [random_ids(rng, 4, src, dst) for _ in range(20)]
    ids = [mover.submit(*job) for job in jobs]
    timer = _open_later(route)
    mover.close()                      # returns only once all twenty have been copied
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert [r.job_id for r in mover.poll()] == ids and not mover._jobs.thread.alive
    assert mover.in_flight == 0 and mover.pool.in_use == 0
    timer.join()


def test_wait_on_a_job_the_thread_has_not_issued_yet():
    rng = np.random.default_rng(9)
    src, dst = _pools("mla", 10)
    before, src_before = dst.snapshot(), src.snapshot()
    route = Gated()
    mover = _gated_mover(src, dst, route)
    jobs = [random_ids(rng, 5, src, dst) for _ in range(4)]
    ids = [mover.submit(*job) for job in jobs]
    assert all(job.end is None for job in mover._jobs.inflight)  # none issued: the gate is shut
    timer = _open_later(route)
    mover.wait(ids[1])
    first = mover.poll()
    assert [r.job_id for r in first] == ids[:len(first)] and len(first) >= 2
    assert all(r.ok for r in first)
    mover.wait_issued()
    assert all(job.end is not None for job in mover._jobs.inflight)
    mover.wait()
    rest = mover.poll()
    assert [r.job_id for r in first + rest] == ids      # each job reported once
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    mover.close()
    timer.join()


def test_descriptor_buffers_stay_with_their_jobs_until_the_copy_ran():
    """The route keeps the pooled descriptor arrays and copies later: a buffer handed back
    (and refilled by a later job) before its copy ran would copy the wrong blocks."""
    stream = DeferredStream()
    _install(stream.enqueue)
    rng = np.random.default_rng(11)
    src, dst = _pools("flash", 12, src_blocks=64, dst_blocks=48)
    before, src_before = dst.snapshot(), src.snapshot()
    mover = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force="test.gated"),
                       issuing_thread=True)
    mover._plan.completion = stream         # before the first submit starts the thread
    jobs = [random_ids(rng, int(rng.integers(1, 9)), src, dst) for _ in range(40)]
    first = [mover.submit(*job) for job in jobs[:30]]
    mover.wait_issued()
    assert (mover.in_flight, mover.pool.in_use, mover.pool.allocated) == (30, 30, 30)
    assert mover.poll() == [] and dst.matches(before)
    stream.run(10)
    assert [r.job_id for r in mover.poll()] == first[:10] and mover.pool.in_use == 20
    second = [mover.submit(*job) for job in jobs[30:]]    # reuse the ten buffers handed back
    mover.wait_issued()
    assert (mover.pool.allocated, mover.pool.in_use) == (30, 30)
    mover.wait(second[-1])
    results = mover.poll()
    assert [r.job_id for r in results] == first[10:] + second and all(r.ok for r in results)
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    mover.close()
    assert (mover.pool.in_use, mover.pool.allocated) == (0, 30)


def test_bad_ids_raise_in_submit_and_queue_nothing():
    route = Gated()
    src, dst = _pools("mla", 13)
    before = dst.snapshot()
    mover = _gated_mover(src, dst, route)
    with pytest.raises(BlockIdError, match="out of range"):
        mover.submit([1, 2], [3, 99])
    with pytest.raises(BlockIdError, match="are both 3"):
        mover.submit([1, 2], [3, 3])
    with pytest.raises(BlockIdError, match=r"src_block_ids\[0\]=-1 is out of range"):
        mover.submit([-1], [3])
    assert mover.in_flight == 0 and mover._jobs.thread is None
    route.gate.set()
    job = mover.submit(np.array([4, 5]), np.array([6, 7]))
    assert job == 1
    mover.close()
    assert dst.matches(expected_after(dst, before, src.snapshot(), src, [([4, 5], [6, 7])]))


def test_a_mover_nobody_closed_is_collected_and_its_thread_ends():
    rng = np.random.default_rng(15)
    src, dst = _pools("flash", 16)
    before, src_before = dst.snapshot(), src.snapshot()
    mover = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, issuing_thread=True)
    jobs = [random_ids(rng, 6, src, dst) for _ in range(5)]
    for job in jobs:
        mover.submit(*job)
    thread = mover._jobs.thread._thread
    gone = weakref.ref(mover)
    del mover
    gc.collect()
    assert gone() is None              # nothing on the thread kept it alive
    thread.join(HOLD_S)
    assert not thread.is_alive()
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))


def test_descriptors_asked_while_the_thread_builds_leave_the_pool_whole():
    """The engine's thread takes buffers for descriptors() while the issuing thread takes
    and the engine's thread returns them for jobs: the pool's accounting stays exact."""
    rng = np.random.default_rng(17)
    src, dst = _pools("flash", 18, src_blocks=64, dst_blocks=48)
    before, src_before = dst.snapshot(), src.snapshot()
    route = Gated(fail_on=(7,))
    mover = _gated_mover(src, dst, route)
    route.gate.set()
    jobs, ids, results = [], [], []
    for k in range(120):
        sid, did = random_ids(rng, int(rng.integers(1, 17)), src, dst)
        jobs.append((sid, did))
        ids.append(mover.submit(sid, did))
        s, d, n = mover.descriptors(sid, did)
        assert int(n.sum()) == len(sid) * mover.block_bytes
        if k % 10 == 9:
            results += mover.poll()
    mover.wait()
    results += mover.poll()
    assert mover.pool.in_use == 0 and mover.pool.idle == mover.pool.allocated
    assert [r.job_id for r in results] == ids
    assert [r.job_id for r in results if not r.ok] == [ids[6]]
    copied = [job for k, job in enumerate(jobs) if k != 6]
    assert dst.matches(expected_after(dst, before, src_before, src, copied))
    with pytest.raises(InvalidTransferError, match="job_id=121 was not returned"):
        mover.wait_issued(121)
    mover.close()


def test_waiting_on_the_issuing_thread_itself_raises_instead_of_hanging():
    """A mover collected by a garbage collection that runs on its own issuing thread must
    not wait there for jobs only that thread can issue."""
    src, dst = _pools("mla", 19)
    seen: list = []

    def copy(s, d, n, stream):
        (job,) = [j for j in mover._jobs.inflight if j.end is None]
        try:
            mover._jobs.thread.wait_issued(job)
        except RuntimeError as e:
            seen.append(str(e))
        host_copy(s, d, n)

    _install(copy)
    mover = BlockMover(src.tensors, dst.tensors, "h2d", policy=Policy(force="test.gated"), issuing_thread=True)
    before, src_before = dst.snapshot(), src.snapshot()
    mover.wait(mover.submit([5], [6]))
    assert seen == ["the issuing thread cannot wait for a job it has not issued yet"]
    (r,) = mover.poll()
    assert r.ok
    assert dst.matches(expected_after(dst, before, src_before, src, [([5], [6])]))
    mover.close()
