"""BlockMover's by-id path on the host: a route whose transfer offers ``by_ids``
(kvswap.registry.impl.ByIdsFn) gets the template once and only block ids per submit.

The route here is a throwaway plugin whose transfer is the Triton kernel in its CPU
interpreter (``TRITON_INTERPRET=1``), so the whole path runs: the mover's choice, the
template bound once, the kernel deriving every address. Checks cover whole allocations
(random guard bytes, poisoned destinations) against torch indexing.
"""
from __future__ import annotations

import threading
import types
from typing import Any

import numpy as np
import pytest

import kvswap
from kvswap import BlockMover, CopyImpl, Direction, Policy, hookimpl
from kvswap.registry.plugins import create_plugin_host, reset_plugin_host
from mover_layouts import Pool, expected_after, layouts, pool_pair

pytest.importorskip("triton")
from kvswap.backends.triton_generic.by_ids import KernelCopyByIds  # noqa: E402
from kvswap.backends.triton_generic.launch import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the kernel in Triton's CPU interpreter")
LAYOUTS = layouts()


class Recording:
    """A kernel transfer that records how the mover used it."""

    def __init__(self, offer: bool = True) -> None:
        self.kernel = KernelCopyByIds(num_sms=3, device_index=None)
        self.offer = offer
        self.templates: list = []
        self.descriptor_calls = 0
        self.id_calls: list[int] = []

    def __call__(self, src, dst, sizes, stream):
        self.descriptor_calls += 1
        return self.kernel(src, dst, sizes, stream)

    def by_ids(self, template):
        self.templates.append(template)
        if not self.offer:
            return None
        inner = self.kernel.by_ids(template)

        def fn(src_ids, dst_ids, stream):
            self.id_calls.append(len(src_ids))
            return inner(src_ids, dst_ids, stream)

        return fn


def _install(transfer: Any, **impl_kw: Any) -> None:
    class Plugin:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            if platform == "cpu":
                register(CopyImpl(name="test.kernel", kind="kernel", platforms=("cpu",),
                                  directions=(Direction.H2D, Direction.D2H), factory=lambda ctx: transfer,
                                  **impl_kw))

    reset_plugin_host(create_plugin_host(entry_points=[], env={}, extra=[("testplugin", Plugin())]))


def _pools(name: str, seed: int, src_blocks: int = 40, dst_blocks: int = 56) -> tuple[Pool, Pool]:
    return pool_pair(LAYOUTS[name], seed, src_blocks, dst_blocks)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_submits_send_ids_and_every_byte_lands(name, direction):
    t = Recording()
    _install(t)
    rng = np.random.default_rng(5)
    src, dst = _pools(name, 1)
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = []
    with BlockMover(src.tensors, dst.tensors, direction, block_dim=src.layout.block_dim,
                    policy=Policy(force="test.kernel"), device_descriptors=True) as mover:
        assert len(t.templates) == 1  # bound once, at construction
        for n in (1, 9, 30, 0, 17):
            sid = rng.integers(0, src.num_blocks, n).astype(np.int64)
            did = rng.permutation(dst.num_blocks)[:n].astype(np.int64)
            mover.submit(sid, did)
            jobs.append((sid, did))
        results = mover.poll()
    assert t.descriptor_calls == 0 and t.id_calls == [1, 9, 30, 17]
    assert all(r.ok for r in results)
    assert [r.descriptors for r in results] == [n * mover.chunks_per_block for n in (1, 9, 30, 0, 17)]
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


def test_a_transfer_that_declines_the_template_keeps_the_descriptor_path():
    t = Recording(offer=False)
    _install(t)
    rng = np.random.default_rng(6)
    src, dst = _pools("mla", 2)
    before, src_before = dst.snapshot(), src.snapshot()
    with BlockMover(src.tensors, dst.tensors, "h2d", policy=Policy(force="test.kernel"), device_descriptors=True) as mover:
        assert mover._ids_steps is None
        sid, did = rng.integers(0, 40, 12).astype(np.int64), rng.permutation(56)[:12].astype(np.int64)
        mover.submit(sid, did)
    assert t.descriptor_calls == 1 and t.id_calls == [] and len(t.templates) == 1
    assert dst.matches(expected_after(dst, before, src_before, src, [(sid, did)]))


