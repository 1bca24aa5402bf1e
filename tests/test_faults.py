"""Faults an engine meets, on the host: memory running out while a mover allocates, a
fork after the mover was built, two threads on one mover, an interrupt inside ``submit``
and ``close`` with jobs in flight.

Every check compares whole allocations (guard bytes included) with a reference computed by
torch indexing, on random data; a buffer handed back to the pool too early would let a
later job overwrite descriptors a queued copy still reads (``DeferredStream`` runs the
copies only when the test says).
"""
from __future__ import annotations

import multiprocessing
import sys
import threading

import numpy as np
import pytest
import torch

import kvswap
from kvswap import AllocationError, BlockMover, CopyImpl, Direction, ForkedProcessError, Policy, hookimpl
from kvswap.memory import pinned_pool
from kvswap.mover.jobs import INTERRUPTED
from kvswap.registry.plugins import create_plugin_host, reset_plugin_host
from kvswap.registry.reference import host_copy
from fakes import DeferredStream
from mover_layouts import expected_after, layouts, pool_pair, random_ids

LAYOUTS = layouts()


def _pools(name: str, seed: int, src_blocks: int = 40, dst_blocks: int = 24):
    return pool_pair(LAYOUTS[name], seed, src_blocks, dst_blocks)


def _install(fn, requires_pinned: bool = False) -> None:
    class Plugin:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            if platform == "cpu":
                register(CopyImpl(name="test.route", kind="batch", platforms=("cpu",),
                                  directions=(Direction.H2D, Direction.D2H), factory=lambda ctx: fn,
                                  requires_pinned=requires_pinned))

    reset_plugin_host(create_plugin_host(entry_points=[], env={}, extra=[("testplugin", Plugin())]))


@pytest.fixture(autouse=True)
def _fresh_plugins():
    yield
    reset_plugin_host()


class OutOfMemory:
    """Stands in for the pools' allocation: runs out of memory on the calls ``fail_on``
    (1-based) or on every call of at least ``fail_from`` bytes, as torch does."""

    def __init__(self, fail_on: tuple[int, ...] = (), fail_from: int | None = None) -> None:
        self.fail_on, self.fail_from, self.calls, self.failed = set(fail_on), fail_from, 0, 0
        self.real = pinned_pool.new_host_array

    def __call__(self, shape, dtype, pinned):
        self.calls += 1
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self.calls in self.fail_on or (self.fail_from is not None and nbytes >= self.fail_from):
            self.failed += 1
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {nbytes} bytes")
        return self.real(shape, dtype, pinned)


# -- memory runs out ---------------------------------------------------------------------------
def test_a_mover_that_cannot_get_its_first_buffer_is_not_built_and_others_keep_working(monkeypatch):
    rng = np.random.default_rng(1)
    src, dst = _pools("flash", 2)
    before, src_before = dst.snapshot(), src.snapshot()
    working = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, issuing_thread=True)
    threads = threading.active_count()
    oom = OutOfMemory(fail_from=1)
    monkeypatch.setattr(pinned_pool, "new_host_array", oom)
    with pytest.raises(AllocationError) as e:
        BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1)
    assert isinstance(e.value, MemoryError) and isinstance(e.value, kvswap.KvSwapError)
    assert (e.value.what, e.value.nbytes, e.value.memory) == ("a BlockMover descriptor buffer of 1024 descriptors",
                                                             3 * 1024 * 8, "host")
    assert "could not allocate 24,576 bytes of host memory for a BlockMover descriptor buffer" in str(e.value)
    assert isinstance(e.value.__cause__, torch.OutOfMemoryError) and oom.failed == 1
    assert threading.active_count() == threads  # nothing started for the mover that was not built
    jobs = [random_ids(rng, 5, src, dst) for _ in range(3)]
    for job in jobs:  # the mover built before keeps copying on the buffer it has
        working.wait(working.submit(*job))
    assert all(r.ok for r in working.poll()) and oom.failed == 1
    monkeypatch.setattr(pinned_pool, "new_host_array", oom.real)
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1) as again:
        assert again.pool.allocated == 1
    working.close()
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))


