"""The fitting logic on synthetic measurements: knee, routes, crossover, minimum batch,
slowdown, and the profile fields the resolver reads."""
from __future__ import annotations

import pytest

import numpy as np

import kvswap
from kvswap import Calibration, Curve, DeviceInfo, InvalidImplError
from kvswap.resolution import profiles
from kvswap.calibration import fit, store
from kvswap.calibration.decisions import ClassRoute
from kvswap.registry.plugins import create_plugin_host
from kvswap.calibration.records import BATCH, CEILING, SIZE, Measurement
from kvswap.registry.thresholds import FALLBACK

from calibration_fakes import Ledger, ModelPlatform

KiB = 1024
SMS = (1, 2, 4, 8, 16)


def m(d, impl, kind, sms, b, gbps, n=1000, stage=SIZE):
    return Measurement(d, stage, impl, kind, sms, b, n, b * n / (gbps * 1e9), 5)


def grid(d, batch: dict, kernel) -> list[Measurement]:
    """Size-sweep measurements: ``batch`` {block: GB/s}, ``kernel(block, sms)`` GB/s."""
    out = [m(d, "x.batch", "batch", None, b, g) for b, g in batch.items()]
    out += [m(d, "x.kernel", "kernel", k, b, kernel(b, k)) for b in batch for k in SMS]
    return out


def per_sm(rates: dict):
    return lambda b, k: min(50.0, rates[b] * k)


def test_knee_covers_every_size_where_the_kernel_wins():
    rates = {4 * KiB: 6.5, 64 * KiB: 26.0}  # 4 KiB needs 8 SMs to reach the 50 GB/s cap, 64 KiB 2
    ms = grid("h2d", {4 * KiB: 4.0, 64 * KiB: 45.0}, per_sm(rates))
    dec = fit.fit_direction(ms, "h2d")
    assert dec.kernel_sms == 8
    assert dec.kernel_peak_sms == 8  # 16 SMs is no faster: the tie goes to fewer
    assert [r.impl for r in dec.by_size] == ["x.kernel", "x.kernel"]


def test_knee_ignores_sizes_where_the_batch_route_wins_anyway():
    rates = {4 * KiB: 6.5, 64 * KiB: 26.0}
    ms = grid("h2d", {4 * KiB: 60.0, 64 * KiB: 45.0}, per_sm(rates))  # DMA beats any kernel at 4 KiB
    dec = fit.fit_direction(ms, "h2d")
    assert dec.kernel_sms == 2  # over all sizes it would be 8
    assert [(r.block_bytes, r.impl, r.num_sms) for r in dec.by_size] == [
        (4 * KiB, "x.batch", None), (64 * KiB, "x.kernel", 2)]


@pytest.mark.parametrize("value, knee", [(95.0, 2), (94.9, 4)])
def test_knee_tolerance_boundary(value, knee):
    b = 8 * KiB
    assert fit.sm_knee({2: {b: value}, 4: {b: 100.0}}, [b], tolerance=0.05) == knee


def test_knee_takes_the_mean_shortfall_so_one_noisy_size_does_not_buy_more_sms():
    sizes = [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB]
    kernel = {4: {b: 99.0 for b in sizes}, 16: {b: 100.0 for b in sizes}}
    kernel[4][8 * KiB] = 92.0  # 8% short at one size, 2.8% on the mean over four
    assert fit.sm_knee(kernel, sizes, tolerance=0.03) == 4
    kernel[4][16 * KiB] = 92.0  # short at two sizes: 4.9% on the mean
    assert fit.sm_knee(kernel, sizes, tolerance=0.03) == 16


def test_knee_with_no_tolerance_is_the_peak():
    b = 8 * KiB
    assert fit.sm_knee({2: {b: 99.0}, 4: {b: 100.0}, 8: {b: 100.0}}, [b], tolerance=0.0) == 4


