"""``kvswap bench`` logic on a modelled device whose routes carry the peer policy's names:
the peer's choice per point, the ratios, and the resolved route after calibration."""
from __future__ import annotations

import json

import pytest

from kvswap.registry import plugins
from kvswap.calibration import bench as bench_module
from kvswap.calibration import sweep as sweep_module
from kvswap.calibration.bench import BenchSettings, peer_route, run_bench
from kvswap.calibration.bench_records import BenchResult, BenchRow, CandidateTiming, PeerTiming, ResolvedTiming
from kvswap.cli import main

from calibration_fakes import (
    KiB, Ledger, LedgerTimer, ModelPlatform, ModeTimer, batch_gbps, kernel_gbps, modelled_host_cost,
)

MiB = 1 << 20


@pytest.mark.parametrize("direction, block, batch, route", [
    ("h2d", 4 * KiB, 16, ("triton.kernel", 12)),
    ("h2d", 28 * KiB - 1, 10000, ("triton.kernel", 12)),
    ("h2d", 28 * KiB, 10000, ("cuda.batch", None)),  # "under 28 KiB"
    ("h2d", 4 * KiB, 15, ("cuda.batch", None)),  # "at least 16 descriptors"
    ("d2h", 4 * KiB, 10000, ("cuda.batch", None)),  # d2h: always batch DMA
])
def test_peer_policy_is_vllms_original_rule(direction, block, batch, route):
    assert peer_route(direction, block, batch) == route


@pytest.fixture
def peer_named_device(monkeypatch):
    ledger = Ledger()
    plat = ModelPlatform(ledger, names=("cuda.batch", "triton.kernel"))
    plugins.reset_plugin_host(plugins.create_plugin_host(entry_points=[], extra=[("model", plat)]))
    monkeypatch.setattr(sweep_module, "make_timer", lambda device: LedgerTimer(ledger))
    monkeypatch.setattr(bench_module, "make_timer", lambda device: LedgerTimer(ledger))
    modelled_host_cost(monkeypatch)
    return plat


def test_bench_after_calibration_never_loses_to_the_peer(peer_named_device, capsys):
    assert main(["calibrate", "--quick", "--device", "modelplat:0"]) == 0
    capsys.readouterr()
    s = BenchSettings(block_sizes=(4 * KiB, 64 * KiB, 256 * KiB), batch_sizes=(1, 16, 64), pool_bytes=32 * MiB,
                      ceiling_bytes=MiB, repeats=2, warmup=0)
    out = run_bench("modelplat:0", s, ["h2d", "d2h"])
    assert out.failures == [] and len(out.rows) == 18
    assert out.calibration["h2d"]["source"].startswith("profile ")
    for r in out.rows:
        d, b, n = r.direction, r.block_bytes, r.batch
        impl, sms = peer_route(d, b, n)
        assert r.peer.route == impl + (f"@{sms}" if sms else "")
        # bound as resolve() binds it: the knee (the model's costs need no batch tiers)
        assert set(r.candidates) == {"cuda.batch", "triton.kernel@8"}
        assert (r.candidates["triton.kernel@8"].impl, r.candidates["triton.kernel@8"].num_sms) == ("triton.kernel", 8)
        best = r.candidates[r.best].gbps
        assert r.resolved_over_best == pytest.approx(r.resolved.gbps / best, rel=1e-3)
        # modelled costs are exact: the calibrated route is the best candidate and never below the peer
        assert r.resolved_over_best == pytest.approx(1.0, abs=1e-3)
        assert r.resolved_over_peer >= 1.0 - 1e-3
    small = next(r for r in out.rows if (r.direction, r.block_bytes, r.batch) == ("d2h", 4 * KiB, 64))
    # d2h 4 KiB x 64: the peer's batch DMA at 4 GB/s against the kernel at its knee
    assert small.resolved.route == "triton.kernel@8"
    assert small.resolved_over_peer > kernel_gbps(4 * KiB, 8) / batch_gbps(4 * KiB) / 2
    assert out.summary["d2h"].min_resolved_over_peer >= 1.0 - 1e-3