@pytest.mark.parametrize("threaded", [False, True])
def test_a_job_that_cannot_get_a_descriptor_buffer_fails_alone(monkeypatch, threaded):
    """Blocks of many chunks need a larger buffer than the first: it runs out. On the
    caller's thread submit raises before anything is enqueued; on the issuing thread that
    job fails and the next ones run. The pool's accounting stays exact."""
    rng = np.random.default_rng(3)
    src, dst = _pools("flash", 4, src_blocks=600, dst_blocks=500)
    assert LAYOUTS["flash"].groups * 2 == 6  # chunks per block
    before, src_before = dst.snapshot(), src.snapshot()
    mover = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, issuing_thread=threaded)
    oom = OutOfMemory(fail_from=3 * 2048 * 8)
    monkeypatch.setattr(pinned_pool, "new_host_array", oom)
    small = random_ids(rng, 8, src, dst)
    big = random_ids(rng, 300, src, dst)  # 300 x 6 chunks (3 layers x K, V): 1,800 descriptors
    mover.submit(*small)
    if threaded:
        failed = mover.submit(*big)
    else:
        with pytest.raises(AllocationError, match="descriptor buffer of 2048 descriptors"):
            mover.submit(*big)
        assert dst.matches(expected_after(dst, before, src_before, src, [small]))  # the big job moved nothing
    last = random_ids(rng, 8, src, dst)
    mover.submit(*last)
    mover.wait()
    results = mover.poll()
    assert oom.failed == 1 and mover.pool.in_use == 0 and mover.pool.idle == mover.pool.allocated <= 2
    if threaded:
        assert [r.ok for r in results] == [True, False, True] and results[1].job_id == failed
        assert results[1].error.startswith("AllocationError: could not allocate 49,152 bytes of host memory")
    else:
        assert [r.ok for r in results] == [True, True] and [r.job_id for r in results] == [1, 2]
    mover.close()
    assert dst.matches(expected_after(dst, before, src_before, src, [small, last]))


def test_a_bounce_buffer_that_cannot_be_allocated_fails_the_submit_before_any_byte_moves(monkeypatch):
    _install(lambda s, d, n, stream: host_copy(s, d, n), requires_pinned=True)
    rng = np.random.default_rng(5)
    src, dst = _pools("mla", 6)
    before, src_before = dst.snapshot(), src.snapshot()
    with pytest.warns(kvswap.PageableMemoryWarning):
        mover = BlockMover(src.tensors, dst.tensors, "h2d", policy=Policy(force="test.route"))
    assert mover.bounces_host_memory
    oom = OutOfMemory(fail_from=1 << 20)  # the bounce pool's buffers are 1 MiB and up
    monkeypatch.setattr(pinned_pool, "new_host_array", oom)
    with pytest.raises(AllocationError, match="bounce buffer for pageable host memory"):
        mover.submit(*random_ids(rng, 4, src, dst))
    assert dst.matches(before) and mover.poll() == [] and mover.pool.in_use == 0
    monkeypatch.setattr(pinned_pool, "new_host_array", oom.real)
    job = random_ids(rng, 4, src, dst)
    mover.wait(mover.submit(*job))
    assert [r.job_id for r in mover.poll()] == [1]
    mover.close()
    assert dst.matches(expected_after(dst, before, src_before, src, [job]))


def test_running_out_is_told_apart_from_other_failures():
    from kvswap.memory.allocation import allocating, out_of_memory

    assert out_of_memory(MemoryError()) and out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert out_of_memory(RuntimeError("CUDA error: out of memory")) and not out_of_memory(RuntimeError("bad"))
    with pytest.raises(ValueError, match="not memory"):
        with allocating("x", 1, "device"):
            raise ValueError("not memory")
    with pytest.raises(AllocationError, match="could not allocate 8 bytes of device memory for x: RuntimeError"):
        with allocating("x", 8, "device"):
            raise RuntimeError("Triton Error [CUDA]: out of memory\nmore")


# -- fork ----------------------------------------------------------------------------------------
def _child(mover, src, dst, conn):
    """In the forked child: the parent's mover refuses, a new one works."""
    out = {}
    for name, call in (("submit", lambda: mover.submit([1], [2])), ("poll", mover.poll), ("wait", mover.wait),
                       ("wait_issued", mover.wait_issued), ("descriptors", lambda: mover.descriptors([1], [2]))):
        try:
            call()
            out[name] = "no error"
        except ForkedProcessError as e:
            out[name] = "refused" if "forked from it" in str(e) else str(e)
    mover.close()
    out["closed"] = mover.closed
    rng = np.random.default_rng(9)
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = [random_ids(rng, 6, src, dst) for _ in range(4)]
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, issuing_thread=True) as mine:
        for job in jobs:
            mine.submit(*job)
        mine.wait()
        out["new mover"] = [r.ok for r in mine.poll()]
    out["bytes"] = dst.matches(expected_after(dst, before, src_before, src, jobs))
    conn.send(out)
    conn.close()