def test_constrained_transfers_are_not_asked():
    t = Recording()
    _install(t, alignment=16)  # checked per call by the SwapFn: the mover keeps descriptors
    src, dst = _pools("flash", 3)
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force="test.kernel"), device_descriptors=True) as mover:
        mover.submit([1, 2], [3, 4])
    assert t.templates == [] and t.descriptor_calls == 1


def test_a_failure_reported_after_submit_fails_its_job():
    from kvswap.registry import deferred

    pending: list = []

    def transfer(src, dst, sizes, stream):
        # Returns at once; the first job's work then fails on "another thread", before
        # the stream passes it (as the issuer sets a ticket's error before its flag).
        error = kvswap.DriverError("cuMemcpyBatchAsync", 1, "CUDA_ERROR_INVALID_VALUE") if not pending else None
        ticket = types.SimpleNamespace(error=error, reported=False)
        deferred.report(ticket)
        pending.append(ticket)

    _install(transfer)
    src, dst = _pools("mla", 4)
    mover = BlockMover(src.tensors, dst.tensors, "h2d", policy=Policy(force="test.kernel"), device_descriptors=True)
    first = mover.submit([1], [2])  # no exception: the failure comes later
    second = mover.submit([3], [4])
    results = {r.job_id: r for r in mover.poll()}
    assert not results[first].ok and "CUDA_ERROR_INVALID_VALUE" in results[first].error
    assert results[first].bytes == 0 and pending[0].reported
    assert results[second].ok and not pending[1].reported
    mover.close()


def test_arrays_are_promised_stable_inside_submit():
    from kvswap.registry import deferred

    seen = []
    _install(lambda src, dst, sizes, stream: seen.append((deferred.arrays_stable(), threading.get_ident())))
    src, dst = _pools("mla", 5)
    with BlockMover(src.tensors, dst.tensors, "h2d", policy=Policy(force="test.kernel"), device_descriptors=True) as mover:
        mover.submit([1], [2])
    assert seen == [(True, threading.get_ident())] and deferred.arrays_stable() is False


def test_by_default_a_route_that_offers_it_gets_ids():
    t = Recording()
    _install(t)
    rng = np.random.default_rng(8)
    src, dst = _pools("flash", 9)
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = [(rng.permutation(40)[:n].astype(np.int64), rng.permutation(56)[:n].astype(np.int64)) for n in (3, 11)]
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=src.layout.block_dim,
                    policy=Policy(force="test.kernel")) as mover:
        assert mover._ids_steps is not None
        for job in jobs:
            mover.submit(*job)
        mover.wait()
        assert all(r.ok for r in mover.poll())
    assert len(t.templates) == 1 and t.id_calls == [3, 11] and t.descriptor_calls == 0
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))


def test_without_device_descriptors_the_mover_builds_and_coalesces_descriptors():
    """``device_descriptors=False``: a route that offers the by-id path still gets
    coalesced descriptors (a run of consecutive ids becomes fewer, longer copies)."""
    t = Recording()
    _install(t)
    src, dst = _pools("flash", 3)
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = [(np.arange(4, 20, dtype=np.int64), np.arange(30, 46, dtype=np.int64))]
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=src.layout.block_dim,
                    policy=Policy(force="test.kernel"), device_descriptors=False) as mover:
        assert mover._ids_steps is None
        mover.submit(*jobs[0])
        mover.wait()
        (result,) = mover.poll()
    assert t.templates == [] and t.id_calls == [] and t.descriptor_calls == 1
    assert result.ok and result.descriptors < len(jobs[0][0]) * mover.chunks_per_block
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