def test_routes_rank_the_kernel_at_its_knee_not_at_its_peak():
    sizes = (4 * KiB, 16 * KiB, 24 * KiB, 32 * KiB)
    batch = dict(zip(sizes, (4.0, 6.0, 39.5, 45.0)))
    at8 = dict(zip(sizes, (49.0, 49.5, 39.0, 40.5)))  # >= 97% of the 16-SM peak everywhere
    at16 = dict(zip(sizes, (50.0, 50.0, 40.0, 41.5)))

    def kernel(b, k):
        return at16[b] if k == 16 else at8[b] if k == 8 else at8[b] * k / 16

    dec = fit.fit_direction(grid("h2d", batch, kernel), "h2d")
    assert dec.kernel_sms == 8
    # at 24 KiB the kernel wins at 16 SMs (40 > 39.5) but not at the 8 it will be bound with
    assert [r.impl for r in dec.by_size] == ["x.kernel", "x.kernel", "x.batch", "x.batch"]
    # the resolver's class [16, 24) KiB (ranked at ~19.6 KiB) still interpolates to the kernel
    assert dec.crossover_bytes == 24 * KiB
    assert dec.routes[0] == ClassRoute(min_bytes=1, max_bytes=24 * KiB - 1, impl="x.kernel", kind="kernel",
                                       num_sms=8)
    assert dec.routes[-1].impl == "x.batch" and dec.routes[-1].max_bytes is None


def test_crossover_is_none_when_one_kind_is_used_throughout():
    def k(lo):
        return ClassRoute(lo, None, "x.kernel", "kernel", 8)

    def b(lo):
        return ClassRoute(lo, None, "x.batch", "batch", None)

    assert fit.crossover([b(1)]) is None
    assert fit.crossover([k(1)]) is None
    assert fit.crossover([k(1), b(64)]) == 64
    assert fit.crossover([k(1), b(8), k(16)]) is None


def linear(b, ns, launch, per_kernel, per_batch):
    return [(b, n, launch + n * per_kernel, n * per_batch) for n in ns]


NS = (1, 2, 4, 8, 16, 32, 64)


def test_min_batch_where_the_kernel_starts_to_win():
    # kernel: 10 + 0.1 n, batch: 1.0 n -> the kernel wins from n > 11.1
    assert fit.min_batch(linear(4 * KiB, NS, 10.0, 0.1, 1.0)) == 16


def test_min_batch_is_not_moved_by_one_noisy_point():
    pts = linear(4 * KiB, NS, 10.0, 0.1, 1.0)
    pts[1] = (4 * KiB, 2, 1.99, 2.0)  # a blip: the kernel "wins" at n=2 by 0.5%
    assert fit.min_batch(pts) == 16  # "the first batch where the kernel won" would say 2


def test_min_batch_extremes():
    assert fit.min_batch(linear(4 * KiB, NS, 0.0, 0.1, 1.0)) == 1  # the kernel always wins
    assert fit.min_batch(linear(4 * KiB, NS, 0.0, 2.0, 1.0)) == 64  # never: only the largest batch
    assert fit.min_batch([]) is None


def test_min_batch_weighs_every_block_size():
    # A: kernel wins from n > 7.5; B: from n > 62.5, with a large loss below. Excess cost
    # summed over both sizes: t=8 -> 8.5, t=16 -> 3.1, t=32 -> 1.55, t=64 -> 2.37.
    ns = (1, 4, 8, 16, 32, 64, 128)
    pts = linear(4 * KiB, ns, 6.0, 0.2, 1.0) + linear(64 * KiB, ns, 50.0, 0.2, 1.0)
    assert fit.min_batch(pts) == 32


def test_min_batch_is_fitted_per_block_size():
    ns = (1, 2, 4, 8, 16, 32, 64, 128)
    batch = []
    for b, launch in ((4 * KiB, 5.0), (64 * KiB, 40.0)):  # kernel wins from n > 6.25, resp. n > 50
        for n, tk, tb in ((n, launch + 0.2 * n, 1.0 * n) for n in ns):
            batch += [Measurement("h2d", BATCH, "x.kernel", "kernel", 8, b, n, tk, 5),
                      Measurement("h2d", BATCH, "x.batch", "batch", None, b, n, tb, 5)]
    size = grid("h2d", {4 * KiB: 4.0, 64 * KiB: 45.0}, per_sm({4 * KiB: 6.5, 64 * KiB: 26.0}))
    dec = fit.fit_direction(size + batch, "h2d")
    assert dec.min_batch_by_size == [[4 * KiB, 8], [64 * KiB, 64]]
    assert dec.kernel_min_batch in (8, 16, 32, 64)  # one compromise over both