def test_a_mover_used_in_a_forked_child_refuses_and_a_mover_built_there_works():
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    rng = np.random.default_rng(8)
    src, dst = _pools("flash", 10)
    mover = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, issuing_thread=True)
    mover.wait(mover.submit(*random_ids(rng, 4, src, dst)))
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(mover, src, dst, child))
    p.start()
    got = parent.recv() if parent.poll(60) else None
    p.join(60)
    assert p.exitcode == 0 and got is not None, (p.exitcode, got)
    assert got == {"submit": "refused", "poll": "refused", "wait": "refused", "wait_issued": "refused",
                   "descriptors": "refused", "closed": True, "new mover": [True] * 4, "bytes": True}
    before, src_before = dst.snapshot(), src.snapshot()  # the parent's memory: the child wrote its own copy
    job = random_ids(rng, 5, src, dst)
    mover.wait(mover.submit(*job))  # the parent's mover is unaffected
    assert [r.ok for r in mover.poll()] == [True, True] and not mover.closed
    mover.close()
    assert dst.matches(expected_after(dst, before, src_before, src, [job]))


def test_a_child_forked_after_cuda_was_initialised_is_recognised(monkeypatch):
    """What decides that a device mover cannot be built here (tested for real on a GPU)."""
    from kvswap.mover import process

    assert process.cuda_forked() is False
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert process.cuda_forked() is True
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: 1 / 0)
    assert process.cuda_forked() is False


# -- two threads -----------------------------------------------------------------------------------
@pytest.mark.parametrize("threaded", [False, True])
def test_threads_submitting_and_polling_one_mover_get_every_job_once_and_every_byte(threaded):
    """Four threads submit into disjoint destination blocks and poll, with the interpreter
    switching threads as often as it can: distinct consecutive ids, each result reported to
    exactly one poller, buffers all back, and in every block the bytes of the last job its
    thread submitted into it."""
    src, dst = _pools("flash", 12, src_blocks=64, dst_blocks=48)
    before, src_before = dst.snapshot(), src.snapshot()
    mover = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=1, issuing_thread=threaded)
    per_thread, workers = 150, 4
    submitted: dict[int, list] = {k: [] for k in range(workers)}
    polled: dict[int, list] = {k: [] for k in range(workers)}
    errors: list = []
    start = threading.Barrier(workers)

    def work(k: int) -> None:
        rng = np.random.default_rng(100 + k)
        mine = np.arange(k, dst.num_blocks, workers)
        try:
            start.wait()
            for i in range(per_thread):
                did = rng.permutation(mine)[:int(rng.integers(1, 6))].astype(np.int64)
                sid = rng.choice(src.num_blocks, len(did), replace=False).astype(np.int64)
                submitted[k].append((mover.submit(sid, did), sid, did))
                if i % 7 == 0:
                    polled[k] += mover.poll()
        except BaseException as e:  # a failure in a thread must fail the test
            errors.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(switch)
    assert not errors, errors
    mover.wait()
    results = [r for rs in polled.values() for r in rs] + mover.poll()
    ids = sorted(job for jobs in submitted.values() for job, _, _ in jobs)
    assert ids == list(range(1, workers * per_thread + 1))
    assert sorted(r.job_id for r in results) == ids and all(r.ok for r in results)
    assert mover.pool.in_use == 0 and mover.pool.idle == mover.pool.allocated
    mover.close()
    jobs = [(sid, did) for _, sid, did in sorted(j for js in submitted.values() for j in js)]
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))


# -- interrupts and close ----------------------------------------------------------------------------
class InterruptingStream(DeferredStream):
    """A deferred stream whose ``mark`` raises KeyboardInterrupt on the calls listed."""

    def __init__(self, interrupt_marks: tuple[int, ...] = (), interrupt_waits: int = 0) -> None:
        super().__init__()
        self.interrupt_marks, self.marks, self.interrupt_waits = set(interrupt_marks), 0, interrupt_waits

    def mark(self) -> int:
        self.marks += 1
        if self.marks in self.interrupt_marks:
            raise KeyboardInterrupt
        return super().mark()

    def wait(self, marker: int) -> None:
        if self.interrupt_waits:
            self.interrupt_waits -= 1
            raise KeyboardInterrupt
        super().wait(marker)


