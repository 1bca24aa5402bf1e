"""resolve() and SwapFn on the CPU: real copies through the host reference, and ranking,
forcing and routing decided through throwaway plugins."""
from __future__ import annotations

import numpy as np
import pytest

import kvswap
from kvswap import (
    Calibration, ConfigurationError, CopyImpl, Curve, InvalidTransferError, Policy,
    ResolutionError,
)
from kvswap.registry.plugins import create_plugin_host
from kvswap.resolution.routing import KERNEL_MARGIN
from kvswap.registry.reference import host_copy

from fakes import Offer, address, scattered

POISON = 0xA5


def host_batch(rng, sizes, pool=1 << 22, slot=None):
    """Random source pool, poisoned destination pool, scattered non-overlapping blocks."""
    slot = slot or int(max(sizes.max(initial=1), 1))
    pool = max(pool, 2 * slot * len(sizes))
    src = rng.integers(0, 256, pool, dtype=np.uint8)
    dst = np.full(pool, POISON, dtype=np.uint8)
    so = scattered(rng, pool, sizes, slot)
    do = scattered(rng, pool, sizes, slot)
    return src, dst, so, do


def expected(src, dst_before, so, do, sizes):
    out = dst_before.copy()
    for s, d, n in zip(so, do, sizes):
        out[d:d + n] = src[s:s + n]
    return out


@pytest.mark.parametrize("n", [0, 1, 17, 3000])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_resolve_on_cpu_copies_every_byte_and_nothing_else(n, direction):
    rng = np.random.default_rng(n)
    sizes = rng.integers(1, 9000, n).astype(np.int64)
    src, dst, so, do = host_batch(rng, sizes, slot=9000)
    want = expected(src, dst, so, do, sizes)
    fn = kvswap.resolve(direction)
    assert fn.plan.device.platform == "cpu"
    assert [r.impl for r in fn.plan.routes] == ["host.reference"]
    fn(address(src) + so, address(dst) + do, sizes)
    assert np.array_equal(dst, want)  # every copied byte, and every byte outside stays poison


def test_swapfn_takes_torch_tensors_and_lists():
    import torch

    rng = np.random.default_rng(1)
    sizes = np.array([64, 128, 8], dtype=np.int64)
    src, dst, so, do = host_batch(rng, sizes, pool=1 << 14, slot=256)
    want = expected(src, dst, so, do, sizes)
    fn = kvswap.resolve("h2d", device="cpu")
    fn(torch.from_numpy(address(src) + so), list(address(dst) + do), torch.tensor(sizes, dtype=torch.int32))
    assert np.array_equal(dst, want)


@pytest.mark.parametrize(
    "src, dst, sizes, match",
    [
        ([1, 2], [1], [1, 1], "equal length"),
        ([1], [2], [0], "sizes\\[0\\]=0"),
        ([0], [2], [1], "src_ptrs\\[0\\]=0 is not a valid address"),
        ([1.5], [2], [1], "must hold integers"),
        ([[1]], [[2]], [[1]], "must be 1-D"),
    ],
)
def test_swapfn_rejects_bad_batches(src, dst, sizes, match):
    fn = kvswap.resolve("h2d", device="cpu")
    with pytest.raises(InvalidTransferError, match=match):
        fn(src, dst, sizes)


def test_overlapping_destinations_are_refused_before_any_byte_moves():
    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, 4096, dtype=np.uint8)
    dst = np.full(4096, POISON, dtype=np.uint8)
    fn = kvswap.resolve("h2d", device="cpu")
    with pytest.raises(InvalidTransferError, match="overlap"):
        fn([address(src), address(src) + 512], [address(dst) + 1024, address(dst)], [256, 1100])
    assert (dst == POISON).all()


def test_explain_tells_the_whole_decision():
    text = kvswap.resolve("d2h", device="cpu", block_bytes=[8192, 16384]).explain()
    for part in ("d2h", "cpu", "host.reference", "calibration:", "routes by block size", "not calibrated"):
        assert part in text
    plan = kvswap.resolve("d2h", device="cpu").plan.to_dict()
    assert plan["direction"] == "d2h" and plan["routes"][0]["impl"] == "host.reference"