def test_a_kernel_win_inside_the_margin_or_the_noise_is_a_tie_the_batch_route_takes():
    ns = (1, 2, 4, 8, 16)

    def dec(t_kernel: dict[int, float], spread: float = 0.0, repeats: int = 5, paired=None) -> list:
        ms = grid("h2d", {4 * KiB: 4.0}, per_sm({4 * KiB: 6.5}))
        for n in ns:
            ms += [Measurement("h2d", BATCH, "x.kernel", "kernel", 8, 4 * KiB, n, t_kernel[n], repeats, spread, paired),
                   Measurement("h2d", BATCH, "x.batch", "batch", None, 4 * KiB, n, 10.0 * n, repeats, spread,
                               None if paired is None else 0.0)]
        return fit.fit_direction(ms, "h2d").min_batch_by_size

    clear = {1: 30.0, 2: 30.0, 4: 30.0, 8: 30.0, 16: 30.0}  # wins from 4 descriptors, by 25% there
    assert dec(clear) == [[4 * KiB, 4]]
    # by less than KERNEL_MARGIN at 4: a tie, so 4 descriptors stay on the batch route
    assert dec({**clear, 4: 40.0 / (1.0 + fit.KERNEL_MARGIN - 0.005)}) == [[4 * KiB, 8]]
    # by 4% at 4: a win without noise, a tie where 41 rounds spread 10% (2 SE = 4.1%)
    won = {**clear, 4: 40.0 / 1.04}
    assert dec(won, 0.0, 41) == [[4 * KiB, 4]]
    assert dec(won, 0.1, 41) == [[4 * KiB, 8]]
    # the same 10% spread, but what the machine did to both routes at once: their ratio,
    # round by round, strays by 1% (2 SE = 0.6%), and the 4% win stands (spreads of 10-20%
    # taken apart can hide a kernel several % faster)
    assert dec(won, 0.1, 41, paired=0.01) == [[4 * KiB, 4]]
    assert dec(won, 0.1, 41, paired=0.1) == [[4 * KiB, 8]]


def test_calibration_interpolates_min_batch_between_measured_sizes():
    cal = Calibration(source="t", platform="*", kernel_min_batch={"h2d": 16},
                      min_batch_by_size={"h2d": [[65536, 64], [4096, 8]]})
    assert cal.min_batch_by_size["h2d"] == ((4096, 8), (65536, 64))
    got = [cal.min_batch("h2d", block_bytes=b) for b in (1024, 4096, 16384, 65536, 1 << 20)]
    assert got == [8, 8, 23, 64, 64]  # 16 KiB: halfway in log size, 8 * 8 ** 0.5 = 22.6
    assert cal.min_batch("h2d") == 16 and cal.min_batch("d2h", block_bytes=4096) == 16
    for bad in ([[4096, 0]], [[4096, 8], [4096, 9]], [], [["x", 8]]):
        with pytest.raises(InvalidImplError, match="min_batch_by_size"):
            Calibration(source="t", platform="*", min_batch_by_size={"h2d": bad})


def test_the_resolver_takes_the_min_batch_of_each_block_size(tmp_path):
    host = create_plugin_host(entry_points=[], extra=[("model", ModelPlatform(Ledger()))])
    dev = kvswap.resolve("h2d", device="modelplat:0", host=host).plan.device
    curves = [Curve("model.kernel", "h2d", ((4096, 50.0), (65536, 50.0)), 8),
              Curve("model.batch", "h2d", ((4096, 4.0), (65536, 45.0)))]
    decisions = {"h2d": {"kernel_sms": 8, "kernel_min_batch": 16, "min_batch_by_size": [[4096, 8], [65536, 64]]}}
    store.save(store.make_document(dev, curves=curves, decisions=decisions), profiles.default_path(dev))
    fn = kvswap.resolve("h2d", device="modelplat:0", host=host, block_bytes=[4096, 65536])
    by_size = {r.at_bytes: (r.impl, r.small_batch_impl, r.min_batch) for r in fn.plan.routes}
    assert by_size[4096] == ("model.kernel", "model.batch", 8)
    assert by_size[65536] == ("model.kernel", "model.batch", 64)
    src = (1 << 24) + np.arange(32, dtype=np.int64) * 65536  # assign() only routes: nothing is copied
    for size, n, want in ((4096, 8, "model.kernel"), (4096, 7, "model.batch"), (65536, 32, "model.batch")):
        sizes = np.full(n, size, dtype=np.int64)
        assert [name for name, _, _ in fn.assign(src[:n], src[:n] + (1 << 22), sizes)] == [want]


