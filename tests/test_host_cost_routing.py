"""The thread-time rule: a route whose call holds the engine's thread longer than the whole
transfer takes on another route is never picked (hand-built calibrations, on the CPU)."""
from __future__ import annotations

import numpy as np
import pytest

import kvswap
from kvswap import Calibration, InvalidImplError
from kvswap.registry.plugins import create_plugin_host
from kvswap.resolution.routing import HOST_COST_AT, thread_bound

from fakes import address
from test_resolver import LOG, Offer, cpu_cal, host_batch, recording_impl

KiB = 1024
# The batch route is faster at 4 KiB and at 256 KiB by bandwidth alone.
DMA = [(4 * KiB, 50.0), (256 * KiB, 50.0)]
KERN = [(4 * KiB, 45.0), (256 * KiB, 48.0)]


def resolve_with(host_cost=None, policy=None, **kw):
    impls = [recording_impl("acme.dma"), recording_impl("acme.kern", kind="kernel")]
    cal = cpu_cal([("acme.dma", DMA, None), ("acme.kern", KERN, 8)], host_cost=host_cost or {}, **kw)
    host = create_plugin_host(entry_points=[], env={}, extra=[("p", Offer(impls, cal))])
    return kvswap.resolve("h2d", device="cpu", host=host, block_bytes=[4 * KiB, 256 * KiB], policy=policy)


def route_at(fn, size):
    return next(r for r in fn.plan.routes if r.min_bytes <= size and (r.max_bytes is None or size <= r.max_bytes))


def test_a_route_that_holds_the_thread_longer_than_another_routes_transfer_is_excluded():
    # 1 us per descriptor on the batch route: at 4 KiB the kernel moves a descriptor in
    # 4096 / 45e3 = 0.091 us, so 2,048 descriptors hold the thread 2,068 us against 186 us.
    fn = resolve_with({"h2d": [("acme.dma", 20.0, 1.0), ("acme.kern", 30.0, 0.01)]})
    small, large = route_at(fn, 4 * KiB), route_at(fn, 256 * KiB)
    assert small.impl == "acme.kern"
    name, host, other_us, other = small.excluded[0]
    assert (name, other) == ("acme.dma", "acme.kern")
    assert host == pytest.approx(20.0 + HOST_COST_AT)
    assert other_us == pytest.approx(HOST_COST_AT * 4 * KiB / 45e3, rel=1e-3)
    # At 256 KiB the kernel needs 5.5 us a descriptor: the batch route's 1 us is less.
    assert large.impl == "acme.dma" and large.excluded == ()
    text = fn.explain()
    assert "acme.dma excluded: holds the thread 2.07 ms > 186 µs for the whole transfer on acme.kern" in text
    assert f"holds the calling thread for {HOST_COST_AT} descriptors: acme.kern ~50 µs, acme.dma ~2.07 ms" in text
    assert "host thread time per call: unmeasured" not in text


def test_an_excluded_route_keeps_only_the_small_batches_it_was_measured_to_win():
    fn = resolve_with({"h2d": [("acme.dma", 20.0, 1.0)]}, kernel_min_batch={"h2d": 16})
    r = route_at(fn, 4 * KiB)
    assert (r.impl, r.small_batch_impl, r.min_batch) == ("acme.kern", "acme.dma", 16)
    rng = np.random.default_rng(3)
    for n, want in ((4, "acme.dma"), (3000, "acme.kern")):
        sizes = np.full(n, 4 * KiB, dtype=np.int64)
        src, dst, so, do = host_batch(rng, sizes)
        LOG.clear()
        fn(address(src) + so, address(dst) + do, sizes)
        assert LOG == [(want, n)]
        assert all(np.array_equal(dst[d:d + 4 * KiB], src[s:s + 4 * KiB]) for s, d in zip(so, do))


def test_tiers_of_the_excluded_route_stop_at_the_count_the_rule_holds_from():
    tiers = {"h2d": [(4 * KiB, [(1, 8), (512, 0)])]}
    fn = resolve_with({"h2d": [("acme.dma", 20.0, 1.0)]}, kernel_min_batch={"h2d": 4}, kernel_sms_by_batch=tiers)
    r = route_at(fn, 4 * KiB)
    assert r.impl == "acme.kern"
    assert r.runs(100)[0] == "acme.kern" and r.runs(1000)[0] == "acme.dma"
    assert r.runs(HOST_COST_AT)[0] == "acme.kern" and r.runs(50_000)[0] == "acme.kern"