@pytest.mark.parametrize("bad", [dict(direction="up"), dict(block_bytes=0), dict(block_bytes=[1, -2]),
                                 dict(device="not a device!"), dict(policy="fast")])
def test_bad_resolve_arguments_raise_configuration_errors(bad):
    args = dict(direction="h2d") | bad
    with pytest.raises(ConfigurationError):
        kvswap.resolve(args.pop("direction"), **args)


# ---- ranking, forcing and routing, decided through throwaway plugins ----------------

LOG: list[tuple[str, int]] = []


def recording_impl(name, kind="batch", alignment=1, max_block_bytes=None, mixed_sizes=True, platform="cpu"):
    def factory(ctx):
        def fn(src, dst, sizes, stream):
            LOG.append((name, len(sizes)))
            host_copy(src, dst, sizes)
        fn.note = f"{name} bound with {dict(ctx.params)}"
        return fn

    return CopyImpl(name, kind, (platform,), ("h2d", "d2h"), factory, alignment=alignment,
                    max_block_bytes=max_block_bytes, mixed_sizes=mixed_sizes)


def cpu_cal(points, **kw):
    curves = tuple(Curve(name, d, pts, num_sms=sms) for name, pts, sms in points for d in ("h2d", "d2h"))
    return Calibration(source="test calibration", platform="cpu", scope="device", curves=curves, **kw)


DMA = [(4096, 5.0), (32768, 40.0), (262144, 50.0)]
KERNEL = [(4096, 45.0), (32768, 48.0), (262144, 48.0)]


def two_route_host(order, **cal):
    """Each route from its own plugin, each plugin describing only its own route (the
    first plugin's thresholds decide)."""
    impls = {"acme.dma": recording_impl("acme.dma"), "acme.kern": recording_impl("acme.kern", kind="kernel")}
    points = {"acme.dma": ("acme.dma", DMA, None), "acme.kern": ("acme.kern", KERNEL, 8)}
    plugins = [(f"p{i}", Offer([impls[n]], cpu_cal([points[n]], **cal))) for i, n in enumerate(order)]
    return create_plugin_host(entry_points=[], env={}, extra=plugins)


@pytest.mark.parametrize("order", [("acme.dma", "acme.kern"), ("acme.kern", "acme.dma")])
def test_ranking_follows_predicted_bandwidth_not_registration_order(order):
    fn = kvswap.resolve("h2d", device="cpu", host=two_route_host(order), block_bytes=[4096, 262144])
    by_size = {r.at_bytes: r.impl for r in fn.plan.routes}
    assert by_size[4096] == "acme.kern"  # 45 GB/s beats 5
    assert by_size[262144] == "acme.dma"  # 50 beats 48, and the DMA takes no SMs
    assert fn.plan.params["acme.kern"] == {"num_sms": 8}


@pytest.mark.parametrize("kernel_gbps, route", [
    (50.0 * (1 + KERNEL_MARGIN) - 0.1, "acme.dma"),  # faster, but within the margin: no SMs taken
    (50.0 * (1 + KERNEL_MARGIN) + 0.1, "acme.kern"),  # beyond it
])
def test_a_kernel_takes_a_block_size_from_a_route_without_sms_only_beyond_the_margin(kernel_gbps, route):
    impls = [recording_impl("acme.dma"), recording_impl("acme.kern", kind="kernel")]
    cal = cpu_cal([("acme.dma", [(4096, 5.0), (262144, 50.0)], None), ("acme.kern", [(4096, 45.0), (262144, kernel_gbps)], 8)])
    host = create_plugin_host(entry_points=[], env={}, extra=[("p", Offer(impls, cal))])
    fn = kvswap.resolve("h2d", device="cpu", host=host, block_bytes=[4096, 262144])
    def route_of(b):
        return next(r for r in fn.plan.routes if r.min_bytes <= b and (r.max_bytes is None or b <= r.max_bytes))

    assert (route_of(4096).impl, route_of(262144).impl) == ("acme.kern", route)
    if route == "acme.dma":  # explain() shows the prediction itself, not the discounted rank
        assert dict(route_of(262144).predicted)["acme.kern"] == pytest.approx(kernel_gbps, abs=0.01)