def _deferred_mover(stream: DeferredStream, src, dst, threaded: bool = False) -> BlockMover:
    _install(stream.enqueue)
    mover = BlockMover(src.tensors, dst.tensors, "h2d", block_dim=src.layout.block_dim,
                       policy=Policy(force="test.route"), issuing_thread=threaded)
    mover._plan.completion = stream  # before the first submit starts the thread
    return mover


def test_an_interrupt_after_the_copy_was_enqueued_keeps_its_buffer_until_the_stream_passed_it():
    """The end marker of the second job is interrupted (marks: start 1, end 2, start 3,
    end 4): its copy is queued, so the job is kept and ended by the next call, reported
    failed, and its buffer stays lent until the stream has run the copy."""
    rng = np.random.default_rng(13)
    src, dst = _pools("flash", 14, src_blocks=64, dst_blocks=48)
    before, src_before = dst.snapshot(), src.snapshot()
    stream = InterruptingStream(interrupt_marks=(4,))
    mover = _deferred_mover(stream, src, dst)
    jobs = [random_ids(rng, 4, src, dst) for _ in range(4)]
    first = mover.submit(*jobs[0])
    with pytest.raises(KeyboardInterrupt):
        mover.submit(*jobs[1])
    assert mover.in_flight == 2 and mover.pool.in_use == 2 and len(stream.queue) == 2
    rest = [mover.submit(*job) for job in jobs[2:]]
    assert rest == [3, 4]  # the interrupted job kept id 2
    assert mover.poll() == [] and mover.pool.in_use == 4  # nothing ran: every buffer still lent
    stream.run(2)
    results = mover.poll()
    assert [(r.job_id, r.ok) for r in results] == [(first, True), (2, False)] and results[1].error == INTERRUPTED
    assert mover.pool.in_use == 2
    mover.close()
    results = mover.poll()
    assert [(r.job_id, r.ok) for r in results] == [(3, True), (4, True)] and mover.pool.in_use == 0
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))  # the interrupted copy ran too


@pytest.mark.parametrize("after_put", [False, True])
def test_an_interrupt_in_the_hand_off_to_the_issuing_thread_is_completed_by_the_next_call(monkeypatch, after_put):
    """Interrupted just before or just after the job reached the thread's queue: the next
    call hands it over (a second hand-off is issued once), ids stay consecutive and every
    job is reported once."""
    from kvswap.mover.issuing import IssuingThread

    rng = np.random.default_rng(15)
    src, dst = _pools("mla", 16)
    before, src_before = dst.snapshot(), src.snapshot()
    stream = DeferredStream()
    mover = _deferred_mover(stream, src, dst, threaded=True)
    real_put, calls = IssuingThread.put, []

    def put(self, job):
        calls.append(job.job_id)
        if len(calls) == 2:
            if after_put:
                real_put(self, job)
            raise KeyboardInterrupt
        real_put(self, job)

    monkeypatch.setattr(IssuingThread, "put", put)
    jobs = [random_ids(rng, 3, src, dst) for _ in range(4)]
    assert mover.submit(*jobs[0]) == 1
    with pytest.raises(KeyboardInterrupt):
        mover.submit(*jobs[1])
    assert [mover.submit(*job) for job in jobs[2:]] == [3, 4]
    assert calls == [1, 2, 2, 3, 4]  # job 2 handed over again by the next submit
    mover.wait_issued()
    assert len(stream.queue) == 4  # issued once each
    mover.close()
    results = mover.poll()
    assert [(r.job_id, r.ok) for r in results] == [(1, True), (2, True), (3, True), (4, True)]
    assert mover.pool.in_use == 0
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))