def test_batch_points_pair_the_fastest_kernel_and_batch_per_point():
    ms = [
        m("h2d", "x.kernel", "kernel", 8, 4096, 10.0, n=16, stage=BATCH),
        m("h2d", "x.batch", "batch", None, 4096, 5.0, n=16, stage=BATCH),
        m("h2d", "y.batch", "batch", None, 4096, 20.0, n=16, stage=BATCH),
        m("h2d", "x.kernel", "kernel", 8, 4096, 10.0, n=16, stage=SIZE),  # not the batch stage
        m("d2h", "x.kernel", "kernel", 8, 4096, 10.0, n=32, stage=BATCH),  # other direction
    ]
    ((b, n, tk, tb),) = fit.batch_points(ms, "h2d")
    assert (b, n) == (4096, 16)
    assert tk == pytest.approx(4096 * 16 / 10e9) and tb == pytest.approx(4096 * 16 / 20e9)


def test_slowdown_rows_come_from_the_step_interference_records_only():
    records = [
        {"direction": "h2d", "route": "x.kernel", "kind": "kernel", "num_sms": 4, "slowdown": 0.18},
        {"direction": "h2d", "route": "x.kernel", "kind": "kernel", "num_sms": 8, "slowdown": 0.30},
        {"direction": "d2h", "route": "x.batch", "kind": "batch", "num_sms": 0, "slowdown": 0.01},
        {"direction": "d2h", "route": "x.kernel", "kind": "kernel", "num_sms": 8, "error": "RuntimeError: x"},
    ]
    fields = fit.profile_fields(synthetic_run(), records, ["h2d", "d2h"], prior=FALLBACK)
    assert fields.slowdown_by_sms == {
        "h2d": [["kernel", 4, 0.18], ["kernel", 8, 0.30], ["x.kernel", 4, 0.18], ["x.kernel", 8, 0.30]],
        "d2h": [["batch", 0, 0.01], ["x.batch", 0, 0.01]]}
    assert fields.slowdown_source == fit.SLOWDOWN_MEASURED
    assert "slowdown" not in fields.to_dict()  # one measurement of the slowdown, one field


def test_host_cost_is_stored_and_decides_the_class_routes():
    ms = synthetic_run()
    plain = fit.profile_fields(ms, [], ["h2d", "d2h"])
    at_4k = [r for r in plain.decisions["h2d"].routes if r.min_bytes <= 4 * KiB and (r.max_bytes or 1 << 40) >= 4 * KiB]
    assert at_4k[0].impl == "x.kernel"
    # The kernel's call holds the thread 1 ms + 1 us a descriptor: longer than the batch
    # route's whole transfer at 4 KiB (4096 B / 4 GB/s = 1 us a descriptor, less than 2 us).
    held = {"h2d": {"x.kernel": [1000.0, 2.0], "x.batch": [10.0, 0.1]}}
    fields = fit.profile_fields(ms, [], ["h2d", "d2h"], host_cost=held)
    assert fields.host_cost == held and fields.host_cost_source == fit.HOST_COST_MEASURED
    def at(routes, b):
        return next(r.impl for r in routes if r.min_bytes <= b and (r.max_bytes is None or b <= r.max_bytes))

    assert at(fields.decisions["h2d"].routes, 4 * KiB) == "x.batch"
    # At 16 KiB the batch route takes 16384 B / 6 GB/s = 2.7 us a descriptor: more than 2.
    assert at(fields.decisions["h2d"].routes, 16 * KiB) == "x.kernel"
    assert at(fields.decisions["d2h"].routes, 4 * KiB) == "x.kernel"  # no host cost there: unchanged
    doc = store.make_document(DEVICE, fields)
    assert doc["host_cost"] == held