def test_bench_ratios_pair_the_rounds_so_a_machine_switching_modes_cannot_skew_them(peer_named_device, monkeypatch,
                                                                                     capsys):
    """Rounds in a fast or a 40% slower mode, as a busy machine can have them: taken apart,
    the medians of identical work land in different modes; the ratios pair the rounds."""
    assert main(["calibrate", "--quick", "--device", "modelplat:0"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(bench_module, "make_timer", lambda device: ModeTimer(peer_named_device.ledger, seed=1))
    s = BenchSettings(block_sizes=(4 * KiB, 64 * KiB, 256 * KiB), batch_sizes=(1, 16, 64, 256), pool_bytes=80 * MiB,
                      ceiling_bytes=MiB, repeats=45, warmup=0)
    out = run_bench("modelplat:0", s, ["h2d", "d2h"])
    assert out.failures == [] and len(out.rows) == 24
    # the medians apart: identical work (resolved and the candidate on its route) 40% off somewhere
    apart = [r.resolved.gbps / r.candidates[r.resolved.route].gbps for r in out.rows]
    assert max(apart) / min(apart) > 1.3
    for r in out.rows:  # paired: the modelled costs exactly, but for the calls' own 0.5%
        assert r.candidates[r.resolved.route].resolved_over == pytest.approx(1.0, abs=0.01)
        assert r.candidates[r.best].resolved_over_se == r.resolved_over_best_se
        assert r.resolved_over_best == pytest.approx(1.0, abs=0.01)
        assert r.resolved_over_peer >= 0.99
    for d in ("h2d", "d2h"):
        s = out.summary[d]
        assert s.under_best_bar == 0 and s.same_work_min >= 0.99 and s.same_work_max <= 1.01


def test_batch_tiers_from_calibration_beat_the_knee_and_the_peer_at_medium_batches(monkeypatch, capsys, tmp_path):
    ledger = Ledger()
    plat = ModelPlatform(ledger, names=("cuda.batch", "triton.kernel"), fill_s=0.25e-6)
    plugins.reset_plugin_host(plugins.create_plugin_host(entry_points=[], extra=[("model", plat)]))
    monkeypatch.setattr(sweep_module, "make_timer", lambda device: LedgerTimer(ledger))
    monkeypatch.setattr(bench_module, "make_timer", lambda device: LedgerTimer(ledger))
    modelled_host_cost(monkeypatch)
    profile = tmp_path / "p.json"
    assert main(["calibrate", "--quick", "--device", "modelplat:0", "--out", str(profile)]) == 0
    monkeypatch.setenv("KVSWAP_PROFILE", str(profile))
    printed = capsys.readouterr().out
    assert "kernel SMs by batch size, where they differ from the knee:" in printed
    assert "16 KiB blocks: 16 SMs, 8 SMs from 128" in printed
    dec = json.loads(profile.read_text())["decisions"]["h2d"]
    assert dec["kernel_sms"] == 8
    tiers = dict((b, t) for b, t in dec["kernel_sms_by_batch"])
    # 16 KiB x 1-64: 16 SMs save 0.25 us of a 6-27 us call; from 256 blocks (4 MiB) nothing: the knee
    assert tiers[16 * KiB] == [[1, 16], [128, 8]]
    s = BenchSettings(block_sizes=(16 * KiB,), batch_sizes=(16, 64, 256, 1024), pool_bytes=32 * MiB,
                      ceiling_bytes=MiB, repeats=1, warmup=0)
    out = run_bench("modelplat:0", s, ["h2d"])
    assert out.failures == []
    for r in out.rows:
        assert set(r.candidates) == {"cuda.batch", "triton.kernel@8", "triton.kernel@16"}
        tier = r.batch < 128
        assert r.resolved.route == ("triton.kernel@16" if tier else "triton.kernel@8")
        # the knee where more SMs gain nothing; the peer's 12 SMs neither
        assert r.resolved_over_best == pytest.approx(1.0, abs=1e-3) if tier else r.resolved_over_best >= 0.99
        assert r.resolved_over_peer > 1.0 if tier else r.resolved_over_peer >= 0.99
        assert r.peer.same_route is False
    at64 = next(r for r in out.rows if r.batch == 64)
    knee = at64.candidates["triton.kernel@8"].gbps
    assert at64.resolved.gbps > 1.005 * knee


def test_short_points_get_more_rounds_up_to_the_cap(peer_named_device):
    s = BenchSettings(block_sizes=(4 * KiB, 256 * KiB), batch_sizes=(1, 64), pool_bytes=32 * MiB,
                      ceiling_bytes=MiB, repeats=2, warmup=0, point_seconds=1e-3, max_repeats=50)
    out = run_bench("modelplat:0", s, ["h2d"])
    reps = {(r.block_bytes, r.batch): r.repeats for r in out.rows}
    assert reps[(256 * KiB, 64)] == 2  # a round of 64 x 256 KiB takes over 1 ms: the minimum
    assert reps[(4 * KiB, 1)] == 50  # a round of microseconds: the cap
    assert 2 < reps[(4 * KiB, 64)] < 50


def bench_row(over_best, best_se, over_peer, peer_se, same_route):
    return BenchRow(over_best, best_se, over_peer, peer_se, direction="h2d", block_bytes=4 * KiB, batch=16,
                    ceiling_gbps=50.0, best="x",
                    candidates={"x": CandidateTiming("x", 10.0, None, over_best, best_se)},
                    resolved=ResolvedTiming(10.0 * over_best, "x"),
                    peer=PeerTiming(10.0, "x" if same_route else "y", same_route), repeats=41)


def bench_result(rows, summary):
    return BenchResult(kvswap_version="0", device={}, directions=["h2d"], measured="modelled", host_only=False,
                       timer="modelled", settings={}, peer_policy="", ceiling_gbps={"h2d": 50.0}, rows=rows,
                       summary={"h2d": summary})


def test_the_summary_counts_points_under_each_bar_and_those_beyond_the_noise():
    from kvswap.calibration.bench import summarize
    from kvswap.calibration.report import bench_report

    rows = [bench_row(1.0, 0.002, 1.2, 0.002, False),
            bench_row(0.995, 0.004, 0.995, 0.004, True),  # same route: under 1.0 by less than 2 SE
            bench_row(0.96, 0.004, 0.97, 0.004, False),  # under both bars by more than 2 SE
            bench_row(0.965, 0.004, 0.99, 0.006, False)]  # under both, within 2 SE of each
    s = summarize(rows)
    assert s.points == 4 and s.min_resolved_over_best == 0.96 and s.min_resolved_over_peer == 0.97
    assert (s.under_best_bar, s.under_best_bar_beyond_noise) == (2, 1)
    assert (s.under_peer, s.under_peer_beyond_noise, s.under_peer_same_route) == (3, 1, 1)
    text = bench_report(bench_result(rows, s))
    assert "0.995 ±0.008 =" in text  # the peer's own route is marked
    assert "0.970 ±0.008" in text and "0.970 ±0.008 =" not in text
    assert "2 under 0.97 x the best candidate (1 by more than 2 standard errors)" in text
    assert "3 under 1.0 x the peer (1 by more than 2 standard errors; 1 on the peer's own route)" in text
    # identical work: each row's resolved route "x" is also a candidate; the second's peer runs it too
    assert (s.same_work_pairs, s.same_work_min, s.same_work_max) == (5, 0.96, 1.0)
    assert "identical work timed 0.960-1.000 x apart (5 pairs" in text


def test_bench_passes_outvote_a_slow_spell_and_draw_fresh_slots(peer_named_device, monkeypatch):
    """Each point is drawn afresh and timed once per pass; a slow spell over a stretch of
    one pass moves the points it hits when the grid runs once, and none when it runs three
    times over."""
    from calibration_fakes import SpellTimer
    from kvswap.calibration import workload

    draws: list[tuple[int, int, bytes]] = []
    draw = workload.Pools.batch

    def recorded(self, direction, b, n):
        got = draw(self, direction, b, n)
        draws.append((b, n, got.src_off.tobytes() + got.dst_off.tobytes()))
        return got

    monkeypatch.setattr(workload.Pools, "batch", recorded)
    grid = dict(block_sizes=(4 * KiB, 64 * KiB), batch_sizes=(1, 16, 64), pool_bytes=32 * MiB, ceiling_bytes=MiB,
                repeats=3, warmup=0)

    def bench(passes, spell):
        timer = SpellTimer(peer_named_device.ledger, *spell)
        monkeypatch.setattr(bench_module, "make_timer", lambda device: timer)
        draws.clear()
        out = run_bench("modelplat:0", BenchSettings(**grid, passes=passes), ["h2d"])
        assert out.failures == []
        return {(r.block_bytes, r.batch): r for r in out.rows}, timer.count

    calm, calls = bench(3, (None,))
    assert calls == 1 + 3 * 6 and len(draws) == 3 * 6  # the ceiling, then each point once a pass
    for b, n in calm:
        if n >= 16:
            assert len({d for bb, nn, d in draws if (bb, nn) == (b, n)}) == 3
        assert calm[(b, n)].repeats == 3  # 3 timed calls a point in all: one a pass
    spell = (1 + 2, 2)  # the third and fourth points of the first pass
    assert bench(3, spell)[0] == calm
    once, _ = bench(1, (None,))
    slowed, _ = bench(1, spell)
    moved = [k for k in once if slowed[k].resolved.gbps != once[k].resolved.gbps]
    assert moved == [(4 * KiB, 64), (64 * KiB, 1)]
    for k in moved:
        assert slowed[k].resolved.gbps == pytest.approx(once[k].resolved.gbps / 1.5, rel=1e-3)
        assert slowed[k].resolved_over_best == pytest.approx(once[k].resolved_over_best, rel=1e-3)


def test_a_gpu_bench_draws_every_point_three_times_and_the_host_one_unless_told():
    from kvswap.calibration.bench import bench_settings

    assert (bench_settings(False).passes, bench_settings(True).passes) == (3, 1)
    assert bench_settings(False, passes=5).passes == 5


def test_bench_cli_passes_reach_the_grid(peer_named_device, monkeypatch, capsys):
    seen = []
    real = bench_module.run_bench

    def spy(device, settings, directions, **kw):
        seen.append(settings.passes)
        return real(device, settings, directions, **kw)

    monkeypatch.setattr(bench_module, "run_bench", spy)
    args = ["bench", "--device", "modelplat:0", "--directions", "h2d", "--block-bytes", "4096", "--batches", "1,16",
            "--repeats", "2"]
    assert main(args + ["--passes", "2"]) == 0
    assert main(args) == 0
    assert seen == [2, 1]  # the modelled device copies host memory: one pass by default, as on the host
    assert "kvswap bench" in capsys.readouterr().out
    assert main(args + ["--passes", "0"]) == 2 and len(seen) == 2  # refused before anything ran
    assert "--passes" in capsys.readouterr().err


class LowDrawTimer(LedgerTimer):
    """The ledger's costs, but the ``at``-th measurement (counting from 0) times its
    ``index``-th call ``factor`` times as long: one contender's unlucky draw at one point."""

    def __init__(self, ledger, at: int, index: int, factor: float = 1.1) -> None:
        super().__init__(ledger)
        self.at, self.index, self.factor, self.count = at, index, factor, 0

    def measure(self, calls, repeats, warmup=1):
        out = super().measure(calls, repeats, warmup)
        if self.count == self.at:
            out[self.index] = [t * self.factor for t in out[self.index]]
        self.count += 1
        return out


GRID = dict(block_sizes=(4 * KiB, 64 * KiB), batch_sizes=(1, 16, 64), pool_bytes=32 * MiB, ceiling_bytes=MiB,
            repeats=3, warmup=0)


def test_a_point_under_the_bar_by_its_draw_alone_is_timed_again_and_cleared(peer_named_device, monkeypatch, capsys):
    assert main(["calibrate", "--quick", "--device", "modelplat:0"]) == 0
    capsys.readouterr()
    # measurement 0 is the ceiling; 1 + 4 is the fifth point, 64 KiB x 16, whose contenders
    # are cuda.batch, triton.kernel@8, resolved (index 2) and the peer
    timer = LowDrawTimer(peer_named_device.ledger, at=1 + 4, index=2)
    monkeypatch.setattr(bench_module, "make_timer", lambda device: timer)
    out = run_bench("modelplat:0", BenchSettings(**GRID, confirm=2), ["h2d"])
    assert out.failures == []
    rows = {(r.block_bytes, r.batch): r for r in out.rows}
    low = rows[(64 * KiB, 16)]
    assert low.resolved_over_best == pytest.approx(1 / 1.1, rel=1e-3)  # the grid saw the unlucky draw
    assert low.confirm.passes == 2 and low.confirm.best == low.best
    assert low.confirm.resolved_over_best == pytest.approx(1.0, abs=1e-3)  # timed again: nothing wrong
    assert [k for k, r in rows.items() if r.confirm is not None] == [(64 * KiB, 16)]  # the others were not under a bar
    assert timer.count == 1 + 6 + 2  # the ceiling, the grid, then that one point twice
    s = out.summary["h2d"]
    assert (s.under_best_bar, s.under_best_bar_beyond_noise) == (1, 1)
    assert (s.confirmed_points, s.confirmed_under_best_bar, s.confirmed_under_best_bar_beyond_noise) == (1, 0, 0)
    from kvswap.calibration.report import bench_report
    text = bench_report(out)
    # modelled timings agree to the last digit: no "±0.000" that would say nothing
    assert "64 KiB x 16: res/best 0.909 -> 1.000 (" in text and "±0.000" not in text
    assert "of those 1: 0 still under 0.97 x the best candidate" in text


def test_a_resolved_route_that_is_wrong_stays_under_the_bar_when_timed_again(peer_named_device, monkeypatch):
    """Forced onto the batch route, resolved loses the kernel's points for real: the
    confirmation finds them under both bars again (the peer re-timed only where it takes
    another route: device to host it runs the batch route too)."""
    monkeypatch.setenv("KVSWAP_FORCE_IMPL", "cuda.batch")
    out = run_bench("modelplat:0", BenchSettings(**GRID, confirm=1), ["h2d", "d2h"])
    assert out.failures == []
    for r in out.rows:
        assert r.resolved.route == "cuda.batch"
        if r.resolved_over_best < 0.97:
            c = r.confirm
            assert c.resolved_over_best == pytest.approx(r.resolved_over_best, rel=1e-3)
            if r.peer.same_route:
                assert c.resolved_over_peer is None
            else:
                assert c.resolved_over_peer == pytest.approx(r.resolved_over_peer, rel=1e-3)
                assert c.resolved_over_peer < 1.0
        else:
            assert r.confirm is None
    for d in ("h2d", "d2h"):
        s = out.summary[d]
        assert s.under_best_bar >= 2
        assert s.confirmed_points == s.confirmed_under_best_bar_beyond_noise == s.under_best_bar
    assert out.summary["h2d"].confirmed_under_peer_beyond_noise >= 1
    assert out.summary["d2h"].confirmed_under_peer == 0


def test_confirmation_passes_default_to_three_on_a_gpu_and_reach_the_bench_from_the_cli(peer_named_device, monkeypatch,
                                                                                        capsys):
    from kvswap.calibration.bench import bench_settings

    assert (bench_settings(False).confirm, bench_settings(True).confirm, bench_settings(False, confirm=0).confirm) == (3, 1, 0)
    seen = []
    real = bench_module.run_bench
    monkeypatch.setattr(bench_module, "run_bench", lambda d, s, dirs, **kw: seen.append(s.confirm) or real(d, s, dirs, **kw))
    args = ["bench", "--device", "modelplat:0", "--directions", "h2d", "--block-bytes", "4096", "--batches", "16",
            "--repeats", "2"]
    assert main(args + ["--confirm", "0"]) == 0 and main(args) == 0
    assert seen == [0, 1]
    assert main(args + ["--confirm", "-1"]) == 2 and len(seen) == 2
    assert "--confirm" in capsys.readouterr().err


def test_the_peer_as_shipped_runs_the_policys_kernel_with_its_descriptors_packed_per_call():
    """The shipped peer's kernel route: the descriptors packed by numpy on every call (here
    read from host memory by Triton's interpreter; on a GPU uploaded by torch), every byte
    where the batch says, and nothing outside the blocks touched."""
    import numpy as np

    pytest.importorskip("triton")
    from kvswap.backends.triton_generic.launch import interpreting
    from kvswap.calibration.peer import UploadingKernel

    if not interpreting():
        pytest.skip("runs the kernel in Triton's CPU interpreter")
    rng = np.random.default_rng(7)
    block, n = 4 * KiB, 24
    src = np.frombuffer(rng.bytes(64 * block), dtype=np.uint8).copy()
    dst = np.frombuffer(rng.bytes(64 * block), dtype=np.uint8).copy()
    before = dst.copy()
    so, do = rng.permutation(64)[:n] * block, rng.permutation(64)[:n] * block
    sizes = np.full(n, block, dtype=np.int64)
    sizes[::5] = 1000  # a part of some blocks: the rest stays as it was
    UploadingKernel("h2d", None)(src.ctypes.data + so, dst.ctypes.data + do, sizes)
    expect = before.copy()
    for a, b, z in zip(so, do, sizes):
        expect[b:b + z] = src[a:a + z]
    assert np.array_equal(dst, expect)


def test_a_peer_as_shipped_never_counts_as_identical_work(peer_named_device, monkeypatch):
    """Where the peer runs as shipped, its calls cost what the policy's cost: even on the
    resolved route it is not the same work, so the bar applies at every point and no pair
    counts toward the run's noise floor."""
    from kvswap.calibration import peer as peer_module

    monkeypatch.setattr(bench_module, "shipped", lambda d, dev, device, host, sizes: peer_module.on_routes(
        d, dev, device, host, {"triton.kernel", "cuda.batch"}))
    s = BenchSettings(block_sizes=(4 * KiB, 64 * KiB), batch_sizes=(1, 16), pool_bytes=32 * MiB, ceiling_bytes=MiB,
                      repeats=2, warmup=0, confirm=0)
    out = run_bench("modelplat:0", s, ["h2d"])
    assert "as vLLM PR 42212 ships it" in out.peer_policy
    assert out.rows and all(r.peer is not None and not r.peer.same_route for r in out.rows)
    assert any(r.peer.route == r.resolved.route for r in out.rows)  # on the same route, still not identical work
    assert out.summary["h2d"].under_peer_same_route == 0
