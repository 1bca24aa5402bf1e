"""The calibration sweep end to end on the CPU: real copies, routes bound through resolve(),
broken routes skipped, and the profile it yields read back by the resolver."""
from __future__ import annotations

import numpy as np
import pytest

import kvswap
from kvswap import DeviceInfo, Policy
from kvswap.resolution import profiles
from kvswap.calibration import fit, store, timing
from kvswap.calibration.records import BATCH, CEILING, SIZE
from kvswap.calibration.sweep import Settings, Sweep, grid_sizes, settings_for
from kvswap.registry.plugins import create_plugin_host
from kvswap.registry.platform import cpu_device
from kvswap.resolution.routing import EDGES

from calibration_fakes import KiB, Ledger, LedgerTimer, ModelPlatform, SpellTimer

MiB = 1 << 20
SIZES = (2 * KiB, 4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB)


def tiny(**over) -> Settings:
    base = dict(block_sizes=SIZES, sm_counts=(1, 2, 4, 8, 16), batch_sizes=(1, 4, 64), batch_sweep_blocks=2,
                size_sweep_bytes=16 * MiB, max_batch=4096, pool_bytes=16 * MiB, ceiling_bytes=MiB,
                repeats=2, warmup=0)
    base.update(over)
    return Settings(**base)


def model_sweep(broken: bool = False, batch_setup_s: float = 0.0, **over):
    ledger = Ledger()
    plat = ModelPlatform(ledger, broken=broken, batch_setup_s=batch_setup_s)
    host = create_plugin_host(entry_points=[], extra=[("model", plat)])
    sweep = Sweep("modelplat:0", tiny(**over), ["h2d", "d2h"], host=host, timer=LedgerTimer(ledger))
    return sweep.run(), plat, host


def test_sweep_binds_each_sm_count_and_fits_the_model():
    result, plat, host = model_sweep()
    assert result.failures == []
    # every kernel binding went through resolve() with exactly the SM count measured
    assert sorted(set(plat.bound_sms)) == [1, 2, 4, 8, 16]
    for d in ("h2d", "d2h"):
        size = {(m.impl, m.num_sms, m.block_bytes) for m in result.measurements if m.direction == d and m.stage == SIZE}
        assert size == {("model.batch", None, b) for b in SIZES} | {
            ("model.kernel", k, b) for k in (1, 2, 4, 8, 16) for b in SIZES}
        assert [m.stage for m in result.measurements if m.direction == d].count(CEILING) == 2  # at the start and the end
        dec = fit.fit_direction(result.measurements, d)
        # kernel_gbps caps at 50 GB/s; below 16 KiB it needs 8 SMs (6.5 each) to get there
        assert dec.kernel_sms == 8
        # KERNEL_LAUNCH_S=5 us: at 2 KiB the kernel pays from n*2048*(1/3e9-1/50e9) > 5us (n > 7),
        # at 64 KiB from n > 34; of the measured 1, 4, 64 the threshold is 64
        assert dec.kernel_min_batch == 64
        batch_blocks = {m.block_bytes for m in result.measurements if m.direction == d and m.stage == BATCH}
        # first and last size where the kernel is the route, and the batch route's size (256 KiB)
        assert batch_blocks == {2 * KiB, 64 * KiB, 256 * KiB}
        assert dict(dec.kernel_sms_by_batch)[256 * KiB] == [[1, 0]]  # the kernel takes none of its batches
        assert [r.impl for r in dec.by_size] == ["model.kernel"] * 4 + ["model.batch"]
        # between 64 KiB (45 GB/s) and 256 KiB (52) the batch curve passes the kernel's 49.3 GB/s
        # at ~152 KiB; the resolver ranks the class [128, 192) KiB at 128 KiB (48.5 GB/s on the
        # batch curve) and [192, 256) KiB at 192 KiB (50.5): batch from 192 KiB
        assert dec.crossover_bytes == 192 * KiB