def test_routes_split_mixed_sizes_and_small_batches_by_route():
    LOG.clear()
    fn = kvswap.resolve("h2d", device="cpu", host=two_route_host(("acme.dma", "acme.kern")),
                        block_bytes=[4096, 262144])
    rng = np.random.default_rng(3)
    sizes = np.array([4096] * 20 + [262144] * 3, dtype=np.int64)
    rng.shuffle(sizes)
    src, dst, so, do = host_batch(rng, sizes, pool=1 << 24, slot=262144)
    want = expected(src, dst, so, do, sizes)
    fn(address(src) + so, address(dst) + do, sizes)
    assert np.array_equal(dst, want)
    assert sorted(LOG) == [("acme.dma", 3), ("acme.kern", 20)]
    LOG.clear()
    fn(address(src) + so[:5], address(dst) + do[:5], np.full(5, 4096))  # under the min batch of 16
    assert LOG == [("acme.dma", 5)]


def test_low_interference_discounts_routes_that_slow_compute():
    host = two_route_host(("acme.dma", "acme.kern"), slowdown={"kernel": 0.95, "batch": 0.0})
    fast = kvswap.resolve("h2d", device="cpu", host=host, block_bytes=4096)
    calm = kvswap.resolve("h2d", device="cpu", host=host, block_bytes=4096,
                          policy=Policy(prefer="low_interference"))
    route = lambda fn: next(r.impl for r in fn.plan.routes if r.at_bytes == 4096)
    assert route(fast) == "acme.kern" and route(calm) == "acme.dma"


def test_max_sms_caps_kernels_and_zero_rejects_them():
    host = two_route_host(("acme.dma", "acme.kern"), kernel_sms={"h2d": 16})
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(max_sms=1))
    assert fn.plan.params["acme.kern"] == {"num_sms": 1}
    none = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(max_sms=0))
    kern = next(c for c in none.plan.candidates if c.name == "acme.kern")
    assert not kern.available and "max_sms=0" in kern.reason
    assert {r.impl for r in none.plan.routes} == {"acme.dma"}


def test_misaligned_descriptors_go_to_a_route_that_accepts_them():
    LOG.clear()
    impls = [recording_impl("acme.wide", alignment=8), recording_impl("acme.bytes")]
    cal = cpu_cal([("acme.wide", [(1, 90.0)], None), ("acme.bytes", [(1, 1.0)], None)])
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer(impls, cal))])
    fn = kvswap.resolve("d2h", device="cpu", host=host)
    assert "descriptors acme.wide refuses -> acme.bytes" in fn.explain()
    rng = np.random.default_rng(4)
    sizes = np.array([64, 13, 128, 7], dtype=np.int64)
    src, dst, so, do = host_batch(rng, sizes, pool=1 << 16, slot=256)
    so, do = so - so % 8, do - do % 8
    want = expected(src, dst, so, do, sizes)
    fn(address(src) + so, address(dst) + do, sizes)
    assert np.array_equal(dst, want)
    assert sorted(LOG) == [("acme.bytes", 2), ("acme.wide", 2)]


def test_a_descriptor_no_route_accepts_is_refused_before_any_byte_moves():
    LOG.clear()
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer([recording_impl("acme.wide", alignment=8)]))])
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="acme.wide"))
    src = np.random.default_rng(5).integers(0, 256, 64, dtype=np.uint8)
    dst = np.full(64, POISON, dtype=np.uint8)
    with pytest.raises(InvalidTransferError, match="descriptor 1 .*multiples of 8"):
        fn([address(src), address(src) + 16], [address(dst), address(dst) + 32], [8, 12])
    assert (dst == POISON).all() and LOG == []


