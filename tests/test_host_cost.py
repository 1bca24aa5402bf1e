"""Each route's host cost per call: measured on the CPU for real (the host reference copies
inside the call), fitted, stored in a profile, read back, shown, and written by
``kvswap calibrate`` and ``kvswap calibrate --only ... --update``."""
from __future__ import annotations

import json
import re
import pytest

from kvswap import CopyImpl, Direction, ProfileWarning, hookimpl
from kvswap.cli import models
from kvswap.resolution import profiles
from kvswap.calibration import fit, host_cost, store
from kvswap.calibration.binding import Failures
from kvswap.calibration.step_workload import HostEnv
from kvswap.cli import main
from kvswap.registry.platform import detect
from kvswap.registry.plugins import create_plugin_host, plugin_host
from kvswap.registry.reference import host_copy

KiB = 1024
BOTH = [Direction.H2D, Direction.D2H]


@pytest.fixture(autouse=True)
def no_interpreted_kernel(monkeypatch):
    # The suite's Triton interpreter would make triton.kernel a CPU route; a real CPU has none.
    monkeypatch.setenv("KVSWAP_DISABLE_PLUGINS", "triton")


def small_settings(**kw):
    base = dict(counts=(8, 32, 128), workload=("llama-3.1-70b", 8), reps=3, scratch_bytes=1 << 20)
    return host_cost.HostCostSettings(**(base | kw))


def cpu():
    return detect(plugin_host(), "cpu")


def test_fit_line_is_exact_on_a_line_and_robust_to_one_disturbed_count():
    pts = [(n, 20.0 + 0.5 * n) for n in (64, 256, 1024, 4096, 16384)]
    assert host_cost.fit_line(pts) == pytest.approx((20.0, 0.5))
    pts[2] = (1024, 50_000.0)  # one count caught a slow spell of the machine
    a, b = host_cost.fit_line(pts)
    assert b == pytest.approx(0.5, rel=0.05) and a < 200
    assert host_cost.fit_line([(100, 5.0)]) == (5.0, 0.0)
    assert host_cost.fit_line([(10, 50.0), (100, 20.0)]) == (35.0, 0.0)  # never a negative slope


def test_measure_on_the_cpu_times_real_copies_over_per_layer_tensors_and_checks_every_byte():
    cache = models.ModelShape("t", 6, 2, 16).at(1)  # 6 tensors a side, 2 chunks of 512 B a block
    records = host_cost.measure(HostEnv(lambda: None), cpu(), BOTH, small_settings(), cache=cache)
    per_block = cache.descriptors_per_block
    assert {(r["direction"], r["route"]) for r in records} == {("h2d", "host.reference"), ("d2h", "host.reference")}
    for r in records:
        blocks = r["descriptors"] // per_block
        assert r["descriptors"] % per_block == 0 and r["tensors_a_side"] == 6 and r["reps"] == 3
        assert r["held_us"] > 0 and r["bytes_checked"] == blocks * cache.block_bytes
    counts = sorted(r["descriptors"] for r in records if r["direction"] == "h2d")
    assert counts == [12, 36, 132]  # 8, 32 and 128 rounded to whole blocks of 12 descriptors
    field = host_cost.profile_field(records)
    assert set(field) == {"h2d", "d2h"}
    a, b = field["h2d"]["host.reference"]
    assert a >= 0 and b > 0  # the host reference copies inside the call: more descriptors, more time


def noted(ctx):
    def fn(src, dst, sizes, stream):
        host_copy(src, dst, sizes)
    fn.note = "copies on the caller's thread"
    return fn


class Acme:
    """Beside the host reference: a route that returns without copying, and one that copies
    and says where it issues from."""

    @hookimpl
    def kvswap_register_copy_impls(self, platform, register):
        if platform == "cpu":
            register(CopyImpl("acme.nothing", "batch", ("cpu",), ("h2d", "d2h"), lambda ctx: lambda *a: None))
            register(CopyImpl("acme.noted", "batch", ("cpu",), ("h2d", "d2h"), noted))


