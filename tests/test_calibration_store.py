"""Profiles on disk: round trip, schema and identity checks, bad files skipped with a
warning naming them, and the lookup order KVSWAP_PROFILE -> user dir -> shipped."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import kvswap
from kvswap import ProfileWarning
from kvswap.resolution import profiles
from kvswap.calibration import store
from kvswap.registry.platform import cpu_device

CPU = cpu_device()


def profile(device=CPU, sms: int = 6, gbps: float = 3.0) -> dict:
    """A small valid profile: one batch curve per direction, a kernel knee of ``sms``."""
    curves = [{"impl": "host.reference", "direction": d, "num_sms": None,
               "points": [[4096, gbps], [65536, 10 * gbps]]} for d in ("h2d", "d2h")]
    decisions = {d: {"kernel_sms": sms, "kernel_min_batch": 32, "routes": []} for d in ("h2d", "d2h")}
    return store.make_document(device, measured="test", measurements=[], curves=curves, decisions=decisions,
                               ceiling_gbps={"h2d": 50.0, "d2h": 51.0}, slowdown={"batch": 0.1})


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    folder = tmp_path / "shipped"
    folder.mkdir()
    monkeypatch.setattr(profiles, "shipped_dir", lambda: folder)
    return folder


def test_round_trip(tmp_path):
    doc = profile()
    path = store.save(doc, tmp_path / "deep" / "p.json")
    assert profiles.read(path, CPU) == doc
    cal = profiles.load(path, CPU)
    assert (cal.source, cal.identity, cal.platform, cal.scope) == (f"profile {path}", CPU.identity, "cpu", "device")
    assert cal.kernel_sms == {"h2d": 6, "d2h": 6} and cal.kernel_min_batch == {"h2d": 32, "d2h": 32}
    assert cal.ceiling_gbps == {"h2d": 50.0, "d2h": 51.0} and dict(cal.slowdown) == {"batch": 0.1}
    assert cal.predict("host.reference", "batch", "h2d", 65536) == 30.0
    assert doc["schema"] == profiles.SCHEMA and doc["kvswap_version"] == kvswap.__version__
    assert doc["device"] == json.loads(json.dumps(CPU.to_dict()))
    assert os.stat(path).st_mode & 0o777 == 0o644
    text = path.read_text()
    assert "[4096, 3.0]" in text  # curve points one per line, the file stays readable


@pytest.mark.parametrize("change, why", [
    (lambda d: d.update(schema="kvswap.profile/0"), "schema is 'kvswap.profile/0'"),
    (lambda d: d.pop("decisions"), "KeyError"),
    (lambda d: d["curves"][0].update(points=[[4096, -1.0]]), "finite GB/s >= 0"),
    (lambda d: d["device"].update(identity="someone-else"), "does not match the device"),
    (lambda d: d["decisions"].update(sideways={"kernel_sms": 2}), "direction='sideways'"),
])
def test_save_refuses_what_could_not_be_read_back_and_keeps_the_old_file(tmp_path, change, why):
    path = store.save(profile(), tmp_path / "p.json")
    before = path.read_text()
    doc = profile(sms=9)
    change(doc)
    with pytest.raises(profiles.ProfileError, match=why):
        store.save(doc, path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # no temporary file left


def test_load_refuses_a_profile_for_another_device(tmp_path):
    other = kvswap.DeviceInfo(platform="cpu", name="other", identity="cpu-other", compute_units=1)
    path = store.save(profile(other), tmp_path / "p.json")
    with pytest.raises(profiles.ProfileError, match="is for device 'cpu-other'"):
        profiles.load(path, CPU)


def test_lookup_order_env_then_user_dir_then_shipped(tmp_path, monkeypatch, shipped):
    env = store.save(profile(sms=3), tmp_path / "env.json")
    user = store.save(profile(sms=5), profiles.default_path(CPU))
    ship = store.save(profile(sms=7), shipped / profiles.profile_name(CPU.identity))
    assert user.is_relative_to(os.environ["XDG_DATA_HOME"])  # the user data dir (conftest's per-test XDG)
    monkeypatch.setenv(profiles.PROFILE_ENV, str(env))
    assert profiles.find(CPU).kernel_sms["h2d"] == 3
    monkeypatch.delenv(profiles.PROFILE_ENV)
    assert profiles.find(CPU).kernel_sms["h2d"] == 5
    user.unlink()
    assert profiles.find(CPU).kernel_sms["h2d"] == 7
    ship.unlink()
    assert profiles.find(CPU) is None


def test_resolver_and_explain_name_the_profile_used(monkeypatch, shipped):
    path = store.save(profile(), profiles.default_path(CPU))
    fn = kvswap.resolve("h2d", device="cpu")
    assert fn.plan.calibration["source"] == f"profile {path}" and fn.plan.calibration["calibrated"]
    assert f"calibration: profile {path} (measured)" in fn.explain()


def test_explain_says_a_shipped_profile_was_measured_on_another_machine(monkeypatch, shipped):
    ship = store.save(profile(), shipped / profiles.profile_name(CPU.identity))
    explained = kvswap.resolve("h2d", device="cpu").explain()
    assert f"calibration: profile {ship} (measured on another machine of this kind" in explained
    assert "`kvswap calibrate` measures this one" in explained
    user = store.save(profile(), profiles.default_path(CPU))  # this machine's own comes first
    explained = kvswap.resolve("h2d", device="cpu").explain()
    assert f"calibration: profile {user} (measured)" in explained and "another machine" not in explained


def bad_files(tmp_path):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"schema": "kvswap.profile/1", "identity": ')
    foreign = store.save(profile(kvswap.DeviceInfo(platform="cpu", name="x", identity="cpu-elsewhere",
                                                   compute_units=1)), tmp_path / "foreign.json")
    old = tmp_path / "old.json"
    old.write_text(json.dumps(dict(profile(), schema="kvswap.profile/0")))
    return {corrupt: "cannot be read as JSON", foreign: "is for device 'cpu-elsewhere'",
            old: "schema is 'kvswap.profile/0'", tmp_path / "missing.json": "cannot be read as JSON"}


def test_bad_env_profiles_are_skipped_with_a_warning_naming_the_file(tmp_path, monkeypatch, shipped):
    user = store.save(profile(sms=5), profiles.default_path(CPU))
    for path, why in bad_files(tmp_path).items():
        monkeypatch.setenv(profiles.PROFILE_ENV, str(path))
        with pytest.warns(ProfileWarning) as caught:
            cal = profiles.find(CPU)
        assert cal.source == f"profile {user}"  # the next place in the lookup order
        (w,) = caught
        assert str(path) in str(w.message) and why in str(w.message)


def test_a_corrupt_user_profile_falls_through_to_the_shipped_one(tmp_path, shipped):
    ship = store.save(profile(sms=7), shipped / profiles.profile_name(CPU.identity))
    user = profiles.default_path(CPU)
    user.parent.mkdir(parents=True)
    user.write_text("not json at all")
    with pytest.warns(ProfileWarning, match=f"skipped calibration profile {user}: cannot be read"):
        cal = profiles.find(CPU)
    assert cal.source == f"profile {ship}"


def test_a_foreign_profile_under_this_devices_name_is_skipped_by_the_resolver(shipped):
    other = kvswap.DeviceInfo(platform="cpu", name="x", identity="cpu-elsewhere", compute_units=1)
    path = store.save(profile(other), profiles.default_path(CPU))  # the wrong device's profile, this name
    with pytest.warns(ProfileWarning, match=f"{path}: is for device 'cpu-elsewhere'"):
        fn = kvswap.resolve("d2h", device="cpu")
    assert "profile" not in fn.plan.calibration["source"]  # the backend defaults instead


def test_user_dir_follows_xdg_and_without_platformdirs_is_skipped_with_a_warning(monkeypatch, shipped):
    assert profiles.user_dir() == Path(os.environ["XDG_DATA_HOME"]) / "kvswap" / "profiles"
    store.save(profile(sms=5), profiles.default_path(CPU))
    assert profiles.find(CPU).kernel_sms["h2d"] == 5
    monkeypatch.setitem(sys.modules, "platformdirs", None)  # import now raises ImportError
    with pytest.warns(ProfileWarning, match="platformdirs is not installed"):
        assert profiles.find(CPU) is None  # the user dir is not searched; nothing shipped for CPU


def test_the_resolver_skips_profiles_or_decides_by_a_calibration_passed_in_and_keeps_no_state(shipped):
    """What ``kvswap calibrate`` and the bench bind routes by: arguments, no module state."""
    path = store.save(profile(sms=5), profiles.default_path(CPU))
    fake = profiles.to_calibration(profile(sms=11), "stand-in")
    hidden = kvswap.resolve("h2d", device="cpu", profiles=False).plan.calibration
    assert hidden["source"] != f"profile {path}" and "profile" not in hidden["source"]
    given = kvswap.resolve("h2d", device="cpu", calibration=fake, profiles=False)
    assert given.plan.calibration["source"] == "stand-in"
    assert kvswap.resolve("h2d", device="cpu", calibration=fake).plan.calibration["source"] == "stand-in"
    assert profiles.find(CPU).kernel_sms["h2d"] == 5  # the lookup is untouched
    assert kvswap.resolve("h2d", device="cpu").plan.calibration["source"] == f"profile {path}"
    assert not hasattr(store, "override") and not hasattr(store, "_overrides")


def shipped_profiles() -> list[Path]:
    return sorted(p for p in profiles.shipped_dir().glob("*.json") if not p.name.endswith(".measurements.json"))


def test_every_shipped_profile_loads_is_named_for_its_device_and_holds_no_raw_rows():
    shipped = shipped_profiles()
    assert shipped, "profiles of the measured GPUs are shipped"
    for path in shipped:
        cal = profiles.load(path)
        assert cal.calibrated and cal.scope == "device"
        assert path.name == profiles.profile_name(cal.identity)
        assert cal.curves and cal.kernel_sms
        assert path.stat().st_size <= 64 * 1024, f"{path.name}: {path.stat().st_size} bytes"
        doc = json.loads(path.read_text())
        assert not set(store.RAW_FIELDS) & set(doc) and doc.get("host_reference") in (None, False)
        assert not store.measurements_path(path).exists()  # raw measurements are never shipped
