"""BlockMover's by-id path on the host: a route that declares ``CopyImpl.by_ids`` (its
transfer's ``by_ids`` returns a kvswap.registry.impl.ByIdsFn) gets the template once and
only block ids per submit.

The route here is a throwaway plugin whose transfer is the Triton kernel in its CPU
interpreter (``TRITON_INTERPRET=1``), so the whole path runs: the mover's choice, the
template bound once, the kernel deriving every address. Checks cover whole allocations
(random guard bytes, poisoned destinations) against torch indexing.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import kvswap
from kvswap import BlockMover, CopyImpl, Direction, Policy, hookimpl
from kvswap.mover.plan import LAUNCH_HERE_FROM, IdSteps
from kvswap.registry.impl import ByIdsFn
from kvswap.registry.plugins import create_plugin_host, reset_plugin_host
from mover_layouts import Pool, expected_after, layouts, pool_pair

pytest.importorskip("triton")
from kvswap.backends.triton_generic.by_ids import KernelCopyByIds  # noqa: E402
from kvswap.backends.triton_generic.launch import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the kernel in Triton's CPU interpreter")
LAYOUTS = layouts()


class Ids(ByIdsFn):
    """A by-id transfer that tells ``note`` of each call, then lets ``inner`` copy."""

    def __init__(self, inner: ByIdsFn, note: Any, launch_only: Any = None) -> None:
        self.inner, self.note, self._launch_only = inner, note, launch_only

    def __call__(self, src_ids, dst_ids, stream):
        self.note(len(src_ids))
        return self.inner(src_ids, dst_ids, stream)

    def launch_only(self, n):
        return self._launch_only is not None and self._launch_only(n)


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
        return Ids(self.kernel.by_ids(template), self.id_calls.append)


def _install(transfer: Any, **impl_kw: Any) -> None:
    class Plugin:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            if platform == "cpu":
                register(CopyImpl(name="test.kernel", kind="kernel", platforms=("cpu",),
                                  directions=(Direction.H2D, Direction.D2H), factory=lambda ctx: transfer,
                                  **{"by_ids": True, **impl_kw}))

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


def _as_left_to_kvswap(mover: BlockMover, ids_from_blocks: int = 0) -> None:
    """What a device mover built with ``issuing_thread`` left out decides, on this host
    mover with a thread: a launch-only by-id job of ``LAUNCH_HERE_FROM`` descriptors or
    more is issued in submit while the thread is idle; with ``ids_from_blocks``, jobs take
    ids only from that many blocks on (descriptors below)."""
    plan = mover._plan
    plan.here_from = kvswap.mover.plan.LAUNCH_HERE_FROM  # as monkeypatched
    if ids_from_blocks:
        fns, names = plan.ids.fns, plan.ids.names
        plan.ids = IdSteps((0, ids_from_blocks * mover.chunks_per_block), (None, fns[0]), (names[0], names[0]))


def test_a_transfer_that_declines_the_template_keeps_the_descriptor_path():
    t = Recording(offer=False)
    _install(t)
    rng = np.random.default_rng(6)
    src, dst = _pools("mla", 2)
    before, src_before = dst.snapshot(), src.snapshot()
    with BlockMover(src.tensors, dst.tensors, "h2d", policy=Policy(force="test.kernel"), device_descriptors=True) as mover:
        assert mover.id_route(12) is None
        sid, did = rng.integers(0, 40, 12).astype(np.int64), rng.permutation(56)[:12].astype(np.int64)
        mover.submit(sid, did)
    assert t.descriptor_calls == 1 and t.id_calls == [] and len(t.templates) == 1
    assert dst.matches(expected_after(dst, before, src_before, src, [(sid, did)]))


def test_a_route_that_does_not_declare_by_ids_is_never_asked():
    t = Recording()
    _install(t, by_ids=False)
    src, dst = _pools("flash", 3)
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force="test.kernel")) as mover:
        assert mover.id_route(2) is None
        mover.submit([1, 2], [3, 4])
    assert t.templates == [] and t.descriptor_calls == 1


def test_constrained_transfers_are_not_asked():
    t = Recording()
    _install(t, alignment=16)  # checked per call by the SwapFn: the mover keeps descriptors
    src, dst = _pools("flash", 3)
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force="test.kernel"), device_descriptors=True) as mover:
        mover.submit([1, 2], [3, 4])
    assert t.templates == [] and t.descriptor_calls == 1


def test_by_default_a_route_that_offers_it_gets_ids():
    t = Recording()
    _install(t)
    rng = np.random.default_rng(8)
    src, dst = _pools("flash", 9)
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = [(rng.permutation(40)[:n].astype(np.int64), rng.permutation(56)[:n].astype(np.int64)) for n in (3, 11)]
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=src.layout.block_dim,
                    policy=Policy(force="test.kernel")) as mover:
        assert mover.id_route(3) == "test.kernel"
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
        assert mover.id_route(16) is None
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
        return Ids(inner, lambda n: self._note("ids"), lambda n: n not in self.uploads)


def test_with_the_thread_idle_a_by_id_job_launches_in_submit_and_behind_a_queued_job_it_waits(monkeypatch):
    """On a mover with an issuing thread: a by-id job is launched on the caller's thread
    while the thread holds nothing and the call is only a launch; while an earlier job
    still waits there, the by-id job goes behind it, so the copies run in submission order
    (they write the same blocks); a call that uploads first goes to the thread too."""
    monkeypatch.setattr("kvswap.mover.plan.LAUNCH_HERE_FROM", 0)  # these jobs are small
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
        _as_left_to_kvswap(mover, ids_from_blocks=7)
        first = mover.submit(*jobs[0])  # by id, thread idle: launched here
        assert t.threads == [("ids", me)] and t.id_calls == [8]
        mover.submit(*jobs[1])  # descriptors: to the thread, where it waits for the gate
        third = mover.submit(*jobs[2])  # by id, but job 2 is not issued yet: behind it
        assert t.id_calls == [8] and mover._jobs.inflight[-1].end is None
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
        _as_left_to_kvswap(mover)
        assert 8 * mover.chunks_per_block < LAUNCH_HERE_FROM
        mover.submit(*jobs[0])
        mover.wait()
        assert all(r.ok for r in mover.poll())
    assert [k for k, _ in t.threads] == ["ids"] and t.threads[0][1] != threading.get_ident()
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))


def test_a_by_id_launch_that_fails_in_submit_raises_and_fails_its_job():
    class Refused(ByIdsFn):
        def __call__(self, src_ids, dst_ids, stream):
            raise RuntimeError("launch refused")

    class Broken(Recording):
        def by_ids(self, template):
            return Refused()

    t = Broken()
    _install(t)
    src, dst = _pools("flash", 14)
    before = dst.snapshot()
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force="test.kernel"),
                    issuing_thread=False) as mover:
        with pytest.raises(RuntimeError, match="launch refused"):
            mover.submit([1, 2], [3, 4])
        mover.wait()
        (result,) = mover.poll()
    assert not result.ok and "launch refused" in result.error and result.bytes == 0
    assert dst.matches(before)


class Packing(Recording):
    """A by-id transfer that packs its ids apart from the launch: the log shows when the
    mover packed the ids, recorded its markers and launched."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.log = log

    def by_ids(self, template):
        inner, log = self.kernel.by_ids(template), self.log

        class Logged(ByIdsFn):
            def __call__(self, src_ids, dst_ids, stream):  # the whole call: never taken, pack is offered
                log.append("whole")
                return inner(src_ids, dst_ids, stream)

            def pack(self, src_ids, dst_ids):
                log.append("pack")
                launch = inner.pack(src_ids, dst_ids)
                src_ids[:] = -1  # the caller's arrays may change once packed: the launch reads its copy
                return lambda stream: (log.append("launch"), launch(stream))[1]

        return Logged()


