"""Profile reading in core (kvswap.resolution.profiles): malformed files are skipped with a warning naming
them, switches that name nothing say so, and resolve() takes a calibration as an argument."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

import kvswap
from kvswap import ProfileWarning
from kvswap.registry.platform import cpu_device

CPU = cpu_device()


def document(sms=6, gbps=3.0, device=CPU) -> dict:
    """A valid profile document for ``device`` (what ``kvswap calibrate`` writes, trimmed)."""
    curves = [{"impl": "host.reference", "direction": d, "num_sms": None,
               "points": [[4096, gbps], [65536, 10 * gbps]]} for d in ("h2d", "d2h")]
    return {"schema": "kvswap.profile/1", "kvswap_version": kvswap.__version__, "identity": device.identity,
            "device": json.loads(json.dumps(device.to_dict(), default=str)), "created": "2026-01-01T00:00:00+00:00",
            "curves": curves, "decisions": {d: {"kernel_sms": sms, "kernel_min_batch": 32, "routes": []}
                                            for d in ("h2d", "d2h")}}


@pytest.fixture
def user_profile(tmp_path, monkeypatch):
    """A good profile in the user dir (knee 5), to fall through to."""
    from kvswap.resolution import profiles

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(profiles, "shipped_dir", lambda: shipped)
    path = profiles.default_path(CPU)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document(sms=5)))
    return path


BAD = {
    "nan-knee": lambda: json.dumps(document(sms=float("nan"))),
    "infinite-knee": lambda: json.dumps(document(sms=float("inf"))),
    "negative-infinite-curve": lambda: json.dumps(document(gbps=float("-inf"))),
    "overflowing-float": lambda: json.dumps(document()).replace('"kernel_sms": 6', '"kernel_sms": 1e400'),
    "too-deep": lambda: json.dumps(document())[:-1] + ', "x": ' + "[" * 200_000 + "]" * 200_000 + "}",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_non_finite_and_too_deep_profiles_are_skipped_with_a_warning_naming_the_file(case, tmp_path, monkeypatch,
                                                                                     user_profile):
    bad = tmp_path / f"{case}.json"
    bad.write_text(BAD[case]())
    monkeypatch.setenv("KVSWAP_PROFILE", str(bad))
    with pytest.warns(ProfileWarning) as caught:
        fn = kvswap.resolve("h2d", device="cpu")
    assert any(str(bad) in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert fn.plan.calibration["source"] == f"profile {user_profile}"  # the next in the lookup order
    assert "profile" in fn.explain()


def test_a_calibration_with_a_non_finite_knee_is_refused_where_it_is_made():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(kvswap.InvalidImplError, match="kernel_sms"):
            kvswap.Calibration(source="x", platform="cpu", kernel_sms={"h2d": bad})
        with pytest.raises(kvswap.InvalidImplError, match="ceiling_gbps"):
            kvswap.Calibration(source="x", platform="cpu", ceiling_gbps={"d2h": bad})


@pytest.mark.parametrize("given", ["./missing.json", "missing.json", "nowhere/missing.json"])
def test_a_profile_switch_naming_no_file_is_warned_about(given, tmp_path, monkeypatch, user_profile):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KVSWAP_PROFILE", given)
    with pytest.warns(ProfileWarning, match=f"skipped calibration profile {given}") as caught:
        fn = kvswap.resolve("d2h", device="cpu")
    assert len(caught) == 1
    assert fn.plan.calibration["source"] == f"profile {user_profile}"


def test_resolve_decides_by_a_calibration_passed_in_or_without_profiles(user_profile):
    assert kvswap.resolve("h2d", device="cpu").plan.calibration["source"] == f"profile {user_profile}"
    mine = kvswap.Calibration(source="given", platform="cpu", kernel_sms={"h2d": 3})
    fn = kvswap.resolve("h2d", device="cpu", calibration=mine)
    assert fn.plan.calibration["source"] == "given"
    quiet = kvswap.resolve("h2d", device="cpu", profiles=False)
    assert "profile" not in quiet.plan.calibration["source"]  # the backend defaults
    with pytest.raises(kvswap.ConfigurationError, match="calibration="):
        kvswap.resolve("h2d", device="cpu", calibration={"kernel_sms": 3})


def test_core_reads_profiles_and_explains_without_importing_calibration(tmp_path):
    code = (
        "import sys, kvswap\n"
        "fn = kvswap.resolve('h2d', device='cpu')\n"
        "fn.explain()\n"
        "from kvswap.resolution import profiles\n"
        "assert profiles.shipped_dir().name == 'profiles' and profiles.shipped_dir().is_dir()\n"
        "leaked = sorted(m for m in sys.modules if m.startswith(('kvswap.calibration', 'kvswap.backends')))\n"
        "print(leaked)\n"
        "assert not [m for m in leaked if m.startswith('kvswap.calibration')], leaked\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"XDG_DATA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr


def test_every_shipped_profile_reads_through_core():
    from kvswap.resolution import profiles

    shipped = sorted(profiles.shipped_dir().glob("*.json"))
    assert shipped
    for path in shipped:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cal = profiles.load(path)
        assert profiles.is_shipped(cal.source) and cal.calibrated


def test_a_user_profile_folder_that_cannot_be_searched_is_skipped_with_a_warning(tmp_path, monkeypatch, capsys):
    """A user data dir without search permission (``Path.exists`` raises PermissionError
    for what lies in it) is a profile kvswap cannot read, not a crash of resolve()."""
    from pathlib import Path

    from kvswap.cli import main
    from kvswap.resolution import profiles

    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(profiles, "shipped_dir", lambda: shipped)
    ship = shipped / profiles.profile_name(CPU.identity)
    ship.write_text(json.dumps(document(sms=7)))
    locked = profiles.user_dir()
    user = profiles.default_path(CPU)
    locked.mkdir(parents=True)
    user.write_text(json.dumps(document(sms=5)))
    stat = Path.stat

    def denied(self, *args, **kwargs):  # as the OS answers where root's capabilities are not held
        if self.is_relative_to(locked):
            raise PermissionError(13, "Permission denied", str(self))
        return stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", denied)
    with pytest.warns(ProfileWarning, match=f"skipped calibration profile {user}: .*Permission denied"):
        fn = kvswap.resolve("h2d", device="cpu")
    assert fn.plan.calibration["source"] == f"profile {ship}"  # the next place in the lookup order
    assert main(["info"]) == 0  # the CLI prints warnings on stderr, one line each
    assert f"kvswap: warning: skipped calibration profile {user}: " in capsys.readouterr().err


def test_a_profile_switch_naming_a_pipe_is_skipped_not_waited_on(tmp_path, monkeypatch, user_profile):
    """Reading a pipe (or a device) would hold an engine's start for as long as it gives
    bytes: only a regular file is read."""
    import os
    import threading

    fifo = tmp_path / "profile.fifo"
    os.mkfifo(fifo)

    def feed() -> None:  # a good profile down the pipe, so that a reader of it returns
        with open(fifo, "w") as f:
            f.write(json.dumps(document(sms=3)))

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    monkeypatch.setenv("KVSWAP_PROFILE", str(fifo))
    try:
        with pytest.warns(ProfileWarning, match=f"skipped calibration profile {fifo}: is not a regular file"):
            fn = kvswap.resolve("h2d", device="cpu")
    finally:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer finish if nothing read it
        writer.join()
        os.close(reader)
    assert fn.plan.calibration["source"] == f"profile {user_profile}"


def test_a_profile_error_is_a_kvswap_error():
    """What ``profiles.read``/``load`` and ``kvswap.calibration.store`` raise for a file they
    cannot use is one of kvswap's errors (core/errors.py), a ValueError as before."""
    from kvswap.resolution import profiles

    assert issubclass(profiles.ProfileError, kvswap.ConfigurationError)
    assert issubclass(profiles.ProfileError, ValueError)


