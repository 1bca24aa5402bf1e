"""Compute slowdown measured the engine's way, stored per direction and SM count, and
ranked by ``Policy(prefer="low_interference")``."""
from __future__ import annotations

import pytest

from kvswap import Calibration, Curve, Policy
from kvswap.cli import models
from kvswap.calibration import step_interference
from kvswap.calibration.step import HostEnv
from kvswap.errors import InvalidImplError
from kvswap.registry.platform import detect
from kvswap.registry.plugins import plugin_host
from kvswap.types import Direction

KiB = 1024


def test_measure_on_host_records_each_route_and_checks_its_bytes():
    calls = []
    env = HostEnv(lambda: calls.append(sum(range(3000))))
    dev = detect(plugin_host(), "cpu")
    cache = models.ModelShape("t", 2, 2, 16).at(1)
    records = step_interference.measure(env, dev, [Direction.H2D, Direction.D2H], reps=2, cache=cache,
                                        num_blocks=40)
    assert [(r["direction"], r["route"], r["kind"], r["num_sms"]) for r in records] == [
        ("h2d", "host.reference", "batch", 0), ("d2h", "host.reference", "batch", 0)]
    for r in records:
        assert "error" not in r, r
        assert 0.0 <= r["slowdown"] < 1 and r["compute_ratio"] > 0
        assert 1 <= r["blocks"] <= 20 and r["bytes_checked"] == 2 * r["blocks"] * cache.block_bytes
    rows = step_interference.profile_rows(records)
    assert set(rows) == {"h2d", "d2h"}
    assert {tuple(x[:2]) for x in rows["h2d"]} == {("batch", 0), ("host.reference", 0)}


def test_the_slowdown_is_the_throughput_lost_while_the_transfer_runs():
    # A 21 ms transfer beside 20 ms of compute that ends at 34 ms: over the 21 ms they
    # overlapped the compute did 7 ms of its work, so it ran at a third of its speed.
    assert step_interference.lost_fraction(0.020, 0.034, 0.021) == pytest.approx(14 / 21)
    # A transfer that outlasts the slowed compute overlapped all of it.
    assert step_interference.lost_fraction(0.020, 0.025, 0.030) == pytest.approx(0.2)
    assert step_interference.lost_fraction(0.020, 0.019, 0.010) == 0.0  # faster beside: no loss
    assert step_interference.lost_fraction(0.020, 0.080, 0.001) == 0.99  # capped below 1
    assert step_interference.lost_fraction(0.020, 0.030, 0.0) == 0.0


def test_the_batch_route_is_measured_again_at_other_block_sizes_and_its_rows_name_them():
    env = HostEnv(lambda: sum(range(3000)))
    dev = detect(plugin_host(), "cpu")
    main, other = models.ModelShape("t", 2, 2, 16).at(1), models.ModelShape("u", 2, 1, 128).at(1)
    assert (main.chunk_bytes, other.chunk_bytes) == (1 * KiB, 4 * KiB)
    records = step_interference.measure(env, dev, [Direction.H2D], reps=2, cache=main, num_blocks=40,
                                        by_size=[other], size_blocks=30)
    assert [(r["route"], r["kind"], r["chunk_bytes"]) for r in records] == [
        ("host.reference", "batch", 1 * KiB), ("host.reference", "batch", 4 * KiB)]
    assert all("error" not in r and r["bytes_checked"] > 0 for r in records)
    assert records[1]["bytes_checked"] == 2 * records[1]["blocks"] * other.block_bytes
    rows = step_interference.profile_rows(records)["h2d"]
    assert sorted((r[0], r[3]) for r in rows) == [("batch", 1 * KiB), ("batch", 4 * KiB),
                                                  ("host.reference", 1 * KiB), ("host.reference", 4 * KiB)]
    assert all(len(r) == 4 and r[1] == 0 for r in rows)