def test_unmixed_impl_gets_one_call_per_size():
    LOG.clear()
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer([recording_impl("acme.one", mixed_sizes=False)]))])
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="acme.one"))
    rng = np.random.default_rng(6)
    sizes = np.array([16, 32, 16, 32, 48], dtype=np.int64)
    src, dst, so, do = host_batch(rng, sizes, pool=1 << 14, slot=64)
    want = expected(src, dst, so, do, sizes)
    fn(address(src) + so, address(dst) + do, sizes)
    assert np.array_equal(dst, want) and sorted(LOG) == [("acme.one", 1), ("acme.one", 2), ("acme.one", 2)]


def test_force_through_policy_and_environment(monkeypatch):
    host = two_route_host(("acme.dma", "acme.kern"))
    fn = kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="acme.dma"), block_bytes=4096)
    assert [r.impl for r in fn.plan.routes] == ["acme.dma"] and "forced by Policy.force" in fn.explain()
    monkeypatch.setenv("KVSWAP_FORCE_IMPL", "acme.kern")
    fn = kvswap.resolve("h2d", device="cpu", host=host, block_bytes=262144)
    assert [r.impl for r in fn.plan.routes] == ["acme.kern"] and "KVSWAP_FORCE_IMPL" in fn.explain()


def test_force_that_cannot_be_honoured_names_impl_reason_and_choices():
    host = two_route_host(("acme.dma", "acme.kern"))
    with pytest.raises(ResolutionError, match=r"'acme\.nope' is not registered .* usable here: acme\.dma, acme\.kern, host\.reference"):
        kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="acme.nope"))
    with pytest.raises(ResolutionError, match=r"'acme\.kern' cannot be honoured: Policy\.max_sms=0"):
        kvswap.resolve("h2d", device="cpu", host=host, policy=Policy(force="acme.kern", max_sms=0))
    wide = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer([recording_impl("acme.wide", alignment=8)]))])
    with pytest.raises(ResolutionError, match=r"refuses block_bytes \[12\]"):
        kvswap.resolve("h2d", device="cpu", host=wide, block_bytes=[8, 12], policy=Policy(force="acme.wide"))


def test_impl_for_another_platform_or_direction_is_rejected_with_reason():
    gpu_only = recording_impl("acme.gpu", platform="cpu")
    one_way = CopyImpl("acme.up", "batch", ("cpu",), ("h2d",), lambda ctx: host_copy)
    unavailable = CopyImpl("acme.off", "batch", ("cpu",), ("d2h",), lambda ctx: host_copy,
                           availability=lambda dev: "the acme driver is not loaded")
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer([gpu_only, one_way, unavailable]))])
    fn = kvswap.resolve("d2h", device="cpu", host=host)
    reasons = {c.name: c.reason for c in fn.plan.candidates}
    assert reasons["acme.up"] == "copies only h2d"
    assert reasons["acme.off"] == "the acme driver is not loaded"
    assert reasons["acme.gpu"] is None


def test_a_factory_that_raises_rejects_only_its_impl():
    def broken(ctx):
        raise RuntimeError("cannot bind")

    bad = CopyImpl("acme.broken", "batch", ("cpu",), ("h2d", "d2h"), broken)
    cal = cpu_cal([("acme.broken", [(1, 999.0)], None)])
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer([bad], cal))])
    fn = kvswap.resolve("h2d", device="cpu", host=host)
    assert fn.impls == ("host.reference",)
    assert "factory raised RuntimeError: cannot bind" in fn.explain()


def test_uncalibrated_impls_rank_after_predicted_ones_by_name():
    # Nothing predicts any of them: kvswap's own route first, then another plugin's by name.
    impls = [recording_impl("acme.zeta"), recording_impl("acme.alpha")]
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Offer(impls))])
    fn = kvswap.resolve("h2d", device="cpu", host=host)
    assert fn.plan.routes[0].impl == "host.reference"
    assert fn.plan.routes[0].fallbacks == ("acme.alpha", "acme.zeta")


