"""Profiles without their raw rows: the resolver decides exactly as from the whole profile,
the shipped ones are small, and ``kvswap calibrate --strip`` makes them so."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

import kvswap
from kvswap import CopyImpl, DeviceInfo, Direction, Policy, hookimpl
from kvswap.resolution import profiles
from kvswap.calibration import store
from kvswap.calibration.records import SIZE, Measurement
from kvswap.cli import main
from kvswap.registry.plugins import create_plugin_host

KiB = 1024
SHIPPED = sorted(p for p in profiles.shipped_dir().glob("*.json") if not p.name.endswith(".measurements.json"))


class StandIn:
    """Plugin: a device of a profile's identity on its platform, offering routes of the
    names the profile measured (bound, never called)."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self.device = DeviceInfo(**{k: v for k, v in doc["device"].items() if k in DeviceInfo.__dataclass_fields__})
        self.routes = sorted({(c["impl"], "kernel" if c.get("num_sms") else "batch") for c in doc["curves"]})

    @hookimpl
    def kvswap_detect_platform(self, device: Optional[str]) -> Optional[DeviceInfo]:
        return self.device if device == "standin:0" else None

    @hookimpl
    def kvswap_register_copy_impls(self, platform: str, register: Callable[[CopyImpl], None]) -> None:
        if platform != self.device.platform:
            return
        for name, kind in self.routes:
            register(CopyImpl(name, kind, (platform,), (Direction.H2D, Direction.D2H),
                              lambda ctx: lambda src, dst, sizes, stream=None: None))


CASES = [
    dict(),
    dict(block_bytes=4 * KiB),
    dict(block_bytes=[16 * KiB, 48 * KiB, 256 * KiB]),
    dict(policy=Policy(prefer="low_interference")),
    dict(policy=Policy(max_sms=8)),
    dict(block_bytes=[2 * KiB, 512 * KiB], policy=Policy(max_sms=24)),
]


