"""The issuer (backends/cuda/issuer.py) without a GPU: ordering on the caller's stream,
sequence numbers, errors that never leave a stream waiting, and shutdown.

``StandInStreams`` (tests/issuer_standin.py) plays libcuda with streams that run only
when the test steps them, so "work queued on the caller's stream after the call" is a
real queued operation that must see the copied bytes.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from kvswap import Direction, DriverError
from kvswap.backends.cuda import batch, driver, issuer
from kvswap.errors import ConfigurationError

from cuda_standin import HostPools, fresh_driver  # noqa: F401 (fixture)
from issuer_standin import StandInStreams


@pytest.fixture(autouse=True)
def issuer_on(monkeypatch):
    """The issuer thread is opt-in (KVSWAP_CUDA_ISSUER); these tests turn it on."""
    monkeypatch.setenv("KVSWAP_CUDA_ISSUER", "on")


CALLER, OTHER = 0x777000, 0x888000  # caller streams (any non-legacy handle)


def make(direction=Direction.H2D, threshold=4, per_copy=4, **kw):
    lib = StandInStreams(**kw)
    drv = driver.Driver(lib, "stand-in libcuda")
    inner = batch.bind(drv, direction, 0)
    iss = issuer.Issuer(issuer.StreamOps(drv), inner._context, name="test")
    fn = issuer.IssuedCopy(inner, lambda: iss, {"batch": threshold, "per-copy": per_copy})
    return lib, iss, fn


def pools(seed, n=24, size_max=700):
    rng = np.random.default_rng(seed)
    return rng, HostPools(rng, rng.integers(1, size_max, n))


@pytest.fixture
def cleanup():
    made = []
    yield made
    for iss in made:
        iss.close()


def snapshot_of(p):
    box = {}
    return box, lambda: box.__setitem__("dst", p.dst_pool.copy())


# ---------------------------------------------------------------------------------------
# Small pieces
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, want", [("on", issuer.ASYNC_MIN["batch"]), ("", None), ("off", None), ("0", None),
                                       (" 512 ", 512), ("OFF", None)])
def test_threshold_from_environment(env, want):
    assert issuer.async_min("batch", env) == want


@pytest.mark.parametrize("env", ["-3", "many", "1.5"])
def test_bad_threshold_names_the_variable(env):
    with pytest.raises(ConfigurationError, match=issuer.ENV):
        issuer.async_min("batch", env)


@pytest.mark.parametrize("flag, seq, reached", [
    (5, 5, True), (6, 5, True), (4, 5, False), (0, 0xFFFFFFFF, True),  # wrapped past
    (0xFFFFFFFF, 0, False), (0x7FFFFFFF, 0, True), (0x80000000, 0, False),
])
def test_sequence_numbers_compare_like_the_stream_wait(flag, seq, reached):
    assert issuer.seq_reached(flag, seq) is reached


# ---------------------------------------------------------------------------------------
# Ordering
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
def test_copy_runs_after_prior_work_and_before_later_work(direction, cleanup):
    gate = threading.Event()
    lib, iss, fn = make(direction, gate=gate)
    cleanup.append(iss)
    rng, p = pools(1)
    # Prior work on the caller's stream rewrites the sources: the copy must read the new bytes.
    fresh = rng.integers(0, 256, p.src_pool.size, dtype=np.uint8)
    lib.later(CALLER, lambda: np.copyto(p.src_pool, fresh))
    fn(p.src, p.dst, p.sizes, CALLER)
    # The caller's thread is back while the issuer thread is still inside the driver call.
    assert fn.last_issued == "issuer" and not fn.last_ticket.done.is_set()
    box, snap = snapshot_of(p)
    lib.later(CALLER, snap)  # work the caller enqueues after the call
    lib.step()
    assert lib.pending()[CALLER] == ["wait_value", "host"]  # held at the flag
    gate.set()
    lib.run()
    p.check()
    np.testing.assert_array_equal(box["dst"], p.expected())
    (call,) = lib.of("cuMemcpyBatchAsync")
    assert call[1]["thread"] == "kvswap-issuer-test" and call[1]["stream"] == iss.stream
    assert call[1]["count"] == len(p.sizes)
    assert lib.of("cuStreamWaitValue32") == [("cuStreamWaitValue32", CALLER, 1, issuer.CU_STREAM_WAIT_VALUE_GEQ)]
    assert iss.flag.value == 1


def test_jobs_keep_order_across_streams_and_sequence_numbers_grow(cleanup):
    gate = threading.Event()
    lib, iss, fn = make(gate=gate)
    cleanup.append(iss)
    jobs = [pools(10 + k) for k in range(5)]
    boxes = []
    for k, (_, p) in enumerate(jobs):
        stream = CALLER if k % 2 else OTHER
        fn(p.src, p.dst, p.sizes, stream)
        box, snap = snapshot_of(p)
        lib.later(stream, snap)
        boxes.append(box)
    assert [c[2] for c in lib.of("cuStreamWaitValue32")] == [1, 2, 3, 4, 5]
    gate.set()
    lib.run()
    for (_, p), box in zip(jobs, boxes):
        p.check()
        np.testing.assert_array_equal(box["dst"], p.expected())
    assert iss.flag.value == 5 and iss.issued == iss.queued == 5


def test_same_destination_twice_ends_with_the_later_job(cleanup):
    gate = threading.Event()
    lib, iss, fn = make(gate=gate)
    cleanup.append(iss)
    rng, p = pools(3)
    first = rng.integers(0, 256, p.src_pool.size, dtype=np.uint8)
    second = p.src_pool.copy()
    np.copyto(p.src_pool, first)
    fn(p.src, p.dst, p.sizes, CALLER)  # reads ``first``... once the stream gets there
    lib.later(CALLER, lambda: np.copyto(p.src_pool, second))
    fn(p.src, p.dst, p.sizes, CALLER)  # ...and this one ``second``, after it
    gate.set()  # (the gate would hold the caller's own driver call below too)
    small = slice(0, 2)  # a batch under the threshold: copied on the caller's thread, in order
    fn(p.src[small], p.dst[small], p.sizes[small], CALLER)
    assert fn.last_issued == "caller"
    lib.run()
    p.check()  # expected() is built from the final source bytes: ``second``


def test_small_batches_stay_on_the_callers_thread(cleanup):
    lib, iss, fn = make(threshold=100)
    cleanup.append(iss)
    _, p = pools(4, n=10)
    fn(p.src, p.dst, p.sizes, CALLER)
    assert fn.last_issued == "caller" and not lib.of("cuStreamWaitValue32")
    (call,) = lib.of("cuMemcpyBatchAsync")
    assert call[1]["thread"] == threading.current_thread().name and call[1]["stream"] == CALLER
    lib.run()
    p.check()


def test_caller_may_reuse_its_arrays_at_once(cleanup):
    gate = threading.Event()
    lib, iss, fn = make(gate=gate)
    cleanup.append(iss)
    rng, p = pools(5)
    src, dst, sizes = p.src.copy(), p.dst.copy(), p.sizes.copy()
    fn(src, dst, sizes, CALLER)
    src[:], dst[:], sizes[:] = 1, 2, 3  # garbage: must not reach the driver
    gate.set()
    lib.run()
    p.check()


def test_legacy_stream_goes_per_copy_off_the_thread_too(cleanup):
    gate = threading.Event()
    lib, iss, fn = make(per_copy=4, gate=gate)
    cleanup.append(iss)
    _, p = pools(6, n=12)
    fn(p.src, p.dst, p.sizes, 0)
    assert fn.last_issued == "issuer" and fn.last_path == batch.PER_COPY
    box, snap = snapshot_of(p)
    lib.later(0, snap)
    gate.set()
    lib.run()
    p.check()
    np.testing.assert_array_equal(box["dst"], p.expected())
    assert {c[4] for c in lib.of("cuMemcpyAsync")} == {iss.stream}


def test_issuer_thread_makes_the_context_current(cleanup):
    lib, iss, fn = make()
    cleanup.append(iss)
    _, p = pools(7)
    fn(p.src, p.dst, p.sizes, CALLER)
    assert iss.drain(5)
    (call,) = lib.of("cuMemcpyBatchAsync")
    assert call[1]["context"] == StandInStreams.PRIMARY
    lib.run()
    p.check()


# ---------------------------------------------------------------------------------------
# Errors never leave a stream waiting
# ---------------------------------------------------------------------------------------

def test_failed_batch_releases_the_flag_and_raises_on_the_next_call(cleanup):
    lib, iss, fn = make(fail_at=3, version=12080)
    cleanup.append(iss)
    _, p = pools(8)
    fn(p.src, p.dst, p.sizes, CALLER)  # fails on the issuer thread, not here
    ran = []
    lib.later(CALLER, lambda: ran.append(True))
    assert iss.drain(5)
    lib.run()  # no deadlock: the flag was written after the failed call
    assert ran == [True] and iss.flag.value == 1
    np.testing.assert_array_equal(p.dst_pool, p.before)  # nothing copied
    with pytest.raises(issuer.DeferredDriverError) as info:
        fn(p.src, p.dst, p.sizes, CALLER)
    err = info.value
    assert isinstance(err, DriverError) and err.ticket.seq == 1 and err.index == 3
    assert "earlier batch (issuer job 1)" in str(err) and "this call copied nothing" in str(err)
    assert len(lib.of("cuMemcpyBatchAsync")) == 1  # the raising call enqueued nothing
    lib.fail_at = None
    fn(p.src, p.dst, p.sizes, CALLER)  # the next transfer works
    lib.run()
    p.check()


def test_unwritable_flag_is_released_from_the_host(cleanup):
    lib, iss, fn = make(fail_calls={"cuStreamWriteValue32"})
    cleanup.append(iss)
    _, p = pools(9)
    fn(p.src, p.dst, p.sizes, CALLER)
    assert iss.drain(5)
    assert iss.flag.value == 1 and "cuStreamSynchronize" in lib.threads  # waited for its stream first
    lib.run()
    p.check()  # the copy itself was issued
    with pytest.raises(issuer.DeferredDriverError, match="cuStreamWriteValue32"):
        fn(p.src, p.dst, p.sizes, CALLER)


def test_unordered_job_is_not_copied(cleanup):
    lib, iss, fn = make(fail_calls={"cuStreamWaitEvent"})
    cleanup.append(iss)
    _, p = pools(10)
    fn(p.src, p.dst, p.sizes, CALLER)
    assert iss.drain(5)
    lib.run()
    assert not lib.of("cuMemcpyBatchAsync")
    np.testing.assert_array_equal(p.dst_pool, p.before)
    with pytest.raises(issuer.DeferredDriverError, match="cuStreamWaitEvent"):
        fn(p.src, p.dst, p.sizes, CALLER)


def test_stream_that_refuses_the_wait_raises_at_once_and_queues_nothing(cleanup):
    lib, iss, fn = make(fail_calls={"cuStreamWaitValue32"})
    cleanup.append(iss)
    _, p = pools(11)
    with pytest.raises(DriverError, match="cuStreamWaitValue32"):
        fn(p.src, p.dst, p.sizes, CALLER)
    assert iss.queued == 0 and iss.seq == 0
    lib.run()
    assert not lib.of("cuMemcpyBatchAsync")


# ---------------------------------------------------------------------------------------
# Shutdown
# ---------------------------------------------------------------------------------------

def test_close_issues_queued_jobs_then_callers_copy_themselves():
    gate = threading.Event()
    lib, iss, fn = make(gate=gate)
    jobs = [pools(20 + k)[1] for k in range(3)]
    for p in jobs:
        fn(p.src, p.dst, p.sizes, CALLER)
    threading.Timer(0.05, gate.set).start()
    iss.close()
    assert iss.closed and iss.issued == 3 and not iss._thread.is_alive()
    _, q = pools(30)
    fn(q.src, q.dst, q.sizes, CALLER)
    assert fn.last_issued == "caller"
    lib.run()
    for p in (*jobs, q):
        p.check()


def test_process_exit_issues_queued_jobs_and_stops_the_thread(tmp_path):
    code = textwrap.dedent("""
        import sys, threading
        import numpy as np
        sys.path.insert(0, {tests!r})
        from kvswap import Direction
        from kvswap.backends.cuda import batch, driver, issuer
        from cuda_standin import HostPools
        from issuer_standin import StandInStreams

        gate = threading.Event()
        lib = StandInStreams(gate=gate)
        drv = driver.Driver(lib, "stand-in")
        inner = batch.bind(drv, Direction.H2D, 0)
        iss = issuer.Issuer(issuer.StreamOps(drv), inner._context, name="exit")
        fn = issuer.IssuedCopy(inner, lambda: iss, {{"batch": 2, "per-copy": 2}})
        rng = np.random.default_rng(0)
        p = HostPools(rng, rng.integers(1, 300, 16))
        fn(p.src, p.dst, p.sizes, 0x777000)
        threading.Timer(0.05, gate.set).start()
        import atexit
        @atexit.register  # runs before the issuer's own handler (last registered, first run)
        def report():
            pass
        def after():
            print("issued", iss.issued, "alive", iss._thread.is_alive(), flush=True)
        issuer_shutdown = issuer.shutdown
        def shutdown_then_report():
            issuer_shutdown()
            after()
        atexit.unregister(issuer.shutdown)
        atexit.register(shutdown_then_report)
    """).format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["issued", "1", "alive", "False"]


def test_issued_wraps_the_bound_copy_unless_switched_off(monkeypatch):
    lib = StandInStreams()
    drv = driver.Driver(lib, "stand-in libcuda")
    inner = batch.bind(drv, Direction.H2D, 0)
    monkeypatch.setenv(issuer.ENV, "off")
    assert issuer.issued(inner, drv) is inner
    monkeypatch.setenv(issuer.ENV, "256")
    fn = issuer.issued(inner, drv)
    assert isinstance(fn, issuer.IssuedCopy) and fn.threshold == {"batch": 256, "per-copy": 256}
    assert "per-device thread" in fn.note and fn.note.startswith(inner.note)
    assert fn.direction is Direction.H2D and fn.abi == inner.abi  # the bound copy's attributes


def test_a_collected_failure_is_reported_once_not_raised_again(cleanup):
    from kvswap.registry import deferred

    lib, iss, fn = make(fail_at=2, version=12080)
    cleanup.append(iss)
    _, p = pools(12)
    with deferred.collect() as items:
        fn(p.src, p.dst, p.sizes, CALLER)
    assert items == [fn.last_ticket]
    assert iss.drain(5)
    lib.run()
    err = deferred.failure(items)
    assert isinstance(err, DriverError) and err.index == 2 and items[0].reported
    lib.fail_at = None
    fn(p.src, p.dst, p.sizes, CALLER)  # the job owner reported it: the next call copies
    lib.run()
    p.check()
    assert deferred.failure([fn.last_ticket]) is None


def test_arrays_promised_stable_are_kept_not_copied(cleanup):
    from kvswap.registry import deferred

    gate = threading.Event()
    lib, iss, fn = make(gate=gate)
    cleanup.append(iss)
    _, p = pools(13)
    src, dst, sizes = p.src.copy(), p.dst.copy(), p.sizes.copy()
    with deferred.collect(stable=True):
        fn(src, dst, sizes, CALLER)
    assert deferred.arrays_stable() is False  # outside the block again
    sizes[:] = 1  # the promise broken on purpose: the driver call reads the caller's arrays
    gate.set()
    lib.run()
    want = p.before.copy()
    want[p.dst_off] = p.src_pool[p.src_off]  # one byte a block: the arrays were kept, not copied
    np.testing.assert_array_equal(p.dst_pool, want)