# ---- SM tiers by batch size --------------------------------------------------------

def tiered_kernel(log, alignment=1):
    """A kernel impl whose every bound function logs ``(num_sms, batch)`` per call."""
    def factory(ctx):
        k = ctx.params["num_sms"]

        def fn(src, dst, sizes, stream):
            log.append((k, len(sizes)))
            host_copy(src, dst, sizes)
        return fn

    return CopyImpl("acme.kern", "kernel", ("cpu",), ("h2d", "d2h"), factory, alignment=alignment)


TIERS = {"h2d": [[4096, [[1, 8], [100, 24], [2000, 8]]], [65536, [[1, 8]]]]}


def tier_host(log, alignment=1, **cal):
    cal = cpu_cal([("acme.dma", DMA, None), ("acme.kern", KERNEL, 8)],
                  kernel_sms={"h2d": 8}, kernel_min_batch={"h2d": 16}, **cal)
    return create_plugin_host(entry_points=[], env={}, extra=[
        ("p", Offer([recording_impl("acme.dma"), tiered_kernel(log, alignment)], cal))])


@pytest.mark.parametrize("alignment", [1, 16])  # 16: the per-descriptor path (assign) decides
def test_batch_tiers_run_the_kernel_on_the_sms_of_the_batch_size(alignment):
    log = []
    fn = kvswap.resolve("h2d", device="cpu", host=tier_host(log, alignment, kernel_sms_by_batch=TIERS),
                        block_bytes=4096)
    route = next(r for r in fn.plan.routes if r.at_bytes == 4096)
    assert route.impl == "acme.kern" and route.sms_by_batch == ((1, 8), (100, 24), (2000, 8))
    assert fn.plan.params["acme.kern"] == {"num_sms": 8}  # the knee; 24 is bound besides it
    rng = np.random.default_rng(7)
    for n, sms in [(16, 8), (99, 8), (100, 24), (1999, 24), (2000, 8), (5000, 8)]:
        sizes = np.full(n, 4096, dtype=np.int64)
        src, dst, so, do = host_batch(rng, sizes, pool=1 << 25, slot=4096)
        want = expected(src, dst, so, do, sizes)
        log.clear()
        LOG.clear()
        fn(address(src) + so, address(dst) + do, sizes)
        assert log == [(sms, n)], n
        assert np.array_equal(dst, want)
        assert [(name, k) for name, k, _ in fn.assign(address(src) + so, address(dst) + do, sizes)] == [("acme.kern", sms)]
    log.clear()
    sizes = np.full(5, 4096, dtype=np.int64)  # under the min batch: the batch route
    src, dst, so, do = host_batch(rng, sizes, slot=4096)
    fn(address(src) + so, address(dst) + do, sizes)
    assert log == [] and LOG == [("acme.dma", 5)]
    text = fn.explain()
    assert "batches of 100-1999 descriptors -> acme.kern on 24 SMs" in text
    assert "batches of 2000+ descriptors -> acme.kern on 8 SMs" in text
    assert "(and 24 SMs for the batch tiers of its routes)" in text


def test_batch_tiers_come_from_the_nearest_measured_block_size():
    cal = cpu_cal([("acme.kern", KERNEL, 8)], kernel_sms_by_batch=TIERS)
    assert cal.sms_tiers(kvswap.Direction.H2D, 4096) == ((1, 8), (100, 24), (2000, 8))
    assert cal.sms_tiers(kvswap.Direction.H2D, 12 * 1024) == ((1, 8), (100, 24), (2000, 8))  # log-nearer 4 KiB
    assert cal.sms_tiers(kvswap.Direction.H2D, 20 * 1024) == ((1, 8),)
    assert cal.sms_tiers(kvswap.Direction.H2D, 1 << 30) == ((1, 8),)
    assert cal.sms_tiers(kvswap.Direction.D2H, 4096) == ()  # not measured: the knee