def test_profile_rows_keep_the_worse_of_a_repeated_route_and_skip_failures():
    recs = [
        {"direction": "h2d", "route": "triton.kernel", "kind": "kernel", "num_sms": 4, "slowdown": 0.1},
        {"direction": "h2d", "route": "triton.kernel", "kind": "kernel", "num_sms": 4, "slowdown": 0.2},
        {"direction": "h2d", "route": "triton.kernel", "kind": "kernel", "num_sms": 8, "error": "x"},
        {"direction": "d2h", "route": "cuda.batch", "kind": "batch", "num_sms": 0, "slowdown": 0.03},
    ]
    assert step_interference.profile_rows(recs) == {
        "h2d": [["kernel", 4, 0.2], ["triton.kernel", 4, 0.2]],
        "d2h": [["batch", 0, 0.03], ["cuda.batch", 0, 0.03]],
    }
    sized = [{"direction": "h2d", "route": "cuda.batch", "kind": "batch", "num_sms": 0, "slowdown": s,
              "chunk_bytes": b} for s, b in ((0.2, 16 * KiB), (0.25, 16 * KiB), (0.01, 32 * KiB))]
    assert step_interference.profile_rows(sized) == {"h2d": [
        ["batch", 0, 0.25, 16 * KiB], ["batch", 0, 0.01, 32 * KiB],
        ["cuda.batch", 0, 0.25, 16 * KiB], ["cuda.batch", 0, 0.01, 32 * KiB]]}


def cal(by_sms, slowdown=None):
    curves = [Curve(name, d, ((4 * KiB, gbps), (1 << 20, gbps)), num_sms=sms)
              for d in ("h2d", "d2h") for name, gbps, sms in (("cuda.batch", 40.0, None), ("triton.kernel", 48.0, 8))]
    return Calibration(source="test", platform="cuda", curves=curves, kernel_sms={"h2d": 8, "d2h": 8},
                       slowdown=slowdown or {"kernel": 0.5}, slowdown_by_sms=by_sms)


def test_slowdown_at_reads_per_direction_and_sm_count_and_falls_back():
    c = cal({"h2d": [["kernel", 4, 0.1], ["kernel", 12, 0.3], ["cuda.batch", 0, 0.02]],
             "d2h": [("triton.kernel", 8, 0.4)]})
    assert c.slowdown_at("triton.kernel", "kernel", Direction.H2D, 4) == pytest.approx(0.1)
    assert c.slowdown_at("triton.kernel", "kernel", "h2d", 8) == pytest.approx(0.2)  # between 4 and 12
    assert c.slowdown_at("triton.kernel", "kernel", "h2d", 2) == pytest.approx(0.1)
    assert c.slowdown_at("triton.kernel", "kernel", "h2d", 32) == pytest.approx(0.3)
    assert c.slowdown_at("cuda.batch", "batch", "h2d") == pytest.approx(0.02)
    assert c.slowdown_at("triton.kernel", "kernel", "d2h", 16) == pytest.approx(0.4)  # the impl's own row
    assert c.slowdown_at("cuda.batch", "batch", "d2h") == 0.0  # no rows, no kind entry: slowdown_of
    assert c.slowdown_at("other.kernel", "kernel", "d2h", 8) == 0.5  # slowdown_of by kind
    with pytest.raises(InvalidImplError, match="slowdown_by_sms"):
        cal({"h2d": [["kernel", 4, 1.5]]})
    with pytest.raises(InvalidImplError, match="slowdown_by_sms"):
        cal({"h2d": [["batch", 0, 0.1, 0]]})  # a block size of 0 bytes
    with pytest.raises(InvalidImplError, match="slowdown_by_sms"):
        cal({"h2d": [["kernel", "x"]]})


def test_rows_measured_at_block_sizes_answer_by_the_nearest_size():
    """The copy engines slowed host-to-device compute 20% at 16 KiB and 1% at 32 KiB: a
    size answers by the nearest measured (over log sizes); rows without a size by SMs."""
    c = cal({"h2d": [["cuda.batch", 0, 0.08, 4 * KiB], ["cuda.batch", 0, 0.2, 16 * KiB],
                     ["cuda.batch", 0, 0.01, 32 * KiB], ["kernel", 4, 0.3], ["kernel", 8, 0.4]]})
    at = lambda size: c.slowdown_at("cuda.batch", "batch", "h2d", size=size)  # noqa: E731
    assert [at(s * KiB) for s in (1, 4, 7, 9, 16, 18, 22, 23, 32, 512)] == pytest.approx(
        [0.08, 0.08, 0.08, 0.2, 0.2, 0.2, 0.2, 0.01, 0.01, 0.01])
    assert at(None) == pytest.approx(0.2)  # no size: the most any size measured
    assert c.slowdown_at("triton.kernel", "kernel", "h2d", 6, 32 * KiB) == pytest.approx(0.35)
    both = cal({"h2d": [["kernel", 4, 0.1, 4 * KiB], ["kernel", 8, 0.3, 4 * KiB], ["kernel", 4, 0.5, 64 * KiB]]})
    assert both.slowdown_at("triton.kernel", "kernel", "h2d", 6, 4 * KiB) == pytest.approx(0.2)
    assert both.slowdown_at("triton.kernel", "kernel", "h2d", 6, 64 * KiB) == pytest.approx(0.5)