def plans(path: Path, doc: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The plans a device of ``doc``'s identity gets with the profile at ``path`` in force."""
    host = create_plugin_host(entry_points=[], extra=[("standin", StandIn(doc))])
    monkeypatch.setenv(profiles.PROFILE_ENV, str(path))
    out = []
    for d in ("h2d", "d2h"):
        for case in CASES:
            plan = kvswap.resolve(d, device="standin:0", host=host, **case).plan
            assert plan.calibration["source"] == f"profile {path}"
            got = plan.to_dict()
            got["calibration"] = {k: v for k, v in got["calibration"].items() if k != "source"}
            out.append(got)
    return out


def raw_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Measurement rows of the kind a calibration writes, one per curve point (a stand-in
    for the rows a shipped profile was fitted from, which are not shipped)."""
    rows = []
    for c in doc["curves"]:
        for b, g in c["points"]:
            n = max(1, (256 << 20) // b)
            rows.append(Measurement(c["direction"], SIZE, c["impl"], "kernel" if c.get("num_sms") else "batch",
                                    c.get("num_sms"), b, n, b * n / (g * 1e9) if g else 1.0, 10).to_dict())
    return rows


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_a_shipped_profile_resolves_exactly_as_it_did_with_its_raw_rows(path, tmp_path, monkeypatch):
    slim = json.loads(path.read_text())
    assert not set(store.RAW_FIELDS) & set(slim) and len(path.read_bytes()) <= 64 * KiB
    whole = dict(slim, measurements=raw_rows(slim), interference=[])
    fat = tmp_path / "whole.json"
    fat.write_text(json.dumps(whole))
    assert fat.stat().st_size > 4 * path.stat().st_size
    want = plans(fat, whole, monkeypatch)
    assert any(r["impl"] == "triton.kernel" for p in want for r in p["routes"])  # the kernel is routed somewhere
    assert plans(path, slim, monkeypatch) == want
    # and stripped again by the command, the profile is byte for byte what is shipped
    assert main(["calibrate", "--strip", str(fat)]) == 0
    assert json.loads(fat.read_text()) == slim
    raw = json.loads(store.measurements_path(fat).read_text())
    assert raw["schema"] == store.MEASUREMENTS_SCHEMA and raw["measurements"] == whole["measurements"]
    assert plans(fat, slim, monkeypatch) == want


def test_strip_moves_measurements_and_interference_beside_the_profile_and_keeps_the_rest(tmp_path, capsys):
    from test_calibration_fit import DEVICE, synthetic_run

    from kvswap.calibration import fit

    ms = synthetic_run()
    inter = [{"direction": "h2d", "route": "x.kernel", "kind": "kernel", "num_sms": 8, "slowdown": 0.14}]
    held = [{"direction": "h2d", "route": "x.kernel", "descriptors": 64, "held_us": 40.0}]
    doc = store.make_document(DEVICE, fit.profile_fields(ms, inter, ["h2d", "d2h"]), measurements=ms,
                              interference=inter, host_cost_records=held, notes=["a note"], failures=[])
    path = tmp_path / "p.json"
    path.write_text(store.dumps(doc))  # a whole profile, as kvswap calibrate wrote them before
    before = profiles.load(path)
    assert main(["calibrate", "--strip", str(path)]) == 0
    assert "raw measurements moved to" in capsys.readouterr().out
    slim = json.loads(path.read_text())
    assert set(doc) - set(slim) == {"measurements", "interference", "host_cost_records"}
    assert {k: v for k, v in doc.items() if k in slim} == slim
    after = profiles.load(path)
    assert (after.curves, after.kernel_sms, after.kernel_min_batch, after.min_batch_by_size,
            after.kernel_sms_by_batch, after.slowdown_by_sms, after.ceiling_gbps) == (
        before.curves, before.kernel_sms, before.kernel_min_batch, before.min_batch_by_size,
        before.kernel_sms_by_batch, before.slowdown_by_sms, before.ceiling_gbps)
    assert after.slowdown_by_sms["h2d"] == (("kernel", 8, 0.14), ("x.kernel", 8, 0.14))
    got_ms, got_inter = store.read_measurements(store.measurements_path(path))
    assert got_ms == ms and got_inter == inter
    assert main(["calibrate", "--strip", str(path)]) == 0  # again: nothing left to move
    assert "it held no raw measurements" in capsys.readouterr().out
    assert json.loads(path.read_text()) == slim


def test_strip_refuses_what_is_not_a_profile_and_leaves_it(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something else"}')
    assert main(["calibrate", "--strip", str(bad)]) == 2
    assert "--strip" in capsys.readouterr().err and bad.read_text() == '{"schema": "something else"}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def cpu_profile() -> dict[str, Any]:
    """A small valid profile of this machine's CPU, as ``kvswap calibrate`` writes one."""
    from kvswap.registry.platform import cpu_device

    curves = [{"impl": "host.reference", "direction": d, "num_sms": None, "points": [[4096, 3.0], [65536, 30.0]]}
              for d in ("h2d", "d2h")]
    return store.make_document(cpu_device(), measured="test", curves=curves,
                               decisions={d: {"kernel_sms": 6, "routes": []} for d in ("h2d", "d2h")})


# Files the resolver skips that a plain json.loads takes (or dies on): what --strip and
# --update must refuse as the resolver does, with an error naming the file, not a traceback.
UNREADABLE = {
    "not-an-object": lambda: json.dumps([cpu_profile()]),
    "nan-in-raw-rows": lambda: json.dumps(dict(cpu_profile(), measurements=[{"seconds": float("nan")}])),
    "nan-in-settings": lambda: json.dumps(dict(cpu_profile(), settings={"rounds": float("nan")})),
    "too-deep": lambda: json.dumps(cpu_profile())[:-1] + ', "x": ' + "[" * 200_000 + "]" * 200_000 + "}",
}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_strip_refuses_a_file_the_resolver_would_skip_and_leaves_it(case, tmp_path, capsys):
    path = tmp_path / "p.json"
    text = UNREADABLE[case]()
    path.write_text(text)
    assert main(["calibrate", "--strip", str(path)]) == 2
    assert f"--strip {str(path)!r}: " in capsys.readouterr().err
    assert path.read_text() == text and sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_save_refuses_a_number_json_cannot_hold_with_a_profile_error_and_keeps_the_old_file(tmp_path):
    path = store.save(cpu_profile(), tmp_path / "p.json")
    before = path.read_text()
    with pytest.raises(profiles.ProfileError, match="cannot be written as JSON"):
        store.save(dict(cpu_profile(), settings={"rounds": float("inf")}), path)
    assert path.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


@pytest.mark.parametrize("case", ["nan-in-settings", "too-deep"])
def test_update_refuses_a_file_the_resolver_would_skip_before_measuring(case, tmp_path, monkeypatch, capsys):
    from kvswap.calibration import update

    def measured(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("measured for a profile it cannot write")

    monkeypatch.setattr(update, "measure", measured)
    path = tmp_path / "p.json"
    text = UNREADABLE[case]()
    path.write_text(text)
    assert main(["calibrate", "--device", "cpu", "--quick", "--only", "host-cost", "--update", str(path)]) == 2
    assert f"--update {str(path)!r}" in capsys.readouterr().err and path.read_text() == text


def test_a_profile_of_a_kernel_no_longer_installed_sends_no_batch_to_an_unmeasured_kernel(monkeypatch):
    """The shipped profile measured triton.kernel; here another plugin's kernel is installed
    instead. Nothing predicts it, so it must rank below the measured batch route at every
    block size and batch (resolver._unmeasured_notes: "only where none of them can copy"),
    not take the batch tiers fitted for the kernel the profile measured."""
    path = next(p for p in SHIPPED if "h100" in p.name)
    doc = json.loads(path.read_text())

    class Replaced(StandIn):
        def __init__(self, doc: dict[str, Any]) -> None:
            super().__init__(doc)
            self.routes = [("cuda.batch", "batch"), ("acme.kernel", "kernel")]

    host = create_plugin_host(entry_points=[], extra=[("standin", Replaced(doc))])
    monkeypatch.setenv(profiles.PROFILE_ENV, str(path))
    for d in ("h2d", "d2h"):
        fn = kvswap.resolve(d, device="standin:0", host=host)
        assert fn.plan.calibration["source"] == f"profile {path}"
        taken = [(r.min_bytes, n) for r in fn.plan.routes for n in (1, 8, 64, 512, 4096)
                 if r.runs(n)[0] == "acme.kernel"]
        assert not taken, f"{d}: unmeasured acme.kernel takes (block bytes, batch) {taken}"
