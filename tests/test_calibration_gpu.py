"""Calibration on a real GPU (``pytest -m gpu``): pools, checks, sweep, host cost, interference, bench.

No timed assertions: these check that every GPU code path runs, measures something
positive, copies the right bytes, and yields a profile the resolver reads.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

import kvswap
from kvswap.resolution import profiles
from kvswap.calibration import fit, store, update
from kvswap.calibration.bench import bench_settings, run_bench
from kvswap.calibration.plot import plot_profile
from kvswap.calibration.records import CEILING, SIZE
from kvswap.calibration.sweep import Settings, Sweep
from kvswap.calibration.timing import DeviceTimer
from kvswap.calibration.workload import Pools, WrongResult
from kvswap.registry.plugins import plugin_host

pytestmark = pytest.mark.gpu

KiB, MiB = 1024, 1 << 20


def usable(direction: str) -> dict[str, str]:
    return {c.name: c.kind for c in kvswap.resolve(direction).plan.candidates if c.available}


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_pools_check_catches_a_missing_copy_and_passes_a_real_one(direction):
    dev = kvswap.resolve(direction).plan.device
    pools, timer = Pools(dev, 16 * MiB, seed=3), DeviceTimer(dev)
    assert pools.host.is_pinned() and pools.dev.is_cuda
    batch = pools.batch(direction, 16 * KiB, 100)
    with pytest.raises(WrongResult):
        pools.verify(timer, lambda stream: None, batch)  # copies nothing
    fn = kvswap.resolve(direction, block_bytes=16 * KiB)
    pools.verify(timer, lambda stream: fn(batch.src, batch.dst, batch.sizes, stream=stream), batch)
    t = timer.measure([lambda stream: fn(batch.src, batch.dst, batch.sizes, stream=stream)], repeats=3, warmup=1)
    assert len(t[0]) == 3 and all(x > 0 for x in t[0])


def test_sweep_host_cost_and_interference_yield_a_profile_the_resolver_reads(tmp_path):
    s = Settings(block_sizes=(4 * KiB, 64 * KiB), sm_counts=(2, 8), batch_sizes=(1, 64), batch_sweep_blocks=1,
                 size_sweep_bytes=16 * MiB, max_batch=4096, pool_bytes=256 * MiB, ceiling_bytes=64 * MiB,
                 repeats=3, warmup=1)
    result = Sweep(None, s, ["h2d", "d2h"]).run()
    assert result.failures == [], [f.describe() for f in result.failures]
    for d in ("h2d", "d2h"):
        want = set()
        for name, kind in usable(d).items():
            if kind == "staged":  # measured over a block-major host, not on raw descriptors
                continue
            want |= {(name, k, b) for k in ((2, 8) if kind == "kernel" else (None,)) for b in (4 * KiB, 64 * KiB)}
        got = {(m.impl, m.num_sms, m.block_bytes) for m in result.measurements if m.direction == d and m.stage == SIZE}
        assert got == want
        assert any(m.stage == CEILING and m.direction == d for m in result.measurements)
    assert all(m.gbps > 0 for m in result.measurements)
    dirs = [kvswap.Direction.H2D, kvswap.Direction.D2H]
    got = update.measure(update.PARTS, result.device, None, plugin_host(), dirs, quick=True)
    assert got.failures.records == [], [f.describe() for f in got.failures.records]
    for d in ("h2d", "d2h"):
        held = [r for r in got.host_cost_records if r["direction"] == d]
        assert {r["route"] for r in held} == set(usable(d))
        assert all(r["held_us"] > 0 and r["bytes_checked"] > 0 and r["tensors_a_side"] == 80 for r in held)
        inter = [r for r in got.interference if r["direction"] == d]
        assert inter and all("error" not in r and 0 <= r["slowdown"] < 1 for r in inter)
    fitted = fit.profile_fields(result.measurements, got.interference, ["h2d", "d2h"], host_cost=got.host_cost)
    doc = store.make_document(result.device, fitted, measurements=result.measurements,
                              interference=got.interference, host_cost_records=got.host_cost_records,
                              host_reference=False)
    profile, raw = store.split(doc)
    path = store.save(profile, tmp_path / "gpu.json")
    store.save_measurements(raw, store.measurements_path(path))
    assert store.read_measurements(store.measurements_path(path)) == (result.measurements, got.interference)
    assert plot_profile(fitted, tmp_path / "gpu.png").stat().st_size > 0
    cal = profiles.load(path, result.device)
    assert cal.slowdown_by_sms and set(cal.host_cost) == {"h2d", "d2h"}  # measured, not carried over
    assert doc["slowdown_source"] == fit.SLOWDOWN_MEASURED and doc["host_cost_source"] == fit.HOST_COST_MEASURED
    text = kvswap.resolve("h2d", calibration=cal, block_bytes=4 * KiB).explain()
    assert "holds the calling thread for 2048 descriptors" in text


def test_update_rewrites_a_profile_with_host_cost_only(tmp_path, capsys):
    from kvswap.cli import main

    dev = kvswap.resolve("h2d").plan.device
    shipped = profiles.shipped_dir() / profiles.profile_name(dev.identity)
    if not shipped.exists():
        pytest.skip(f"no shipped profile for {dev.identity}")
    path = tmp_path / shipped.name
    path.write_text(shipped.read_text())
    before = profiles.read(path)
    assert main(["calibrate", "--only", "host-cost", "--update", str(path), "--quick"]) == 0
    after = profiles.read(path)
    assert set(after["host_cost"]) == {"h2d", "d2h"} and after["curves"] == before["curves"]
    assert "holds the calling thread" in capsys.readouterr().out


def test_bench_small_grid_has_ratios_and_the_peer():
    s = replace(bench_settings(False, [4 * KiB, 64 * KiB], [1, 64], repeats=3), pool_bytes=64 * MiB,
                ceiling_bytes=32 * MiB)
    out = run_bench(None, s, ["h2d", "d2h"])
    assert out.failures == [] and len(out.rows) == 8
    for row in out.rows:
        assert row.resolved.gbps > 0 and row.resolved_over_best > 0
        if {"triton.kernel", "cuda.batch"} <= set(usable(row.direction)):
            assert row.peer.gbps > 0 and row.resolved_over_peer > 0



def test_bench_times_points_under_the_bar_again_checking_every_copy(monkeypatch):
    """With the bar raised out of reach every point is under it, so every point is timed
    again after the grid (no timed assertion: which points a real bar catches is the
    machine's business), each copy checked byte for byte again."""
    from kvswap.calibration import bench as bench_module

    monkeypatch.setattr(bench_module, "BAR_BEST", 1e9)
    s = replace(bench_settings(False, [4 * KiB, 64 * KiB], [1, 64], repeats=3, passes=1, confirm=2),
                pool_bytes=64 * MiB, ceiling_bytes=32 * MiB)
    out = run_bench(None, s, ["h2d", "d2h"])
    assert out.failures == [] and len(out.rows) == 4 * 2
    for row in out.rows:
        again = row.confirm
        assert again.passes == 2 and again.best == row.best
        assert again.resolved_over_best > 0
    for d in ("h2d", "d2h"):
        assert out.summary[d].confirmed_points == 4