def test_batch_tiers_obey_max_sms_and_vanish_when_they_all_come_to_the_knee():
    log = []
    host = tier_host(log, kernel_sms_by_batch=TIERS)
    capped = kvswap.resolve("h2d", device="cpu", host=host, block_bytes=4096, policy=Policy(max_sms=12))
    route = next(r for r in capped.plan.routes if r.at_bytes == 4096)
    assert route.sms_by_batch == ((1, 8), (100, 12), (2000, 8))
    flat = kvswap.resolve("h2d", device="cpu", host=host, block_bytes=4096, policy=Policy(max_sms=8))
    assert all(r.sms_by_batch == () for r in flat.plan.routes)
    assert "tiers" not in flat.explain()


# Compute slowdown beside compute by SM count, as `kvswap calibrate --interference` stores it.
SLOWER_AT_24 = {d: (("acme.kern", 8, 0.20), ("acme.kern", 24, 0.35)) for d in ("h2d", "d2h")}
TIERS_BOTH = {d: TIERS["h2d"] for d in ("h2d", "d2h")}


def test_an_offload_tier_above_the_knee_that_costs_more_compute_than_it_gains_runs_on_the_knee():
    # The kernel is measured at 8 SMs only (24 SMs predicts the same speed) and 24 SMs slow
    # compute 15 points more: every d2h tier of 24 goes back to the knee.
    log = []
    fn = kvswap.resolve("d2h", device="cpu", host=tier_host(log, kernel_sms_by_batch=TIERS_BOTH,
                                                             slowdown_by_sms=SLOWER_AT_24), block_bytes=4096)
    route = next(r for r in fn.plan.routes if r.at_bytes == 4096)
    assert route.impl == "acme.kern" and route.sms_by_batch == ()
    rng = np.random.default_rng(5)
    sizes = np.full(500, 4096, dtype=np.int64)  # 24 SMs by the tiers alone
    src, dst, so, do = host_batch(rng, sizes, pool=1 << 25, slot=4096)
    want = expected(src, dst, so, do, sizes)
    fn(address(src) + so, address(dst) + do, sizes)
    assert log == [(8, 500)] and np.array_equal(dst, want)


def test_a_load_keeps_its_tiers_whatever_they_cost_in_compute():
    # Host to device: the next step may wait for the blocks, so time bought with SMs counts.
    fn = kvswap.resolve("h2d", device="cpu", host=tier_host([], kernel_sms_by_batch=TIERS_BOTH,
                                                            slowdown_by_sms=SLOWER_AT_24), block_bytes=4096)
    route = next(r for r in fn.plan.routes if r.at_bytes == 4096)
    assert route.sms_by_batch == ((1, 8), (100, 24), (2000, 8))


@pytest.mark.parametrize("faster, kept", [(1.30, True), (1.10, False)])
def test_an_offload_tier_stays_where_its_speed_gain_exceeds_its_compute_cost(faster, kept):
    curves = [("acme.dma", DMA, None), ("acme.kern", KERNEL, 8),
              ("acme.kern", [(b, g * faster) for b, g in KERNEL], 24)]
    cal = cpu_cal(curves, kernel_sms={"d2h": 8}, kernel_min_batch={"d2h": 16}, kernel_sms_by_batch=TIERS_BOTH,
                  slowdown_by_sms=SLOWER_AT_24)
    host = create_plugin_host(entry_points=[], env={}, extra=[
        ("p", Offer([recording_impl("acme.dma"), tiered_kernel([])], cal))])
    route = next(r for r in kvswap.resolve("d2h", device="cpu", host=host, block_bytes=4096).plan.routes
                 if r.at_bytes == 4096)
    # +30% speed against +15 points of slowdown pays; +10% does not.
    assert route.sms_by_batch == (((1, 8), (100, 24), (2000, 8)) if kept else ())