@pytest.mark.parametrize("issuing_thread", [False, True])
def test_ids_are_packed_before_the_start_marker_and_launched_after_it(monkeypatch, issuing_thread):
    """A job's time is the device's: where the route packs its ids apart from the launch,
    the mover packs them before it records the job's start marker (on the caller's thread
    and on the issuing thread), and every byte still lands."""
    log: list = []
    _install(Packing(log))
    src, dst = _pools("flash", 16)
    before, src_before = dst.snapshot(), src.snapshot()
    rng = np.random.default_rng(16)
    jobs = [(rng.permutation(40)[:n].astype(np.int64), rng.permutation(56)[:n].astype(np.int64)) for n in (9, 5)]
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, policy=Policy(force="test.kernel"),
                    issuing_thread=issuing_thread) as mover:
        c = mover._plan.completion
        mark = c.mark
        monkeypatch.setattr(c, "mark", lambda: (log.append("mark"), mark())[1])
        for sid, did in jobs:
            mover.submit(sid.copy(), did)
            mover.wait()
        results = mover.poll()
    assert log == ["pack", "mark", "launch", "mark"] * 2
    assert all(r.ok for r in results)
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


class FailingByIds(Recording):
    """A kernel transfer whose by-id call raises its runtime's own exception: where it packs
    the ids (``at="pack"``) or where it launches (``at="launch"``)."""

    def __init__(self, at: str) -> None:
        super().__init__()
        self.at = at

    def by_ids(self, template):
        at = self.at

        class Failing(ByIdsFn):
            def __call__(self, src_ids, dst_ids, stream):
                raise RuntimeError("launch queue full")

            def pack(self, src_ids, dst_ids):
                if at == "pack":
                    raise RuntimeError("launch queue full")
                return super().pack(src_ids, dst_ids)

        return Failing()


@pytest.mark.parametrize("at", ["pack", "launch"])
@pytest.mark.parametrize("threaded", [False, True], ids=["on-submit", "on-the-issuing-thread"])
def test_a_by_id_launch_that_raises_names_the_implementation(threaded, at):
    """The mover's by-id path calls the backend's code directly: what it raises reaches the
    caller (or the job's result) as a BackendError naming the implementation, its own
    exception chained. In submit, a call refused before anything was enqueued (packing the
    ids) leaves no job; one that may have enqueued part of it (the launch) fails its job."""
    _install(FailingByIds(at))
    src, dst = _pools("mla", 4)
    before = dst.snapshot()
    with BlockMover(src.tensors, dst.tensors, "h2d", policy=Policy(force="test.kernel"), device_descriptors=True,
                    issuing_thread=threaded) as mover:
        assert mover.id_route(2) == "test.kernel"
        if threaded:
            mover.wait(mover.submit([1, 2], [3, 4]))
            (result,) = mover.poll()
            assert result.error == "BackendError: test.kernel failed: RuntimeError: launch queue full"
        else:
            with pytest.raises(kvswap.BackendError, match="test.kernel failed: RuntimeError: launch queue full") as e:
                mover.submit([1, 2], [3, 4])
            assert isinstance(e.value.__cause__, RuntimeError)
            mover.wait()
            results = mover.poll()
            if at == "pack":
                assert results == [] and mover.in_flight == 0
                with pytest.raises(kvswap.InvalidTransferError, match="ids so far: 1..0"):
                    mover.wait(1)  # no job, no id used
            else:
                assert [(r.job_id, r.ok) for r in results] == [(1, False)]
    assert dst.matches(before)