def synthetic_run() -> list[Measurement]:
    rates = {4 * KiB: 6.5, 16 * KiB: 13.0, 64 * KiB: 26.0, 256 * KiB: 26.0}
    batch = {4 * KiB: 4.0, 16 * KiB: 6.0, 64 * KiB: 45.0, 256 * KiB: 52.0}
    ms = []
    for d in ("h2d", "d2h"):
        ms += grid(d, batch, per_sm(rates))
        ms.append(Measurement(d, CEILING, "contiguous", "ceiling", None, 1 << 29, 1, (1 << 29) / 55e9, 5))
        ms += [m(d, "x.kernel", "kernel", 8, 4 * KiB, 48.0 * n / (n + 20), n=n, stage=BATCH) for n in NS]
        ms += [m(d, "x.batch", "batch", None, 4 * KiB, 4.0, n=n, stage=BATCH) for n in NS]
    return ms


DEVICE = DeviceInfo(platform="cuda", name="Synthetic GPU", identity="cuda-synthetic-gpu-16cu", compute_units=16,
                    index=0, details={"bus": object()})


def test_profile_fields_round_trip_through_the_store(tmp_path):
    ms = synthetic_run()
    doc = store.make_document(DEVICE, fit.profile_fields(ms, [], ["h2d", "d2h"]))
    path = store.save(doc, tmp_path / "p.json")
    cal = profiles.load(path, DEVICE)
    assert cal.source == f"profile {path}" and cal.identity == DEVICE.identity and cal.scope == "device"
    assert cal.kernel_sms == {"h2d": 8, "d2h": 8}
    # kernel 48 n/(n+20) GB/s against batch 4: the kernel is faster from n > 1.8, i.e. n=2
    assert cal.kernel_min_batch == {"h2d": 2, "d2h": 2}
    assert cal.ceiling_gbps == {"h2d": pytest.approx(55.0), "d2h": pytest.approx(55.0)}
    for x in ms:  # every measured point is what the curves predict there
        if x.stage == SIZE:
            assert cal.predict(x.impl, x.kind, x.direction, x.block_bytes, x.num_sms) == pytest.approx(x.gbps, abs=1e-3)
    assert profiles.read(path) == doc
    assert isinstance(profiles.read(path)["device"]["details"]["bus"], str)  # free-form details kept as text


def test_a_partial_run_carries_the_other_direction_over():
    ms = [x for x in synthetic_run() if x.direction == "h2d"]
    fields = fit.profile_fields(ms, [], ["h2d"], prior=FALLBACK)
    assert fields.decisions["d2h"].carried_from == FALLBACK.source
    assert fields.decisions["d2h"].kernel_sms == FALLBACK.kernel_sms["d2h"]
    d2h = fields.curves_of("d2h")
    assert {c.impl for c in d2h} == {c.impl for c in FALLBACK.curves if str(c.direction) == "d2h"}
    assert fields.slowdown_by_sms == {} and "not measured" in fields.slowdown_source
    assert fields.host_cost == {} and "not measured" in fields.host_cost_source
    assert fields.decisions["h2d"].carried_from is None
    assert "carried_from" not in fields.to_dict()["decisions"]["h2d"]
    assert fields.to_dict()["decisions"]["d2h"]["carried_from"] == FALLBACK.source


# ---- SM tiers by batch size ---------------------------------------------------------

TIER_NS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 10000)


def tier_times(slow: dict, counts=(4, 8, 16, 24), spread=0.0):
    """``(seconds, spread, repeats)`` per batch size and SM count: every count equal,
    except ``slow``: ``{n: {sms: fraction of the fastest}}``."""
    return {n: {k: (1e-6 * n / slow.get(n, {}).get(k, 1.0), spread, 25) for k in counts} for n in TIER_NS}


def test_tiers_give_medium_batches_more_sms_and_large_ones_the_knee():
    slow = {n: {4: 0.75, 8: 0.90} for n in (256, 512, 1024, 2048)}  # 16 and 24 SMs are 25% faster there
    assert fit.sms_by_batch(tier_times(slow), floor=4) == [[1, 4], [181, 16], [2896, 4]]  # midpoints: sqrt(128*256)...