def test_a_route_that_copies_nothing_is_a_failure_not_a_number_and_notes_are_kept():
    host = create_plugin_host(entry_points=[], env={}, extra=[("acme", Acme())])
    failures = Failures()
    cache = models.ModelShape("t", 2, 2, 16).at(1)
    records = host_cost.measure(HostEnv(lambda: None), cpu(), [Direction.H2D], small_settings(counts=(4,)),
                                host=host, cache=cache, failures=failures)
    assert sorted(r["route"] for r in records) == ["acme.noted", "host.reference"]
    assert [(f.impl, f.direction) for f in failures.records] == [("acme.nothing", "h2d")]
    assert "does not hold source block" in failures.records[0].error
    assert host_cost.route_notes(records) == {"h2d acme.noted": "copies on the caller's thread"}


def profile_doc(**extra):
    from test_calibration_fit import DEVICE, synthetic_run

    return store.make_document(DEVICE, fit.profile_fields(synthetic_run(), [], ["h2d", "d2h"]), **extra), DEVICE


def test_a_profile_holds_host_cost_and_the_resolver_reads_it(tmp_path):
    doc, dev = profile_doc()
    doc["host_cost"] = {"h2d": {"x.batch": [12.5, 0.4]}, "d2h": {"x.batch": [10.0, 0.3], "x.kernel": [30.0, 0.01]}}
    path = store.save(doc, tmp_path / "p.json")
    cal = profiles.load(path, dev)
    assert cal.host_cost == {"h2d": (("x.batch", 12.5, 0.4),),
                             "d2h": (("x.batch", 10.0, 0.3), ("x.kernel", 30.0, 0.01))}
    assert cal.host_us("x.batch", "batch", "h2d", 1000) == pytest.approx(412.5)


@pytest.mark.parametrize("bad", [[-1.0, 0.4], [1.0, -0.4], [1.0], "ab", [True, 0.1], None, [1.0, 0.1, 3.0]])
def test_a_bad_host_cost_entry_is_skipped_with_a_warning_and_the_rest_is_used(tmp_path, bad):
    doc, dev = profile_doc()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc | {"host_cost": {"h2d": {"x.batch": bad, "x.kernel": [30.0, 0.01]}}}))
    with pytest.warns(ProfileWarning, match=r"skipped host_cost\['h2d'\]\['x.batch'\]"):
        cal = profiles.load(path, dev)
    assert cal.host_cost == {"h2d": (("x.kernel", 30.0, 0.01),)}


def test_a_non_finite_host_cost_skips_the_profile_like_any_non_finite_number(tmp_path, monkeypatch):
    doc, dev = profile_doc()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc | {"host_cost": {"h2d": {"x.batch": [1.0, 0.5]}}}).replace("0.5]", "1e400]"))
    monkeypatch.setenv(profiles.PROFILE_ENV, str(path))
    with pytest.warns(ProfileWarning, match="not finite"):
        assert profiles.find(dev) is None


def test_a_host_cost_that_is_not_an_object_makes_the_profile_unusable(tmp_path):
    doc, dev = profile_doc()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc | {"host_cost": [1, 2]}))
    with pytest.raises(profiles.ProfileError, match="host_cost"):
        profiles.load(path, dev)