def test_a_ceiling_that_moved_during_a_direction_leaves_a_note_and_the_better_one_is_kept():
    ledger = Ledger()
    host = create_plugin_host(entry_points=[], extra=[("model", ModelPlatform(ledger))])
    for slow, noted in ((1.06, True), (1.04, False)):
        # the run's first measurement is the h2d ceiling: that one alone runs slow
        sweep = Sweep("modelplat:0", tiny(), ["h2d", "d2h"], host=host,
                      timer=SpellTimer(ledger, start=0, length=1, factor=slow))
        result = sweep.run()
        h2d = [m.gbps for m in result.measurements if m.direction == "h2d" and m.stage == CEILING]
        assert len(h2d) == 2 and h2d[0] * slow == pytest.approx(h2d[1], rel=1e-3)
        assert fit.ceilings(result.measurements)["h2d"] == pytest.approx(h2d[1], rel=1e-3)  # the better one
        notes = [n for n in result.notes if "not steady" in n]
        assert len(notes) == noted and all(n.startswith("h2d:") and f"{h2d[0]:.1f} GB/s at the start" in n
                                           for n in notes)


def test_profile_from_a_sweep_is_what_the_resolver_decides_by():
    result, plat, host = model_sweep()
    dev = result.device
    doc = store.make_document(dev, fit.profile_fields(result.measurements, [], ["h2d", "d2h"]))
    path = store.save(doc, profiles.default_path(dev))
    for d in ("h2d", "d2h"):
        fn = kvswap.resolve(d, device="modelplat:0", host=host)
        assert fn.plan.calibration["source"] == f"profile {path}"
        assert str(path) in fn.explain()
        assert fn.plan.params["model.kernel"]["num_sms"] == 8
        decided = doc["decisions"][d]["routes"]
        for lo in EDGES:  # every block-size class: the resolver's route is the fit's route
            plan_route = next(r for r in fn.plan.routes if r.min_bytes <= lo and (r.max_bytes is None or lo <= r.max_bytes))
            fit_route = next(r for r in decided if r["min_bytes"] <= lo and (r["max_bytes"] is None or lo <= r["max_bytes"]))
            assert plan_route.impl == fit_route["impl"], lo
            if plan_route.impl == "model.kernel":
                assert (plan_route.small_batch_impl, plan_route.min_batch) == ("model.batch", 64)
        addr = np.arange(1, 65, dtype=np.int64) * (1 << 20)
        sizes = np.full(64, 4 * KiB, dtype=np.int64)
        assert [n for n, _, _ in fn.assign(addr[:4], addr[:4] + 8 * KiB, sizes[:4])] == ["model.batch"]
        assert [n for n, _, _ in fn.assign(addr, addr + 8 * KiB, sizes)] == ["model.kernel"]


def test_small_batches_of_a_batch_routed_size_go_to_the_kernel_where_it_was_measured_faster():
    # A batch call that costs 8 us more: at 256 KiB the batch route still wins 64 blocks
    # (331 against 341 us) but loses 1 and 4 to the kernel's 5 us launch (13 against 10 us).
    result, plat, host = model_sweep(batch_setup_s=8e-6)
    fitted = fit.profile_fields(result.measurements, [], ["h2d", "d2h"])
    doc = store.make_document(result.device, fitted)
    dec = fitted.decisions["h2d"]
    assert next(r for r in dec.by_size if r.block_bytes == 256 * KiB).impl == "model.batch"
    assert dict(dec.kernel_sms_by_batch)[256 * KiB] == [[1, 8], [16, 0]]
    assert 256 * KiB not in dict(dec.min_batch_by_size)  # a kernel size's threshold, not this one's
    store.save(doc, profiles.default_path(result.device))
    fn = kvswap.resolve("h2d", device="modelplat:0", host=host, block_bytes=256 * KiB)
    route = next(r for r in fn.plan.routes if r.at_bytes == 256 * KiB)
    assert (route.impl, route.small_batch_impl, route.sms_by_batch) == ("model.kernel", "model.batch", ((1, 8), (16, 0)))
    addr = np.arange(1, 65, dtype=np.int64) * (1 << 20)
    sizes = np.full(64, 256 * KiB, dtype=np.int64)
    assert [n for n, _, _ in fn.assign(addr[:4], addr[:4] + 512 * KiB, sizes[:4])] == ["model.kernel"]
    assert [n for n, _, _ in fn.assign(addr, addr + 512 * KiB, sizes)] == ["model.batch"]
    assert "batches of 16+ descriptors -> model.batch" in fn.explain()


