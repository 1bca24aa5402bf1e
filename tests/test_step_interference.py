"""Compute slowdown measured the engine's way, stored per direction and SM count, and
ranked by ``Policy(prefer="low_interference")``."""
from __future__ import annotations

import pytest

from kvswap import Calibration, Curve, Policy, models
from kvswap.calibration import step_interference
from kvswap.calibration.step import HostEnv
from kvswap.errors import InvalidImplError
from kvswap.platform import detect
from kvswap.plugins import plugin_host
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
        cal({"h2d": [["kernel", "x"]]})


def test_low_interference_uses_slowdown_by_sms():
    """The kernel is 20% faster than the batch route; beside compute it costs 40% of the
    GEMMs on h2d but 5% on d2h: low_interference takes the batch route h2d only."""
    from kvswap.routing import rank

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
             "blocks": 900, "transfer_beside_ms": 21.0, "compute_beside_ms": 20.5, "covered": True},
            {"direction": "d2h", "route": "cuda.batch", "kind": "batch", "num_sms": 0, "error": "DriverError: x"}]
    f = tmp_path / "i.json"
    f.write_text(json.dumps({"kind": "kvswap step interference", "device": "NVIDIA H200", "records": recs,
                             "slowdown_by_sms": step_interference.profile_rows(recs)}))
    out = subprocess.run([sys.executable, "-m", "kvswap", "bench", "--render", str(f)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| h2d | triton.kernel | 4 | 900 | 12.5% | 21.00 | 20.50 | yes |" in out.stdout
    assert "| d2h | cuda.batch | - | failed: DriverError: x |" in out.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    out = subprocess.run([sys.executable, "-m", "kvswap", "bench", "--render", str(bad)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "is not the JSON of kvswap bench --model" in out.stderr