def test_calibrate_on_the_cpu_writes_host_cost_and_interference_and_explain_shows_it(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--quick", "--interference", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "host.reference: holds the calling thread" in printed
    doc = profiles.read(out)
    assert set(doc["host_cost"]) == {"h2d", "d2h"} and doc["host_cost_source"] == fit.HOST_COST_MEASURED
    assert set(doc["slowdown_by_sms"]) == {"h2d", "d2h"} and "slowdown" not in doc
    assert doc["settings"]["host_cost"]["counts"] and doc["settings"]["interference"]["sm_counts"]
    raw = json.loads(store.measurements_path(out).read_text())
    assert {r["route"] for r in raw["host_cost_records"]} == {"host.reference"} and raw["interference"]
    monkeypatch.setenv(profiles.PROFILE_ENV, str(out))
    assert main(["explain", "--direction", "h2d"]) == 0
    explained = capsys.readouterr().out
    assert "holds the calling thread for 2048 descriptors: host.reference ~" in explained
    assert "host thread time per call: unmeasured" not in explained


def test_update_measures_only_the_named_parts_and_keeps_everything_else(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--quick", "--directions", "h2d", "--out", str(out)]) == 0
    capsys.readouterr()
    before = profiles.read(out)
    before_raw = json.loads(store.measurements_path(out).read_text())
    doc = dict(before, host_cost={}, slowdown={"kernel": 0.5})  # as a profile made before both fields
    doc.pop("slowdown_by_sms")
    store.save(doc, out)
    assert main(["calibrate", "--only", "host-cost,interference", "--update", str(out), "--quick",
                 "--directions", "h2d"]) == 0
    printed = capsys.readouterr()
    assert "host.reference: holds the calling thread" in printed.out and f"profile {out} updated" in printed.out
    assert re.search(r"\d+/\d+ steps", printed.err)  # the progress lines
    after = profiles.read(out)
    assert set(after["host_cost"]) == {"h2d"} and after["host_cost_source"] == fit.HOST_COST_MEASURED
    assert set(after["slowdown_by_sms"]) == {"h2d"} and "slowdown" not in after  # the older number is gone
    changed = {"host_cost", "host_cost_source", "slowdown", "slowdown_by_sms", "slowdown_source", "settings",
               "notes", "decisions", "failures"}
    assert {k: v for k, v in after.items() if k not in changed} == {
        k: v for k, v in before.items() if k not in changed}
    assert after["notes"][-1].startswith("host-cost, interference measured again for h2d")
    assert not set(store.RAW_FIELDS) & set(after)  # stripped, as --strip does
    raw = json.loads(store.measurements_path(out).read_text())
    assert raw["measurements"] == before_raw["measurements"]  # the sweep's rows stay
    assert raw["host_cost_records"] and raw["interference"]


def test_update_refuses_another_devices_profile_and_lone_flags(tmp_path, capsys):
    doc, _ = profile_doc()
    path = store.save(doc, tmp_path / "other.json")
    assert main(["calibrate", "--only", "host-cost", "--update", str(path)]) == 2
    assert "is the profile of 'cuda-synthetic-gpu-16cu'" in capsys.readouterr().err
    assert main(["calibrate", "--only", "host-cost"]) == 2
    assert "--only and --update go together" in capsys.readouterr().err
    assert main(["calibrate", "--update", str(path)]) == 2
    assert main(["calibrate", "--only", "speed", "--update", str(path)]) == 2
    assert "name one or more of host-cost, interference" in capsys.readouterr().err
    missing = tmp_path / "none.json"
    assert main(["calibrate", "--only", "host-cost", "--update", str(missing)]) == 2
    assert "is not a profile kvswap can read" in capsys.readouterr().err


def test_help_names_the_parts_and_the_update(capsys):
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--only PARTS" in text and "--update PROFILE" in text and "host-cost, interference" in text
    assert "holds the calling thread" in text and "started together" in text


def test_when_the_parts_cannot_run_calibrate_keeps_its_sweep_and_update_leaves_the_file_alone(
        tmp_path, capsys, monkeypatch):
    from kvswap.calibration import update

    def broken(dev):
        raise RuntimeError("out of device memory")

    out = tmp_path / "cpu.json"
    monkeypatch.setattr(update, "make_env", broken)
    assert main(["calibrate", "--quick", "--directions", "d2h", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped d2h host-cost: RuntimeError: out of device memory" in printed
    doc = profiles.read(out)
    assert doc["host_cost"] == {} and "not measured" in doc["host_cost_source"]
    text = out.read_text()
    assert main(["calibrate", "--only", "host-cost", "--update", str(out), "--directions", "d2h"]) == 1
    assert "nothing could be measured" in capsys.readouterr().err
    assert out.read_text() == text


def test_update_of_a_part_no_route_here_serves_says_so(tmp_path, capsys, monkeypatch):
    from kvswap.calibration import staged

    out = tmp_path / "cpu.json"
    assert main(["calibrate", "--quick", "--directions", "d2h", "--out", str(out)]) == 0
    capsys.readouterr()
    text = out.read_text()
    monkeypatch.setattr(staged, "staged_impl", lambda *args: None)  # no staged route on this device
    assert main(["calibrate", "--only", "staged", "--update", str(out), "--directions", "d2h"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvswap: error: nothing could be measured: no route here serves staged")
    assert out.read_text() == text