def test_tiers_take_the_fewest_sms_the_timings_cannot_tell_from_the_fastest():
    level = {n: {4: 0.90} for n in (256, 512, 1024)}  # 8 SMs as fast as 16 and 24: the fewest of them
    assert fit.sms_by_batch(tier_times(level), floor=4) == [[1, 4], [181, 8], [1448, 4]]
    # half a percent behind the fastest, in timings that do not stray: 8 SMs are passed over (a
    # slack would keep a batch size on fewer SMs than a count measured faster)
    behind = {n: {4: 0.90, 8: 0.995} for n in (256, 512, 1024)}
    assert fit.sms_by_batch(tier_times(behind), floor=4) == [[1, 4], [181, 16], [1448, 4]]
    # ...and taken where the timings stray by 2% (MAD, 25 rounds: a standard error of about 1%)
    assert fit.sms_by_batch(tier_times(behind, spread=0.02), floor=4) == [[1, 4], [181, 8], [1448, 4]]
    assert fit.sms_by_batch(tier_times({}), floor=4) == [[1, 4]]  # nothing to gain: the knee throughout


def test_one_noisy_batch_size_does_not_open_a_tier_but_a_real_shortfall_does():
    off = 1.0 - fit.TIER_NOISE / 2
    noise = {1024: {4: off, 8: off}}  # behind at one batch size, by under TIER_NOISE
    assert fit.sms_by_batch(tier_times(noise), floor=4) == [[1, 4]]
    real = {1024: {4: 0.90, 8: 0.90}}  # 10% behind: a tier of its own
    assert fit.sms_by_batch(tier_times(real), floor=4) == [[1, 4], [724, 16], [1448, 4]]
    # 2.2% behind the fastest at one batch size: beyond TIER_NOISE, not taken for noise
    real = {1024: {4: 0.978, 8: 0.978}}
    assert fit.sms_by_batch(tier_times(real), floor=4) == [[1, 4], [724, 16], [1448, 4]]


def test_a_gain_within_the_noise_of_the_timings_takes_no_sms():
    slow = {n: {4: 0.95} for n in (256, 512, 1024)}  # 5% behind in timings that do not stray...
    assert fit.sms_by_batch(tier_times(slow), floor=4) == [[1, 4], [181, 8], [1448, 4]]
    # ...but not beyond a standard error of timings that stray by 10% (MAD)
    assert fit.sms_by_batch(tier_times(slow, spread=0.10), floor=4) == [[1, 4]]


def test_tiers_never_go_below_the_floor_and_skip_counts_not_measured():
    times = tier_times({n: {2: 1.0, 4: 0.5} for n in TIER_NS}, counts=(2, 4, 8))
    assert fit.sms_by_batch(times, floor=4) == [[1, 8]]  # 2 SMs is as fast, but below the knee
    del times[64][8]  # a count that failed at one batch size is not chosen there
    assert fit.sms_by_batch(times, floor=4) == [[1, 8], [45, 4], [91, 8]]
    assert fit.sms_by_batch({}, floor=4) == [] and fit.sms_by_batch(times, floor=64) == []


def test_fit_direction_stores_tiers_per_block_size_from_the_min_batch_up():
    size = grid("h2d", {4 * KiB: 4.0, 64 * KiB: 45.0}, per_sm({4 * KiB: 6.5, 64 * KiB: 26.0}))
    batch = []
    for b in (4 * KiB, 64 * KiB):
        for n in TIER_NS:
            batch.append(Measurement("h2d", BATCH, "x.batch", "batch", None, b, n, 1e-6 * n if n < 64 else 1.0, 5))
            for k in (8, 16):
                # at 4 KiB, 16 SMs is 20% faster for 64-1024 blocks; at 64 KiB never
                gain = 1.2 if (b == 4 * KiB and 64 <= n <= 1024 and k == 16) else 1.0
                batch.append(Measurement("h2d", BATCH, "x.kernel", "kernel", k, b, n, 1e-7 * n / gain, 5))
    dec = fit.fit_direction(size + batch, "h2d")
    assert dec.kernel_sms == 8
    assert dec.min_batch_by_size == [[4 * KiB, 16], [64 * KiB, 16]]
    assert dec.kernel_sms_by_batch == [[4 * KiB, [[1, 8], [45, 16], [1448, 8]]], [64 * KiB, [[1, 8]]]]
    cal = profiles.to_calibration(store.make_document(DEVICE, curves=fit.curves(size), decisions={"h2d": dec}), "t")
    assert cal.sms_tiers(kvswap.Direction.H2D, 4 * KiB) == ((1, 8), (45, 16), (1448, 8))