def test_a_large_intercept_with_a_small_slope_is_not_excluded():
    # 5 ms a call, but 0.01 us a descriptor: the kernel's 0.091 us overtakes it at large
    # batches, so the rule does not hold for every batch from HOST_COST_AT on.
    fn = resolve_with({"h2d": [("acme.dma", 5000.0, 0.01)]})
    assert route_at(fn, 4 * KiB).impl == "acme.dma" and route_at(fn, 4 * KiB).excluded == ()


def test_without_host_cost_nothing_is_excluded_and_explain_says_unmeasured():
    fn = resolve_with()
    assert route_at(fn, 4 * KiB).impl == "acme.dma"
    assert all(r.excluded == () for r in fn.plan.routes)
    assert "host thread time per call: unmeasured, so no route is excluded by it" in fn.explain()


def test_a_route_without_a_host_cost_is_never_excluded_and_is_shown_unmeasured():
    fn = resolve_with({"h2d": [("acme.kern", 30.0, 0.01)]})
    r = route_at(fn, 4 * KiB)
    assert r.impl == "acme.dma" and r.excluded == ()
    assert r.held_us("acme.dma", 100) is None and r.held_us("acme.kern", 100) == pytest.approx(31.0)
    assert ("acme.kern", 30.0, 0.01) in r.host_cost
    assert "acme.kern ~50 µs, acme.dma unmeasured" in fn.explain()


def test_host_cost_of_another_direction_does_not_count():
    fn = resolve_with({"d2h": [("acme.dma", 20.0, 1.0)]})
    assert route_at(fn, 4 * KiB).impl == "acme.dma"


def test_where_every_route_would_be_excluded_the_one_holding_the_thread_least_is_kept():
    impls = [recording_impl("acme.dma"), recording_impl("acme.kern", kind="kernel")]
    cal = cpu_cal([("acme.dma", DMA, None), ("acme.kern", KERN, 8)])
    ranked = [(impls[0], 50.0), (impls[1], 45.0)]
    both = Calibration("t", "cpu", curves=cal.curves, host_cost={"h2d": [("acme.dma", 0.0, 3.0), ("acme.kern", 0.0, 2.0)]})
    out = thread_bound(ranked, both, kvswap.Direction.H2D, 4 * KiB)
    assert list(out) == ["acme.dma"] and out["acme.dma"][2] == "acme.kern"


def test_forced_routes_ignore_the_rule():
    fn = resolve_with({"h2d": [("acme.dma", 20.0, 1.0)]}, policy=kvswap.Policy(force="acme.dma"))
    assert [r.impl for r in fn.plan.routes] == ["acme.dma"]


@pytest.mark.parametrize("rows", [
    [("acme.dma", -1.0, 1.0)], [("acme.dma", 1.0, float("nan"))], [("acme.dma", 1.0, float("inf"))],
    [("acme.dma", 1.0)], [("", 1.0, 1.0)], [("acme.dma", 1.0, 1.0), ("acme.dma", 2.0, 1.0)], [("acme.dma", True, 1.0)],
])
def test_calibration_rejects_bad_host_cost_rows(rows):
    with pytest.raises(InvalidImplError, match="host_cost"):
        Calibration("t", "cpu", host_cost={"h2d": rows})


def test_host_us_reads_the_impl_then_its_kind():
    c = Calibration("t", "cpu", host_cost={"h2d": [("batch", 10.0, 0.5), ("x.kernel", 40.0, 0.01)]})
    assert c.host_us("x.batch", "batch", "h2d", 100) == pytest.approx(60.0)
    assert c.host_us("x.kernel", "kernel", "h2d", 100) == pytest.approx(41.0)
    assert c.host_us("y.kernel", "kernel", "h2d", 100) is None
    assert c.host_us("x.batch", "batch", "d2h", 100) is None