def test_close_with_jobs_in_flight_waits_and_an_interrupted_close_can_be_finished():
    rng = np.random.default_rng(17)
    src, dst = _pools("flash", 18, src_blocks=64, dst_blocks=48)
    before, src_before = dst.snapshot(), src.snapshot()
    stream = InterruptingStream(interrupt_waits=1)
    mover = _deferred_mover(stream, src, dst)
    jobs = [random_ids(rng, 5, src, dst) for _ in range(6)]
    for job in jobs:
        mover.submit(*job)
    with pytest.raises(KeyboardInterrupt):
        mover.close()
    assert mover.closed and mover.in_flight == 6 and mover.pool.in_use == 6 and stream.executed == 0
    with pytest.raises(kvswap.MoverClosedError):
        mover.submit(*jobs[0])
    mover.close()  # finishes: waits for the stream, then hands every buffer back
    assert stream.executed == 6 and mover.in_flight == 0 and mover.pool.in_use == 0
    assert [r.ok for r in mover.poll()] == [True] * 6
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))


def test_a_mover_collected_after_an_interrupted_close_waits_for_its_jobs_first():
    import gc

    rng = np.random.default_rng(19)
    src, dst = _pools("mla", 20)
    before, src_before = dst.snapshot(), src.snapshot()
    stream = InterruptingStream(interrupt_waits=1)
    mover = _deferred_mover(stream, src, dst)
    jobs = [random_ids(rng, 3, src, dst) for _ in range(3)]
    for job in jobs:
        mover.submit(*job)
    with pytest.raises(KeyboardInterrupt):
        mover.close()
    assert stream.executed == 0
    del mover
    gc.collect()
    assert stream.executed == 3  # it waited before its buffers were freed
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))


# -- a backend's own exception -----------------------------------------------------------

class Raising:
    """A backend's copy that raises what its runtime raised, having copied nothing."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __call__(self, src, dst, sizes, stream):
        raise self.error


def _install_raising(error: BaseException, alignment: int) -> None:
    class Plugin:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            if platform == "cpu":
                register(CopyImpl(name="test.route", kind="batch", platforms=("cpu",),
                                  directions=(Direction.H2D, Direction.D2H), factory=lambda ctx: Raising(error),
                                  alignment=alignment))

    reset_plugin_host(create_plugin_host(entry_points=[], env={}, extra=[("testplugin", Plugin())]))


@pytest.mark.parametrize("alignment", [1, 8], ids=["whole-batch", "checked-per-call"])
@pytest.mark.parametrize("error, kind, says", [
    (RuntimeError("DMA queue full"), kvswap.BackendError, "test.route failed: RuntimeError: DMA queue full"),
    (MemoryError("no pages left"), AllocationError,
     "could not allocate host memory for a copy by test.route: MemoryError: no pages left"),
    (torch.OutOfMemoryError("CUDA out of memory"), AllocationError,
     "could not allocate device memory for a copy by test.route: OutOfMemoryError: CUDA out of memory"),
], ids=["runtime", "host-memory", "device-memory"])
def test_a_backends_own_exception_names_the_implementation_and_is_chained(error, kind, says, alignment):
    """Whichever path a SwapFn takes to the copy, the caller gets a kvswap error that names
    the implementation, with the backend's exception as its cause; and the same on a
    BlockMover's thread, in the job's result."""
    _install_raising(error, alignment)
    fn = kvswap.resolve("h2d", device="cpu", policy=Policy(force="test.route"))
    src = np.random.default_rng(0).integers(0, 256, 8192, dtype=np.uint8)
    dst = np.zeros_like(src)
    with pytest.raises(kind) as caught:
        fn([src.ctypes.data, src.ctypes.data + 4096], [dst.ctypes.data, dst.ctypes.data + 4096], [4096, 4096])
    assert str(caught.value) == says and caught.value.__cause__ is error
    src_pool, dst_pool = _pools("flash", 3)
    with BlockMover(src_pool.tensors, dst_pool.tensors, "h2d", block_dim=src_pool.layout.block_dim,
                    policy=Policy(force="test.route"), issuing_thread=True) as mover:
        job = mover.submit([1, 2], [3, 4])
        mover.wait(job)
        (result,) = mover.poll()
    assert not result.ok and result.error == f"{kind.__name__}: {says}"


def test_kvswaps_own_error_from_a_backend_goes_through_as_it_is():
    error = kvswap.DriverError("acme.batch_copy", 7, "ACME_ERROR_BUSY", "queue full")
    _install_raising(error, 1)
    fn = kvswap.resolve("h2d", device="cpu", policy=Policy(force="test.route"))
    buf = np.zeros(8192, dtype=np.uint8)
    with pytest.raises(kvswap.DriverError) as caught:
        fn([buf.ctypes.data], [buf.ctypes.data + 4096], [4096])
    assert caught.value is error