def test_a_low_interference_policy_keeps_kernels_on_their_knee():
    log = []
    fn = kvswap.resolve("h2d", device="cpu", host=tier_host(log, kernel_sms_by_batch=TIERS), block_bytes=4096,
                        policy=Policy(prefer="low_interference"))
    assert all(r.sms_by_batch == () for r in fn.plan.routes)
    rng = np.random.default_rng(3)
    sizes = np.full(500, 4096, dtype=np.int64)  # a batch size the throughput policy runs on 24 SMs
    src, dst, so, do = host_batch(rng, sizes, pool=1 << 25, slot=4096)
    want = expected(src, dst, so, do, sizes)
    fn(address(src) + so, address(dst) + do, sizes)
    assert log == [(8, 500)] and np.array_equal(dst, want)


def test_a_tier_that_cannot_be_bound_leaves_the_knee_and_a_note():
    log = []

    def factory(ctx):
        if ctx.params["num_sms"] > 8:
            raise RuntimeError("no such grid")
        return lambda src, dst, sizes, stream: log.append(len(sizes)) or host_copy(src, dst, sizes)

    cal = cpu_cal([("acme.dma", DMA, None), ("acme.kern", KERNEL, 8)], kernel_sms={"h2d": 8},
                  kernel_sms_by_batch=TIERS)
    host = create_plugin_host(entry_points=[], env={}, extra=[("p", Offer([
        recording_impl("acme.dma"), CopyImpl("acme.kern", "kernel", ("cpu",), ("h2d",), factory)], cal))])
    fn = kvswap.resolve("h2d", device="cpu", host=host, block_bytes=4096)
    assert all(r.sms_by_batch == () for r in fn.plan.routes)
    assert any("could not be bound at 24 SMs" in n and "no such grid" in n for n in fn.plan.notes)
    sizes = np.full(500, 4096, dtype=np.int64)
    rng = np.random.default_rng(2)
    src, dst, so, do = host_batch(rng, sizes, pool=1 << 23, slot=4096)
    fn(address(src) + so, address(dst) + do, sizes)
    assert log == [500] and np.array_equal(dst, expected(src, np.full_like(dst, POISON), so, do, sizes))


# 256 KiB goes to acme.dma by size (50 against 48 GB/s), but its row says the kernel on 24
# SMs wins batches of 4-199 there: a tier of 0 SMs is the route that takes no SMs.
ZERO_TIERS = {"h2d": [[4096, [[1, 8]]], [262144, [[1, 0], [4, 24], [200, 0]]]]}


def test_a_zero_sm_tier_gives_a_batch_routed_size_to_the_kernel_only_where_it_was_measured_to_win():
    log = []
    fn = kvswap.resolve("h2d", device="cpu", host=tier_host(log, kernel_sms_by_batch=ZERO_TIERS),
                        block_bytes=262144)
    route = next(r for r in fn.plan.routes if r.at_bytes == 262144)
    assert (route.impl, route.small_batch_impl, route.min_batch) == ("acme.kern", "acme.dma", 0)
    assert route.sms_by_batch == ((1, 0), (4, 24), (200, 0))
    assert route.fallbacks[0] == "acme.dma" and "acme.kern" not in route.fallbacks
    assert route.predicted[0][0] == "acme.dma"  # ranked by size, the batch route still leads
    rng = np.random.default_rng(11)
    for n, want_log, want_dma in [(2, [], 2), (4, [(24, 4)], None), (199, [(24, 199)], None),
                                  (200, [], 200), (230, [], 230)]:
        sizes = np.full(n, 262144, dtype=np.int64)
        src, dst, so, do = host_batch(rng, sizes, pool=(n + 8) * 262144, slot=262144)
        want = expected(src, dst, so, do, sizes)
        log.clear()
        LOG.clear()
        fn(address(src) + so, address(dst) + do, sizes)
        assert log == want_log and LOG == ([("acme.dma", want_dma)] if want_dma else []), n
        assert np.array_equal(dst, want), n
    text = fn.explain()
    assert "batches of 1-3 descriptors -> acme.dma" in text
    assert "batches of 4-199 descriptors -> acme.kern on 24 SMs" in text
    assert "batches of 200+ descriptors -> acme.dma" in text and "batches under 0 " not in text
    # A row without a 0 tier was fitted where the kernel is the route: the batch route keeps 256 KiB.
    plain = kvswap.resolve("h2d", device="cpu", host=tier_host([], kernel_sms_by_batch=TIERS), block_bytes=262144)
    assert next(r for r in plain.plan.routes if r.at_bytes == 262144).impl == "acme.dma"
    # Tiers buy throughput with SMs: a low-interference policy keeps the batch route there.
    quiet = kvswap.resolve("h2d", device="cpu", host=tier_host([], kernel_sms_by_batch=ZERO_TIERS),
                           block_bytes=262144, policy=Policy(prefer="low_interference"))
    route = next(r for r in quiet.plan.routes if r.at_bytes == 262144)
    assert (route.impl, route.small_batch_impl, route.sms_by_batch) == ("acme.dma", None, ())