def test_rates_weigh_the_batch_route_at_the_block_size_it_was_measured_at():
    """The same job shape at 16 and 32 KiB blocks: the copy engines' slowdown measured at
    each decides whether the route that takes no SMs ends the step sooner."""
    from kvswap.resolution.routing import rates, step_cost

    class Impl:
        def __init__(self, name, kind):
            self.name, self.kind, self.uses_sms = name, kind, kind == "kernel"

        def accepts_size(self, size):
            return True

    class Route:
        def host_line(self, name):
            return 100.0, 0.0

    # The batch route at 40 GB/s, the kernel at 48 on 8 SMs: at 16 KiB the batch route
    # slows the compute as much as the kernel and runs longer; at 32 KiB it slows it by 0.5%.
    c = cal({"h2d": [["cuda.batch", 0, 0.3, 16 * KiB], ["cuda.batch", 0, 0.005, 32 * KiB], ["kernel", 8, 0.3]]})
    kernel, batch = Impl("triton.kernel", "kernel"), Impl("cuda.batch", "batch")
    n = 2048
    for size, want in ((16 * KiB, "triton.kernel"), (32 * KiB, "cuda.batch")):
        got = rates(Route(), kernel, 8, [kernel, batch], c, Direction.H2D, size)
        assert [r.name for r in got] == ["triton.kernel", "cuda.batch"]
        assert got[1].slowdown == (0.3 if size == 16 * KiB else 0.005)
        assert got[1].seconds(n, n * size) == pytest.approx(n * size / 40e9 + 100e-6)
        ends = {r.name: step_cost(r.seconds(n, n * size), r.slowdown, 0.020) for r in got}
        assert min(ends, key=ends.get) == want


def test_low_interference_uses_slowdown_by_sms():
    """The kernel is 20% faster than the batch route; beside compute it costs 40% of the
    GEMMs on h2d but 5% on d2h: low_interference takes the batch route h2d only."""
    from kvswap.resolution.routing import rank

    class Impl:
        def __init__(self, name, kind):
            self.name, self.kind, self.uses_sms = name, kind, kind == "kernel"

        def accepts_size(self, size):
            return True

        accepts_range = accepts_size

    usable = [Impl("cuda.batch", "batch"), Impl("triton.kernel", "kernel")]
    c = cal({"h2d": [["kernel", 8, 0.4], ["batch", 0, 0.0]], "d2h": [["kernel", 8, 0.05], ["batch", 0, 0.0]]})
    low = Policy(prefer="low_interference")
    h2d = rank(usable, c, Direction.H2D, low, 16 * KiB, True, 8)
    d2h = rank(usable, c, Direction.D2H, low, 16 * KiB, True, 8)
    assert h2d[0][0].name == "cuda.batch" and d2h[0][0].name == "triton.kernel"
    assert rank(usable, c, Direction.H2D, Policy(), 16 * KiB, True, 8)[0][0].name == "triton.kernel"
    # at 4 SMs the h2d kernel would cost nothing measured: no row there, the nearest (8) holds
    assert rank(usable, c, Direction.H2D, low, 16 * KiB, True, 4)[0][0].name == "cuda.batch"