def test_a_partial_run_carries_the_other_directions_tiers_over():
    prior = Calibration(source="prior profile", platform="*", kernel_sms={"d2h": 4},
                        min_batch_by_size={"d2h": [[4096, 16]]},
                        kernel_sms_by_batch={"d2h": [[4096, [[1, 4], [300, 16]]]]})
    ms = [x for x in synthetic_run() if x.direction == "h2d"]
    carried = fit.profile_fields(ms, [], ["h2d"], prior=prior).decisions["d2h"]
    assert carried.kernel_sms_by_batch == [[4096, [[1, 4], [300, 16]]]]
    assert carried.min_batch_by_size == [[4096, 16]]


def test_the_kernel_window_of_a_batch_routed_size_is_the_run_of_batches_it_wins():
    def pts(winners, ns=(1, 4, 16, 64, 256)):  # the kernel 10% faster where it wins, else 10% slower
        return [(512 * KiB, n, 0.9 if n in winners else 1.1, 1.0) for n in ns]

    assert fit.kernel_window(pts({1, 4})) == (1, 4)
    assert fit.kernel_window(pts({4, 16, 64})) == (4, 64)
    assert fit.kernel_window(pts(set())) is None
    assert fit.kernel_window(pts({1, 4, 16, 64, 256})) == (1, 256)
    # one lost batch size inside a run costs less than it gains: the run holds
    assert fit.kernel_window(pts({1, 4, 64, 256}, ns=(1, 4, 16, 64, 256))) == (1, 256)
    ties = [(512 * KiB, n, 1.0, 1.0) for n in (1, 4, 16)]  # a tie goes to the batch route
    assert fit.kernel_window(ties) is None
    assert fit.kernel_window([]) is None


def test_window_tiers_put_the_batch_route_around_the_kernels_tiers():
    ns = [1, 4, 16, 64, 256]
    assert fit.window_tiers(ns, (4, 64), [[1, 8], [32, 24]]) == [[1, 0], [4, 8], [32, 24], [128, 0]]
    assert fit.window_tiers(ns, (1, 4), [[1, 24]]) == [[1, 24], [8, 0]]
    assert fit.window_tiers(ns, (1, 256), [[1, 24]]) == [[1, 24], [257, 0]]
    assert fit.window_tiers(ns, None, []) == [[1, 0]]


def test_a_batch_routed_size_gets_its_window_and_no_minimum_batch():
    """Synthetic: 512 KiB goes to the batch route by size, yet the kernel on 16 SMs wins its
    batches of 1-16; 4 KiB is the kernel's from 4 descriptors."""
    ms = [Measurement("h2d", "size", "dma", "batch", None, 4 * KiB, 4096, 4096 * 4 * KiB / 5e9, 5),
          Measurement("h2d", "size", "kern", "kernel", 4, 4 * KiB, 4096, 4096 * 4 * KiB / 45e9, 5),
          Measurement("h2d", "size", "dma", "batch", None, 512 * KiB, 512, 512 * 512 * KiB / 52e9, 5),
          Measurement("h2d", "size", "kern", "kernel", 4, 512 * KiB, 512, 512 * 512 * KiB / 50e9, 5)]
    for n in (1, 4, 16, 64, 256):
        for b, t_dma, t_kern in ((4 * KiB, 10e-6 + n * 0.8e-6, 14e-6 + n * 0.1e-6),
                                 (512 * KiB, 30e-6 + n * 10e-6, 8e-6 + n * 10.4e-6)):
            ms.append(Measurement("h2d", "batch", "dma", "batch", None, b, n, t_dma, 41))
            for k in (4, 16):
                slower = 1.0 if k == 16 or b == 4 * KiB else 1.2
                ms.append(Measurement("h2d", "batch", "kern", "kernel", k, b, n, t_kern * slower, 41))
    dec = fit.fit_direction(ms, "h2d")
    assert [r.impl for r in dec.by_size] == ["kern", "dma"]
    assert dec.min_batch_by_size == [[4 * KiB, 16]]
    rows = dict(dec.kernel_sms_by_batch)
    # 512 KiB: the kernel 22 us faster a call, 0.4 us slower a block: it wins up to 55 blocks
    assert rows[512 * KiB] == [[1, 16], [32, 0]]