def test_a_profile_measured_under_another_driver_says_so_with_both_versions(tmp_path, monkeypatch):
    """explain() and ``kvswap info`` name both drivers where the profile's differs from the
    device's, and say nothing of it where they agree or one is unknown."""
    from kvswap import DeviceInfo, hookimpl
    from kvswap.cli.inventory import format_report, report
    from kvswap.registry.plugins import create_plugin_host

    def device(driver: str) -> DeviceInfo:
        return DeviceInfo(platform="cpu", name="Driven", identity="cpu-driven", compute_units=2,
                          driver_version=driver, details={"torch_type": "cpu"})

    class Detect:
        @hookimpl
        def kvswap_detect_platform(self, device):
            return device_now if device == "driven" else None

    host = create_plugin_host(env={}, extra=[("driven", Detect())])
    path = tmp_path / "p.json"
    path.write_text(json.dumps(document(device=device("575.10 / CUDA 12.9"))))
    monkeypatch.setenv("KVSWAP_PROFILE", str(path))
    said = "calibration driver: measured under driver 575.10 / CUDA 12.9; this device runs driver 580.159.04"
    for now, expect in (("580.159.04", True), ("575.10 / CUDA 12.9", False), ("unknown", False)):
        device_now = device(now)
        text = kvswap.resolve("h2d", device="driven", host=host).explain()
        assert f"calibration: profile {path}" in text
        assert (said in text) is expect, text
        assert (said in format_report(report(host, "driven"))) is expect