def test_routes_that_raise_or_copy_nothing_are_reported_and_skipped():
    result, plat, host = model_sweep(broken=True)
    failed = {(f.impl, f.num_sms): f.error for f in result.failures}
    assert "device fell off the bus" in failed[("model.raises", None)]
    assert {k for k in failed if k[0] == "model.nothing"} == {("model.nothing", k) for k in (1, 2, 4, 8, 16)}
    assert all(e.startswith("WrongResult") for k, e in failed.items() if k[0] == "model.nothing")
    measured = {m.impl for m in result.measurements}
    assert "model.raises" not in measured and "model.nothing" not in measured
    # a route that refuses large blocks is measured where it accepts them, and is no failure
    small = {m.block_bytes for m in result.measurements if m.impl == "model.small" and m.stage == SIZE}
    assert small == {2 * KiB, 4 * KiB}
    assert "model.small" not in {f.impl for f in result.failures}
    assert fit.fit_direction(result.measurements, "h2d").kernel_sms == 8  # the rest still decides


def test_no_sm_budget_measures_no_kernel():
    result, plat, host = model_sweep(sm_counts=())
    assert {m.impl for m in result.measurements if m.stage == SIZE} == {"model.batch"}
    assert any("no SM budget" in n for n in result.notes)
    dec = fit.fit_direction(result.measurements, "h2d")
    assert dec.kernel_sms is None and dec.kernel_min_batch is None
    assert [r.impl for r in dec.routes] == ["model.batch"]


def test_sweep_on_the_cpu_measures_real_copies_of_every_available_route():
    """The host reference, and triton.kernel where Triton's interpreter serves the CPU
    (TRITON_INTERPRET=1, as in this suite): real copies, checked, timed by the wall clock."""
    usable = {c.name: c.kind for c in kvswap.resolve("h2d").plan.candidates if c.available}
    s = tiny(block_sizes=(4 * KiB, 64 * KiB), sm_counts=(1, 2), size_sweep_bytes=MiB // 2, max_batch=8,
             pool_bytes=4 * MiB, repeats=1, warmup=0)
    result = Sweep("cpu", s, ["h2d", "d2h"]).run()
    assert result.host_only and result.failures == []
    got = {(m.direction, m.stage, m.impl, m.num_sms, m.block_bytes) for m in result.measurements if m.stage != BATCH}
    want = {(d, CEILING, "contiguous", None, MiB) for d in ("h2d", "d2h")}
    for name, kind in usable.items():
        if kind == "staged":  # measured by chunk size on a block-major host (kvswap.calibration.staged), not here
            continue
        for sms in ((1, 2) if kind == "kernel" else (None,)):
            want |= {(d, SIZE, name, sms, b) for d in ("h2d", "d2h") for b in (4 * KiB, 64 * KiB)}
    assert got == want
    assert all(m.seconds > 0 and m.gbps > 0 for m in result.measurements)