class Gated(Recording):
    """A Recording whose calls note the thread they ran on; calls off the test's thread
    wait for ``gate`` (a job stuck on the issuing thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.main = threading.get_ident()
        self.threads: list[tuple[str, int]] = []
        self.uploads: set[int] = set()  # id counts whose call is more than a launch

    def _note(self, kind: str) -> None:
        self.threads.append((kind, threading.get_ident()))
        if threading.get_ident() != self.main:
            assert self.gate.wait(10)

    def __call__(self, src, dst, sizes, stream):
        self._note("descriptors")
        return super().__call__(src, dst, sizes, stream)

    def by_ids(self, template):
        inner = super().by_ids(template)

        def fn(src_ids, dst_ids, stream):
            self._note("ids")
            return inner(src_ids, dst_ids, stream)

        fn.launch_only = lambda n: n not in self.uploads
        return fn


def test_with_the_thread_idle_a_by_id_job_launches_in_submit_and_behind_a_queued_job_it_waits(monkeypatch):
    """On a mover with an issuing thread: a by-id job is launched on the caller's thread
    while the thread holds nothing and the call is only a launch; while an earlier job
    still waits there, the by-id job goes behind it, so the copies run in submission order
    (they write the same blocks); a call that uploads first goes to the thread too."""
    monkeypatch.setattr("kvswap.mover.submit.LAUNCH_HERE_MIN_DESCRIPTORS", 0)  # these jobs are small
    t = Gated()
    _install(t)
    rng = np.random.default_rng(12)
    src, dst = _pools("flash", 13)
    before, src_before = dst.snapshot(), src.snapshot()
    me = threading.get_ident()
    did = rng.permutation(56)[:8].astype(np.int64)
    sizes = (8, 6, 8, 8, 8)  # by id from 7 blocks on (below): job 2 takes descriptors
    jobs = [(rng.permutation(40)[:n].astype(np.int64), did[:n]) for n in sizes]
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force="test.kernel"),
                    issuing_thread=True) as mover:
        _, fns, names = mover._ids_steps
        mover._ids_steps = ((0, 7 * mover.chunks_per_block), (None, fns[0]), (names[0], names[0]))
        first = mover.submit(*jobs[0])  # by id, thread idle: launched here
        assert t.threads == [("ids", me)] and t.id_calls == [8]
        mover.submit(*jobs[1])  # descriptors: to the thread, where it waits for the gate
        third = mover.submit(*jobs[2])  # by id, but job 2 is not issued yet: behind it
        assert t.id_calls == [8] and mover._inflight[-1].end is None
        t.gate.set()
        mover.wait_issued(third)
        fourth = mover.submit(*jobs[3])  # the thread is idle again: launched here
        assert t.threads[-1] == ("ids", me)
        t.uploads = {8}  # a call that uploads first: to the thread, though it is idle
        fifth = mover.submit(*jobs[4])
        mover.wait()
        results = mover.poll()
    assert [r.job_id for r in results] == [first, first + 1, third, fourth, fifth] and all(r.ok for r in results)
    assert [k for k, _ in t.threads] == ["ids", "descriptors", "ids", "ids", "ids"]
    assert t.threads[1][1] != me and t.threads[2][1] == t.threads[1][1] == t.threads[4][1]
    assert t.descriptor_calls == 1 and t.id_calls == [8, 8, 8, 8]
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


def test_a_by_id_job_below_the_launch_minimum_goes_to_the_thread():
    t = Gated()
    t.gate.set()
    _install(t)
    src, dst = _pools("flash", 15)
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = [(np.arange(8, dtype=np.int64), np.arange(8, 16, dtype=np.int64))]
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force="test.kernel"),
                    issuing_thread=True) as mover:
        assert 8 * mover.chunks_per_block < kvswap.mover.submit.LAUNCH_HERE_MIN_DESCRIPTORS
        mover.submit(*jobs[0])
        mover.wait()
        assert all(r.ok for r in mover.poll())
    assert [k for k, _ in t.threads] == ["ids"] and t.threads[0][1] != threading.get_ident()
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))


def test_a_by_id_launch_that_fails_in_submit_raises_and_fails_its_job(monkeypatch):
    monkeypatch.setattr("kvswap.mover.submit.LAUNCH_HERE_MIN_DESCRIPTORS", 0)
    class Broken(Recording):
        def by_ids(self, template):
            def fn(src_ids, dst_ids, stream):
                raise RuntimeError("launch refused")
            fn.launch_only = lambda n: True
            return fn

    t = Broken()
    _install(t)
    src, dst = _pools("flash", 14)
    before = dst.snapshot()
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force="test.kernel"),
                    issuing_thread=True) as mover:
        with pytest.raises(RuntimeError, match="launch refused"):
            mover.submit([1, 2], [3, 4])
        mover.wait()
        (result,) = mover.poll()
    assert not result.ok and "launch refused" in result.error and result.bytes == 0
    assert dst.matches(before)


class Staging(Recording):
    """A by-id transfer that offers ``stage``: the log shows when the mover staged the ids,
    recorded its markers and launched."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def by_ids(self, template):
        inner = self.kernel.by_ids(template)
        log = self.log

        def fn(src_ids, dst_ids, stream):  # the whole call: never taken where stage is offered
            log.append("whole")
            return inner(src_ids, dst_ids, stream)

        def stage(src_ids, dst_ids):
            log.append("stage")
            launch = inner.stage(src_ids, dst_ids)
            src_ids[:] = -1  # the caller's arrays may change once staged: the launch reads its copy
            return lambda stream: (log.append("launch"), launch(stream))[1]

        fn.stage = stage
        fn.launch_only = lambda n: True
        return fn