def test_zero_sm_tiers_keep_the_knee_where_no_route_without_sms_is_usable():
    from kvswap.registry.platform import detect
    from kvswap.resolution.routing import routes

    cal = cpu_cal([("acme.kern", KERNEL, 8)], kernel_sms={"h2d": 8}, kernel_sms_by_batch=ZERO_TIERS)
    dev = detect(create_plugin_host(entry_points=[], env={}), "cpu")
    (route,) = [r for r in routes([tiered_kernel([])], cal, kvswap.Direction.H2D, Policy(), (262144,), 8, dev)
                if r.at_bytes == 262144]
    assert (route.impl, route.small_batch_impl) == ("acme.kern", None)
    assert route.sms_by_batch == ((1, 8), (4, 24), (200, 8))


@pytest.mark.parametrize("bad", [
    {"h2d": [[4096, []]]},  # no tiers
    {"h2d": [[4096, [[0, 8]]]]},  # from_batch < 1
    {"h2d": [[4096, [[1, -1]]]]},  # SMs below 0
    {"h2d": [[4096, [[1, 8], [1, 16]]]]},  # one start twice
    {"h2d": [[4096, [[1, 8]]], [4096, [[1, 16]]]]},  # one block size twice
    {"h2d": [["x", [[1, 8]]]]},
])
def test_malformed_batch_tiers_are_refused(bad):
    with pytest.raises(kvswap.InvalidImplError, match="kernel_sms_by_batch"):
        cpu_cal([("acme.kern", KERNEL, 8)], kernel_sms_by_batch=bad)


def test_a_function_for_every_size_decides_a_measured_size_as_the_function_for_that_size():
    """resolve() without block sizes covers each class of sizes from one measured size to the
    next with one decision; at the class's own measured size (block sizes of KV caches are
    powers of two and their midpoints, which is the grid calibration measures) it must be
    the decision of that size's rows, not of a size between two rows."""
    rows = dict(min_batch_by_size={"h2d": [[4096, 4], [8192, 16], [131072, 8], [196608, 64]]},
                kernel_sms_by_batch={"h2d": [[4096, [[1, 8], [100, 24]]], [8192, [[1, 8], [300, 16]]],
                                             [131072, [[1, 8], [50, 24]]], [196608, [[1, 8], [200, 16]]],
                                             [262144, [[1, 0], [4, 24], [200, 0]]]]})
    host = tier_host([], **rows)
    every = kvswap.resolve("h2d", device="cpu", host=host)
    for b in (4096, 8192, 131072, 196608, 262144):
        one = kvswap.resolve("h2d", device="cpu", host=host, block_bytes=b)
        for n in (1, 3, 5, 10, 20, 60, 150, 250, 400, 3000):
            src = 4096 + np.arange(n, dtype=np.int64) * b
            dst, sizes = src + (1 << 40), np.full(n, b, dtype=np.int64)
            got = [(name, k) for name, k, _ in every.assign(src, dst, sizes)]
            assert got == [(name, k) for name, k, _ in one.assign(src, dst, sizes)], (b, n)
    text = every.explain()
    assert "128 KiB <= block < 192 KiB" in text and "batches under 8 descriptors -> acme.dma" in text