def test_default_settings():
    cpu = cpu_device()
    quick, full = settings_for(cpu, quick=True), settings_for(cpu)
    assert quick.block_sizes == tuple(KiB << i for i in range(10))  # powers of two, 1-512 KiB
    assert len(full.block_sizes) == 19 and 3 * KiB // 2 in full.block_sizes and full.block_sizes[-1] == 512 * KiB
    assert grid_sizes(KiB, 4 * KiB) == (KiB, 3 * KiB // 2, 2 * KiB, 3 * KiB, 4 * KiB)
    gpu = DeviceInfo(platform="cuda", name="H200", identity="cuda-h200", compute_units=132, index=0)
    g = settings_for(gpu)
    assert g.sm_counts[-1] == 132 and max(g.batch_sizes) >= 10000 and g.pool_bytes >= 1 << 30
    assert settings_for(gpu, max_sms=10).sm_counts == (2, 4, 6, 8, 10)
    assert settings_for(gpu, max_sms=0).sm_counts == ()
    assert settings_for(gpu, quick=True).repeats < g.repeats
    assert (g.batch_passes, settings_for(gpu, quick=True).batch_passes) == (3, 1)  # --quick: one pass


def test_a_route_bound_for_measurement_takes_exact_sm_counts_and_leaves_the_lookup_alone(tmp_path, monkeypatch):
    from kvswap.calibration.binding import bound_at

    ledger = Ledger()
    plat = ModelPlatform(ledger)
    host = create_plugin_host(entry_points=[], extra=[("model", plat)])
    dev = kvswap.resolve("h2d", device="modelplat:0", host=host).plan.device
    fn = bound_at("h2d", dev, "modelplat:0", host, "model.kernel", 12)
    assert fn.plan.params["model.kernel"]["num_sms"] == 12
    assert not fn.plan.notes or "not calibrated" not in " ".join(fn.plan.notes)
    after = kvswap.resolve("h2d", device="modelplat:0", host=host, policy=Policy(force="model.kernel"))
    assert after.plan.params["model.kernel"]["num_sms"] == 8  # the built-in fallback's, again
    # a profile in force for the device steers neither the binding nor is changed by it
    monkeypatch.setenv(profiles.PROFILE_ENV, str(tmp_path / "missing.json"))
    with pytest.warns(kvswap.ProfileWarning):
        assert kvswap.resolve("h2d", device="modelplat:0", host=host).plan.calibration["calibrated"] is False
    assert bound_at("h2d", dev, "modelplat:0", host, "model.kernel", 3).plan.params["model.kernel"]["num_sms"] == 3


def test_tier_sms_takes_the_knee_and_counts_near_its_multiples():
    from kvswap.calibration.sweep import tier_sms

    h200 = (2, 4, 6, 8, 12, 16, 24, 32, 48, 132)
    assert tier_sms(h200, 4, 5) == [4, 8, 12, 16, 24]
    assert tier_sms(h200, 4, 4) == [4, 8, 12, 16]
    assert tier_sms(h200, 4, 1) == [4]
    assert tier_sms(h200, 48, 4) == [48, 132]  # nothing else above the knee
    assert tier_sms((2, 4, 8, 16), 8, 3) == [8, 16]


def test_measurements_record_their_spread_and_old_profiles_still_read():
    result, _, _ = model_sweep()
    assert all(m.spread == 0.0 for m in result.measurements)  # the modelled timer never strays
    from kvswap.calibration.records import Measurement
    from kvswap.calibration.timing import spread

    assert spread([1.0, 1.0, 1.1, 0.9, 1.0]) == pytest.approx(0.0)
    assert spread([1.0, 1.2, 0.8, 1.0, 1.1]) == pytest.approx(0.1)
    old = result.measurements[0].to_dict()
    del old["spread"]  # written before spreads were recorded
    assert Measurement.from_dict(old).spread == 0.0


def test_the_timer_carries_its_shuffle_from_one_measurement_to_the_next():
    from kvswap.calibration.timing import KEEP, SETTLE, HostTimer

    def orders(timer):
        log = []
        calls = [(lambda i: lambda stream: log.append(i))(i) for i in range(6)]
        timer.measure(calls, repeats=4, warmup=0)
        return log[::SETTLE + 4]  # one entry per block

    assert KEEP >= 4
    timer = HostTimer()
    first, second = orders(timer), orders(timer)
    assert sorted(first) == sorted(second) == list(range(6))
    assert first != second  # a replayed order would favour the same contender at every point
    assert orders(HostTimer()) == first  # seeded: runs repeat


def test_the_schedule_runs_each_call_in_blocks_settled_before_they_are_timed():
    import random

    from kvswap.calibration.timing import KEEP, SETTLE, schedule

    repeats = 2 * KEEP + 2
    got = schedule(3, repeats, random.Random(0))
    for i in range(3):
        assert sum(1 for j, timed in got if j == i and timed) == repeats
    left, pos, rounds = {i: repeats for i in range(3)}, 0, []
    while pos < len(got):  # block by block: SETTLE untimed calls of one route, then its timed ones
        i = got[pos][0]
        want = min(KEEP, left[i])
        assert got[pos:pos + SETTLE + want] == [(i, False)] * SETTLE + [(i, True)] * want
        left[i] -= want
        rounds.append(i)
        pos += SETTLE + want
    assert all(v == 0 for v in left.values())
    assert [sorted(rounds[r:r + 3]) for r in range(0, 9, 3)] == [[0, 1, 2]] * 3 and len(rounds) == 9


def test_a_route_times_the_same_whatever_it_is_compared_with(monkeypatch):
    """A call's cost depends on the two calls before it (on a GPU a route can be
    slower after another route). Timed in blocks, each route measures its cost after
    itself, alone or among others; timed once a round, it did not."""
    from kvswap.calibration import timing

    clock = [0.0]
    history: list[str] = []

    def route(name, own, foreign):
        def call(stream):
            strangers = sum(1 for h in history[-2:] if h != name)
            clock[0] += own + foreign * strangers
            history.append(name)
        return call

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    a, b, c = route("a", 10.0, 3.0), route("b", 12.0, 1.0), route("c", 12.0, 1.0)
    alone = [timing.median(t) for t in timing.HostTimer().measure([a], 12, 1)]
    mixed = [timing.median(t) for t in timing.HostTimer().measure([a, b, c], 12, 1)]
    assert alone == [10.0] and mixed == [10.0, 12.0, 12.0]
    monkeypatch.setattr(timing, "SETTLE", 0)
    monkeypatch.setattr(timing, "KEEP", 1)
    mixed = [timing.median(t) for t in timing.HostTimer().measure([a, b, c], 12, 1)]
    assert mixed[0] > 10.0  # the old schedule: "a" paid for its neighbours


def test_short_batch_sweep_points_get_more_rounds_up_to_the_cap():
    # A round at 2 KiB x 1 takes 6 us (modelled), at 16 KiB x 64 288 us, at 64 KiB x 64 182 us:
    # 2 ms a point buys the first the cap, the others what fits, never under the minimum.
    result, _, _ = model_sweep(batch_repeats=3, batch_point_seconds=2e-3, batch_max_repeats=40,
                               batch_sweep_blocks=None)
    reps = {(m.block_bytes, m.batch): m.repeats for m in result.measurements if m.stage == BATCH}
    assert reps[(2 * KiB, 1)] == 40
    assert reps[(16 * KiB, 64)] == 6 and reps[(64 * KiB, 64)] == 10
    result, _, _ = model_sweep(batch_repeats=8, batch_point_seconds=2e-3, batch_max_repeats=40,
                               batch_sweep_blocks=None)
    assert {m.repeats for m in result.measurements if m.stage == BATCH and m.batch == 64 and m.block_bytes == 16 * KiB} == {8}
    assert {m.repeats for m in result.measurements if m.stage == SIZE} == {2}  # the size sweep: as set


def test_rounds_for_scales_to_the_time_allowed():
    from kvswap.calibration.timing import rounds_for

    class Fixed:
        def measure(self, calls, repeats, warmup=0):
            return [[1e-3] * repeats for _ in calls]

    calls = [lambda s: None] * 2  # a round: 2 ms
    assert rounds_for(Fixed(), calls, 5, 0.1, 1000, 0) == 50
    assert rounds_for(Fixed(), calls, 5, 1.0, 120, 0) == 120  # the cap
    assert rounds_for(Fixed(), calls, 5, 0.001, 1000, 0) == 5  # never below the minimum
    assert rounds_for(Fixed(), calls, 5, 0.0, 1000, 0) == 5  # not asked for


def test_a_disturbed_point_is_timed_once_more_and_the_steadier_timings_kept():
    from kvswap.calibration import sweep as sweep_module

    class Disturbed(LedgerTimer):
        """The ledger's costs, with every second call of the first ``noisy`` measurements
        taking 1.3x or 0.7x as long (MAD 30%)."""

        def __init__(self, ledger, noisy):
            super().__init__(ledger)
            self.noisy, self.calls = noisy, 0

        def measure(self, calls, repeats, warmup=1):
            out = super().measure(calls, repeats, warmup)
            self.calls += 1
            if self.calls > self.noisy:
                return out
            return [[t * (1.0 if i % 2 == 0 else 1.3 if i % 4 == 1 else 0.7) for i, t in enumerate(row)] for row in out]

    ledger = Ledger()
    host = create_plugin_host(entry_points=[], extra=[("model", ModelPlatform(ledger))])
    sweep = Sweep("modelplat:0", tiny(repeats=8), ["h2d"], host=host, timer=Disturbed(ledger, noisy=1))
    bounds = sweep.bounds[kvswap.Direction.H2D]

    def spreads():  # each route's timings at one point, as the sweeps take them
        return [timing.spread(t) for _, t in sweep.timings(bounds, sweep.pools.batch(kvswap.Direction.H2D, 4 * KiB, 4))]

    got = spreads()
    assert sweep.timer.calls == 2 and all(x == 0.0 for x in got)  # the retry, steady, kept
    sweep.timer = Disturbed(ledger, noisy=10)
    got = spreads()
    assert sweep.timer.calls == 2 and all(x > sweep_module.RETRY_SPREAD for x in got)  # once, no more
    sweep.timer = Disturbed(ledger, noisy=0)
    spreads()
    assert sweep.timer.calls == 1  # a steady point is timed once


def test_routes_timed_side_by_side_are_compared_round_by_round():
    """A machine switching between a fast and a 40% slower mode from round to round: each
    route's median, taken apart, lands in either mode; recorded, the routes keep the ratios
    of their modelled costs (to 1%: the calls' own jitter), on the batch route's footing."""
    from calibration_fakes import ModeTimer

    ledger = Ledger()
    host = create_plugin_host(entry_points=[], extra=[("model", ModelPlatform(ledger))])
    sweep = Sweep("modelplat:0", tiny(repeats=45), ["h2d"], host=host, timer=LedgerTimer(ledger))
    bounds = sweep.bounds[kvswap.Direction.H2D]
    batch = sweep.pools.batch(kvswap.Direction.H2D, 4 * KiB, 64)

    def measured():  # one pass of the point, recorded as the sweeps record theirs
        return sweep.record(BATCH, batch, [(b, [t]) for b, t in sweep.timings(bounds, batch)])

    calm = {(m.impl, m.num_sms): m.seconds for m in measured()}
    apart = []
    for seed in range(4):
        sweep.timer = ModeTimer(ledger, seed=seed)
        got = {(m.impl, m.num_sms): m.seconds for m in measured()}
        raw = {(b.impl, b.num_sms): timing.median(t) for b, t in sweep.timings(bounds, batch)}
        ref = next(k for k in got if k[1] is None)
        recorded = sweep.result.measurements[-len(got):]
        assert [x.paired_spread for x in recorded if x.num_sms is None] == [0.0]  # the reference
        # the comparisons stray by the calls' own jitter, but where rounds flipped modes
        assert timing.median([x.paired_spread for x in recorded if x.num_sms]) < 0.01
        for k in calm:
            assert got[k] / got[ref] == pytest.approx(calm[k] / calm[ref], rel=0.01)
            apart.append(raw[k] / raw[ref] / (calm[k] / calm[ref]))
    assert max(apart) > 1.3 or min(apart) < 1 / 1.3  # what the medians apart would have recorded


@pytest.mark.parametrize("passes", [1, 3])
def test_the_progress_bar_ends_full(passes):
    """The steps a run takes are the steps it announced: the bar neither stops short of its
    total nor runs past it, with the sweeps in one pass or several."""
    from kvswap.calibration.progress import Progress

    class Bar:
        def __init__(self, total):
            self.total, self.n = total, 0

        def refresh(self):
            pass

        def update(self, k):
            self.n += k
            assert self.n <= self.total  # never past what was announced so far

        def set_description(self, what, refresh=True):
            pass

        def close(self):
            pass

    ledger = Ledger()
    host = create_plugin_host(entry_points=[], extra=[("model", ModelPlatform(ledger))])
    sweep = Sweep("modelplat:0", tiny(size_passes=passes, batch_passes=passes), ["h2d", "d2h"], host=host,
                  timer=LedgerTimer(ledger), progress=Progress(Bar))
    sweep.run()
    assert sweep.progress.bar.n == sweep.progress.bar.total > 0


def test_batch_sweep_passes_outvote_a_slow_spell_and_draw_fresh_slots():
    """A slow spell over a stretch of the batch sweep shorter than a pass moves the points
    it hits when the grid runs once, and none of them when it runs three times over, each
    point a fresh draw of slots every pass."""
    from calibration_fakes import SpellTimer

    def batch_sweep(passes, spell):
        ledger = Ledger()
        host = create_plugin_host(entry_points=[], extra=[("model", ModelPlatform(ledger))])
        sweep = Sweep("modelplat:0", tiny(batch_passes=passes, batch_sweep_blocks=None), ["h2d"], host=host,
                      timer=LedgerTimer(ledger))
        bounds = sweep.bounds[kvswap.Direction.H2D]
        sweep.size_sweep(kvswap.Direction.H2D, bounds)
        draws: list[tuple[int, int, bytes]] = []
        draw = sweep.pools.batch

        def recorded(direction, b, n):
            got = draw(direction, b, n)
            draws.append((b, n, got.src_off.tobytes() + got.dst_off.tobytes()))
            return got

        sweep.pools.batch = recorded
        sweep.timer = SpellTimer(ledger, *spell)
        sweep.batch_sweep(kvswap.Direction.H2D, bounds)
        got = {(m.impl, m.num_sms, m.block_bytes, m.batch): m for m in sweep.result.measurements if m.stage == BATCH}
        return got, draws, sweep.timer.count

    calm, draws, calls = batch_sweep(3, (None,))
    points = len({(b, n) for b, n, _ in draws})
    assert calls == 3 * points and len(draws) == 3 * points  # one timing and one fresh draw per point and pass
    for b, n in {(b, n) for b, n, _ in draws if n >= 4}:
        assert len({d for bb, nn, d in draws if (bb, nn) == (b, n)}) == 3
    assert {m.repeats for m in calm.values()} == {3}  # tiny asks for 2 timed calls a point: 1 a pass, at least
    spell = (points // 2, 3)  # three points in a row, all in the first pass
    assert batch_sweep(3, spell)[0] == calm
    once, _, _ = batch_sweep(1, (None,))
    slowed = batch_sweep(1, spell)[0]
    moved = {key[2:] for key, m in slowed.items() if m.seconds != once[key].seconds}
    assert len(moved) == 3
    for key, m in slowed.items():
        assert m.seconds == pytest.approx(once[key].seconds * (1.5 if key[2:] in moved else 1.0))


def test_size_sweep_passes_outvote_a_spell_that_caught_one_route_and_keep_the_knee():
    """A slow spell that catches the kernel on 8 SMs at one block size, and not the routes
    timed beside it, makes it 1.5x as slow there when the size sweep runs once, and the knee
    fitted from the sweep moves from 8 SMs to 16; run three times over, each size a fresh
    draw every pass, the sweep records what it records with no spell and the knee stays."""
    from calibration_fakes import SpellTimer

    def size_sweep(passes, spell):
        ledger = Ledger()
        host = create_plugin_host(entry_points=[], extra=[("model", ModelPlatform(ledger))])
        sweep = Sweep("modelplat:0", tiny(size_passes=passes, repeats=6), ["h2d"], host=host)
        bounds = sweep.bounds[kvswap.Direction.H2D]
        draw, draws = sweep.pools.batch, []

        def recorded(direction, b, n):
            got = draw(direction, b, n)
            draws.append((b, got.src_off.tobytes() + got.dst_off.tobytes()))
            return got

        sweep.pools.batch = recorded
        only = next(i for i, b in enumerate(bounds) if b.num_sms == 8)
        sweep.timer = SpellTimer(ledger, *spell, only=only)
        sweep.size_sweep(kvswap.Direction.H2D, bounds)
        ms = [m for m in sweep.result.measurements if m.stage == SIZE]
        knee = fit.fit_direction(ms, "h2d").kernel_sms
        return {(m.impl, m.num_sms, m.block_bytes): m for m in ms}, knee, draws, sweep.timer.count

    spell = (1, 1, 1.5)  # the second size of the first pass
    calm, knee, draws, calls = size_sweep(3, (None,))
    assert knee == 8 and calls == 3 * len(SIZES) and len(draws) == 3 * len(SIZES)
    for b in SIZES:  # a fresh draw of every size in every pass
        assert len({d for bb, d in draws if bb == b}) == 3
    assert {m.repeats for m in calm.values()} == {6}  # 6 rounds' worth shared among 3 passes
    assert size_sweep(3, spell)[:2] == (calm, 8)
    once, knee_once, _, _ = size_sweep(1, (None,))
    assert knee_once == 8
    slowed, knee_slowed, _, _ = size_sweep(1, spell)
    assert knee_slowed == 16
    for key, m in slowed.items():
        hit = key == ("model.kernel", 8, SIZES[1])
        assert m.seconds == pytest.approx(once[key].seconds * (1.5 if hit else 1.0))


def test_paired_ratios_cancel_what_the_machine_did_to_both_calls_in_a_round():
    import random

    from kvswap.calibration import timing

    rng = random.Random(3)
    keep = timing.KEEP

    def timed(base, states, last=keep):
        """Timings of a call costing ``base`` through rounds of machine ``states``."""
        out = []
        for r, f in enumerate(states):
            out += [base * f * (1 + 0.002 * (i - 2)) for i in range(keep if r < len(states) - 1 else last)]
        return out

    # passes of 9 and 6 rounds (the last of each short), every round in its own state, up to 40% slow
    states = [[rng.uniform(1.0, 1.4) for _ in range(9)], [rng.uniform(1.0, 1.4) for _ in range(6)]]
    a = [timed(1.10, s, last) for s, last in zip(states, (3, 2))]
    b = [timed(1.00, s, last) for s, last in zip(states, (3, 2))]
    ratio, se = timing.paired(a, b)
    assert ratio == pytest.approx(1.10) and se == pytest.approx(0.0, abs=1e-6)
    assert timing.paired(b, a)[0] == pytest.approx(1 / 1.10)
    # identical work whose calls land in a fast or a 40% slower mode, round by round: one more
    # slow round for ``a`` puts its median, taken apart, in the other mode; paired, the rounds agree
    slow = [[1.4] * 22 + [1.4] + [1.0] * 22, [1.4] * 22 + [1.0] + [1.0] * 22]
    a2, b2 = timed(1.0, slow[0]), timed(1.0, slow[1])
    assert timing.median(a2) / timing.median(b2) > 1.35
    assert timing.paired([a2], [b2])[0] == pytest.approx(1.0)
    # noise that is the calls' own, not the rounds': a standard error that counts it
    b3 = [timed(1.0, [rng.uniform(1.0, 1.4) for _ in range(200)])]
    a3 = [[t * rng.uniform(0.95, 1.05) for t in b3[0]]]
    ratio, se = timing.paired(a3, b3)
    assert abs(ratio - 1.0) < 3 * se and 0.0005 < se < 0.01
    # a pass timed for one of the two only is not paired
    assert timing.paired(a[:1], b) == timing.paired(a[:1], b[:1])
    with pytest.raises(ValueError):
        timing.paired([[]], [[1.0]])


def test_pooled_keeps_the_middle_pass_and_counts_how_far_the_passes_disagree():
    from kvswap.calibration import timing

    calm = [1.00, 1.02, 0.98, 1.01, 0.99]
    slow = [1.4 * t for t in calm]  # a pass through a slow spell
    other = [1.03, 1.05, 1.01, 1.04, 1.02]  # another draw of slots: 3% slower
    seconds, spread, repeats = timing.pooled([calm, slow, other])
    assert seconds == pytest.approx(1.03) and repeats == 15
    assert timing.pooled([calm, slow, calm])[0] == timing.median(calm)  # the spell outvoted
    assert spread > timing.spread(calm)  # the passes' disagreement counts in the standard error
    assert timing.pooled([calm]) == (timing.median(calm), pytest.approx(timing.spread(calm)), 5)
    assert timing.pooled([[], calm])[0] == timing.median(calm)
    with pytest.raises(ValueError):
        timing.pooled([[], []])
    # a point's rounds, seconds and cap, shared among its passes
    assert timing.per_pass(41, 0.3, 801, 3) == (14, pytest.approx(0.1), 267)
    assert timing.per_pass(2, 0.0, 0, 3) == (1, 0.0, 0) and timing.per_pass(41, 0.3, 801, 1) == (41, 0.3, 801)