@pytest.mark.parametrize("issuing_thread", [False, True])
def test_ids_are_staged_before_the_start_marker_and_launched_after_it(monkeypatch, issuing_thread):
    """A job's time is the device's: where the route stages its ids apart from the launch,
    the mover stages them before it records the job's start marker (on the caller's path
    and when it launches in submit), and every byte still lands."""
    monkeypatch.setattr("kvswap.mover.submit.LAUNCH_HERE_MIN_DESCRIPTORS", 0)
    log: list = []
    _install(Staging(log))
    src, dst = _pools("flash", 16)
    before, src_before = dst.snapshot(), src.snapshot()
    rng = np.random.default_rng(16)
    jobs = [(rng.permutation(40)[:n].astype(np.int64), rng.permutation(56)[:n].astype(np.int64)) for n in (9, 5)]
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force="test.kernel"),
                    issuing_thread=issuing_thread) as mover:
        c = mover._completion
        mark = c.mark
        monkeypatch.setattr(c, "mark", lambda: (log.append("mark"), mark())[1])
        for sid, did in jobs:
            mover.submit(sid.copy(), did)
            mover.wait()
        results = mover.poll()
    assert log == ["stage", "mark", "launch", "mark"] * 2
    assert all(r.ok for r in results)
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


class FailingByIds(Recording):
    """A kernel transfer whose by-id launch raises its runtime's own exception."""

    def by_ids(self, template):
        def fn(src_ids, dst_ids, stream):
            raise RuntimeError("launch queue full")

        return fn


@pytest.mark.parametrize("threaded", [False, True], ids=["on-submit", "on-the-issuing-thread"])
def test_a_by_id_launch_that_raises_names_the_implementation(threaded):
    """The mover's by-id path calls the backend's code directly: what it raises reaches the
    caller (or the job's result) as a BackendError naming the implementation."""
    _install(FailingByIds())
    src, dst = _pools("mla", 4)
    before = dst.snapshot()
    with BlockMover(src.tensors, dst.tensors, "h2d", policy=Policy(force="test.kernel"), device_descriptors=True,
                    issuing_thread=threaded) as mover:
        assert mover._ids_steps is not None
        if threaded:
            mover.wait(mover.submit([1, 2], [3, 4]))
            (result,) = mover.poll()
            assert result.error == "BackendError: test.kernel failed: RuntimeError: launch queue full"
        else:
            with pytest.raises(kvswap.BackendError, match="test.kernel failed: RuntimeError: launch queue full") as e:
                mover.submit([1, 2], [3, 4])
            assert isinstance(e.value.__cause__, RuntimeError)
    assert dst.matches(before)
