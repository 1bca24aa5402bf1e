"""``kvswap calibrate`` measures the staged route on the block-major host it serves, on the
CPU (``triton.staged`` registered for the CPU by a test plugin, its kernels in Triton's
interpreter, its link the host reference): the profile's ``staged`` section, its host cost
and slowdown rows, ``--only staged --update``, and profiles with and without it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvswap import Curve, Direction
from kvswap.calibration import staged, store, update
from kvswap.calibration.decisions import Fitted
from kvswap.cli import main
from kvswap.registry.platform import cpu_device
from kvswap.registry.plugins import reset_plugin_host
from kvswap.resolution import profiles

from fakes import install_staged_on_cpu

pytest.importorskip("triton")
from kvswap.backends.triton_generic.launch import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the staged kernels in Triton's CPU interpreter")
KiB = 1024


@pytest.fixture
def staged_on_cpu():
    install_staged_on_cpu()
    yield
    reset_plugin_host(None)


def _staged_rows(doc, direction):
    return [r for r in doc["slowdown_by_sms"].get(direction, []) if r[0] in ("triton.staged", "staged")]


def test_calibrate_with_a_staged_route_writes_its_curve_and_host_cost(staged_on_cpu, tmp_path, capsys):
    out, png = tmp_path / "cpu.json", tmp_path / "cpu.png"
    assert main(["calibrate", "--device", "cpu", "--quick", "--out", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    doc = profiles.read(out, cpu_device())
    section = doc["staged"]
    assert section["host_layout"] == "block-major" and section["chunks_per_block"] == 4
    settings = staged.settings_for(cpu_device(), quick=True)
    assert {(c["direction"], c["impl"]) for c in section["curves"]} == {("h2d", "triton.staged"),
                                                                         ("d2h", "triton.staged")}
    for c in section["curves"]:
        assert [b for b, _ in c["points"]] == list(settings.chunk_sizes) and all(g > 0 for _, g in c["points"])
    # Never among the raw sweep's routes: measured on a block-major host, by chunk size.
    assert {c["impl"] for c in doc["curves"]} == {"host.reference"}
    for d in ("h2d", "d2h"):
        assert set(doc["host_cost"][d]) == {"host.reference", "triton.staged"}
        assert _staged_rows(doc, d) == []  # the slowdown comes with --interference
    assert "triton.staged (block-major host, 4 chunks a block): GB/s by chunk size" in printed
    raw = json.loads(store.measurements_path(out).read_text())
    recs = raw["staged_records"]
    assert {r["chunk_bytes"] for r in recs} == set(settings.chunk_sizes)
    assert all(r["bytes_checked"] == r["blocks"] * r["run_bytes"] for r in recs)
    assert {r["host_layout"] for r in raw["host_cost_records"] if r["route"] == "triton.staged"} == {"block-major"}
    cal = profiles.load(out)
    g = cal.predict("triton.staged", "staged", Direction.H2D, settings.chunk_sizes[0])
    assert g == pytest.approx(dict(section["curves"][1]["points"])[settings.chunk_sizes[0]])
    assert png.stat().st_size > 0


def test_update_adds_only_the_staged_route_to_a_profile_without_it(staged_on_cpu, tmp_path, capsys, monkeypatch):
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    # An older profile: no staged section, no staged host cost.
    doc.pop("staged")
    for d in doc["host_cost"].values():
        d.pop("triton.staged")
    doc["settings"]["host_cost"]["routes"]["h2d host.reference"] = "its note"
    out.write_text(json.dumps(doc))
    before = profiles.load(out)
    assert before.predict("triton.staged", "staged", Direction.D2H, 4 * KiB) is None  # still loads: no staged data
    capsys.readouterr()
    assert main(["calibrate", "--device", "cpu", "--quick", "--only", "staged", "--update", str(out)]) == 0
    printed = capsys.readouterr().out
    after = json.loads(out.read_text())
    assert f"profile {out} updated (staged)" in printed
    assert {c["impl"] for c in after["staged"]["curves"]} == {"triton.staged"}
    for d in ("h2d", "d2h"):
        assert after["host_cost"][d]["host.reference"] == doc["host_cost"][d]["host.reference"]  # kept
        assert set(after["host_cost"][d]) == {"host.reference", "triton.staged"}
        rows = _staged_rows(after, d)
        assert {r[0] for r in rows} == {"triton.staged", "staged"} and all(len(r) == 4 for r in rows)
    for key in ("curves", "decisions", "ceiling_gbps"):
        assert after[key] == doc[key]
    assert after["settings"]["host_cost"]["routes"]["h2d host.reference"] == "its note"  # a route not measured now
    assert profiles.load(out).predict("triton.staged", "staged", Direction.D2H, 4 * KiB) > 0


def test_a_profile_round_trips_its_staged_section_and_one_without_it_has_none(tmp_path):
    rng = np.random.default_rng(7)
    pts = [[b, float(round(rng.uniform(10, 60), 3))] for b in (4 * KiB, 16 * KiB, 64 * KiB)]
    section = {"curves": [{"impl": "triton.staged", "direction": "h2d", "num_sms": None, "points": pts}],
               "host_layout": "block-major", "chunks_per_block": 64, "source": staged.SOURCE}
    fitted = Fitted(staged=section)
    doc = store.make_document(cpu_device(), fitted, measured="test")
    doc["decisions"] = {}
    store.save(doc, tmp_path / "p.json")
    back = Fitted.from_dict(json.loads((tmp_path / "p.json").read_text()))
    assert back.staged == section
    assert [c.points for c in back.staged_curves("h2d")] == [tuple(map(tuple, pts))] and back.staged_curves("d2h") == []
    cal = profiles.load(tmp_path / "p.json")
    assert cal.predict("triton.staged", "staged", Direction.H2D, 16 * KiB) == pytest.approx(pts[1][1])
    assert cal.staged_chunks == 64  # the runs it was measured on, for a mover's shorter ones
    plain = store.make_document(cpu_device(), Fitted(), measured="test")
    assert "staged" not in plain  # a profile without a staged measurement has the older shape
    plain["decisions"] = {}
    store.save(plain, tmp_path / "old.json")
    old = profiles.load(tmp_path / "old.json")
    assert old.predict("triton.staged", "staged", Direction.H2D, 16 * KiB) is None and old.staged_chunks == 0


def test_a_staged_section_keeps_the_curves_this_run_did_not_measure():
    settings = staged.StagedSettings((4 * KiB,), 2, 4, 1 << 20, 1)
    before = staged.profile_section([{"direction": "d2h", "route": "triton.staged", "chunk_bytes": 4 * KiB,
                                      "gbps": 20.0}], settings)
    now = staged.profile_section([{"direction": "h2d", "route": "triton.staged", "chunk_bytes": 4 * KiB,
                                   "gbps": 30.0}], settings, before)
    assert [(c["direction"], c["points"]) for c in now["curves"]] == [("d2h", [[4 * KiB, 20.0]]),
                                                                      ("h2d", [[4 * KiB, 30.0]])]
    assert staged.curves([]) == [] and isinstance(staged.curves(
        [{"direction": "h2d", "route": "x", "chunk_bytes": 1, "gbps": 1.0}])[0], Curve)


def test_fresh_slowdown_rows_replace_only_the_routes_they_name():
    before = {"h2d": [["cuda.batch", 0, 0.1, 4096], ["triton.staged", 32, 0.3, 4096]], "d2h": [["x", 0, 0.0]]}
    fresh = {"h2d": [["triton.staged", 32, 0.02, 4096], ["staged", 32, 0.02, 4096]]}
    out = update.merged_rows(before, fresh)
    assert out["h2d"] == [["cuda.batch", 0, 0.1, 4096], ["triton.staged", 32, 0.02, 4096], ["staged", 32, 0.02, 4096]]
    assert out["d2h"] == before["d2h"]