def test_render_prints_the_slowdown_table(tmp_path):
    import json
    import subprocess
    import sys

    recs = [{"direction": "h2d", "route": "triton.kernel", "kind": "kernel", "num_sms": 4, "slowdown": 0.125,
             "blocks": 900, "transfer_beside_ms": 21.0, "compute_beside_ms": 20.5, "covered": True,
             "chunk_bytes": 16 * KiB},
            {"direction": "d2h", "route": "cuda.batch", "kind": "batch", "num_sms": 0, "error": "DriverError: x",
             "chunk_bytes": 4 * KiB},
            {"direction": "d2h", "route": "triton.staged", "kind": "staged", "num_sms": 32, "slowdown": 0.02,
             "blocks": 700, "transfer_beside_ms": 22.0, "compute_beside_ms": 20.2, "covered": True,
             "chunk_bytes": 32 * KiB, "host_layout": "block-major"}]
    f = tmp_path / "i.json"
    f.write_text(json.dumps({"kind": "kvswap step interference", "device": "NVIDIA H200", "records": recs,
                             "slowdown_by_sms": step_interference.profile_rows(recs)}))
    out = subprocess.run([sys.executable, "-m", "kvswap", "bench", "--render", str(f)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| h2d | triton.kernel | per-layer | 4 | 16 KiB | 900 | 12.5% | 21.00 | 20.50 | yes |" in out.stdout
    assert "| d2h | cuda.batch | per-layer | - | 4 KiB | failed: DriverError: x |" in out.stdout
    assert "| d2h | triton.staged | block-major | 32 | 32 KiB | 700 | 2.0% | 22.00 | 20.20 | yes |" in out.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    out = subprocess.run([sys.executable, "-m", "kvswap", "bench", "--render", str(bad)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "is not the JSON of kvswap bench (its grid or --model)" in out.stderr


def test_a_job_is_sized_again_from_a_larger_probe_so_a_fixed_cost_does_not_leave_it_short(monkeypatch):
    """A route that spends 2 ms per job before its first byte: the 64-block probe alone would
    size a job of 8 ms beside 20 ms of compute; sized again from that job, it covers it."""
    import numpy as np

    fixed, per_block, compute = 0.002, 0.00001, 0.020
    stepped = []

    def transfer_alone(env, pools, mover, d, sid, did):
        return fixed + per_block * len(sid)

    def one_step(env, pools, mover, d, sid, did):
        stepped.append(len(sid))
        t = transfer_alone(env, pools, mover, d, sid, did)
        return 0.0, t, compute * 1.05, max(t, compute * 1.05)

    class Pools:
        num_blocks = 100_000

        def draw(self, rng, n):
            return np.arange(n), np.arange(n)

        def check(self, d, sid, did):
            return len(sid)

    monkeypatch.setattr(step_interference, "transfer_alone", transfer_alone)
    monkeypatch.setattr(step_interference, "compute_alone", lambda env: compute)
    monkeypatch.setattr(step_interference, "one_step", one_step)
    first = step_interference.cover_blocks(64, transfer_alone(None, None, None, None, range(64), None), compute,
                                           64, 50_000)
    assert fixed + per_block * first < compute  # the probe's estimate alone falls short
    rec = step_interference._measure_route(None, Pools(), None, Direction.H2D, 3, np.random.default_rng(0))
    assert rec["covered"] and stepped == [rec["blocks"]] * 3 and rec["blocks"] > first
    assert rec["slowdown"] == pytest.approx(1 / 21, abs=1e-3)  # 1 ms lost over all 21 ms of the compute


def test_a_contiguous_copy_is_a_reference_row_not_a_route():
    """The contiguous copy measured beside each staged row stays out of the profile (it is no
    route the resolver could rank) and shows as the staged bar's floor in the report."""
    from kvswap.calibration import step_report

    staged = {"direction": "h2d", "route": "triton.staged", "kind": "staged", "num_sms": 32, "slowdown": 0.09,
              "blocks": 900, "transfer_beside_ms": 24.0, "compute_beside_ms": 21.5, "covered": True,
              "chunk_bytes": 4 * KiB, "host_layout": "block-major"}
    floor = dict(staged, route="contiguous copy", kind="contiguous", num_sms=0, slowdown=0.071)
    other = dict(floor, direction="d2h", slowdown=-0.004)
    rows = step_interference.profile_rows([staged, floor, other])
    assert rows == {"h2d": [["staged", 32, 0.09, 4 * KiB], ["triton.staged", 32, 0.09, 4 * KiB]]}
    (bar,) = [b for b in step_report.bars([], [{"records": [staged, floor, other]}]) if "slowdown" in b["bar"]]
    assert bar["cases"] == 1 and bar["ok"] is False and bar["worst"] == 0.09
    assert bar["note"] == "a contiguous copy of the same bytes beside the same compute: -0.4% to 7.1%"
    table = step_report.interference_markdown({"device": "d", "records": [staged, floor]})
    assert "| h2d | contiguous copy | block-major | - | 4 KiB | 900 | 7.1% |" in table
