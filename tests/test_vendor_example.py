"""The example vendor backend (examples/vendor_backend) works as a separate distribution.

It is built and installed offline from a temporary copy into a throwaway ``--target``
folder (the venv is never changed), which subprocesses get on PYTHONPATH; there it must be
discovered, resolved, forced, blocked by ``KVSWAP_DISABLE_PLUGINS`` and certified by the
conformance kit, on its own ``acme`` platform.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vendor_backend"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("vendor")
    src = shutil.copytree(EXAMPLE, work / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--no-cache-dir", "--disable-pip-version-check", "--target", str(target), str(src)],
        check=True, capture_output=True, text=True, timeout=300, cwd=work,
    )
    assert (target / "kvswap_acme" / "__init__.py").exists()
    return target


def run(site: Path, args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSWAP_")}
    base.update(env, PYTHONPATH=str(site))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=base, capture_output=True, text=True, timeout=300)


def test_installed_example_is_discovered_by_kvswap_info(site, tmp_path):
    out = run(site, ["-m", "kvswap", "info", "--json", "--device", "acme"], tmp_path)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    plugin = next(p for p in info["plugins"] if p["name"] == "acme")
    assert (plugin["distribution"], plugin["version"], plugin["status"]) == ("kvswap-acme", "0.1.0", "loaded")
    assert info["platform"] == "acme" and info["device"]["identity"] == "acme-sim-1"
    impl = next(i for i in info["impls"] if i["name"] == "acme.copy")
    assert impl["available"] and impl["constraints"]["alignment"] == 8
    assert info["calibration"]["source"].startswith("kvswap-acme defaults")


RESOLVE = r"""
import json, sys, warnings
import numpy as np
import kvswap
from kvswap import InvalidTransferError, Policy, ResolutionError
from kvswap.registry.plugins import create_plugin_host

rng = np.random.default_rng()
def copy_through(fn):
    src = rng.integers(0, 256, 64 * 1024, dtype=np.uint8)
    dst = rng.integers(0, 256, 64 * 1024, dtype=np.uint8)
    want = dst.copy()
    so, do = rng.permutation(16)[:10] * 4096, rng.permutation(16)[:10] * 4096
    for s, d in zip(so, do):
        want[d:d + 4096] = src[s:s + 4096]
    fn(src.ctypes.data + so, dst.ctypes.data + do, np.full(10, 4096))
    return bool(np.array_equal(dst, want))

out = {}
auto = kvswap.resolve("h2d", device="acme")
out["auto_impls"] = auto.impls
out["auto_copy"] = copy_through(auto)
forced = kvswap.resolve("d2h", device="acme", policy=Policy(force="acme.copy"))
out["forced"] = [forced.plan.forced, copy_through(forced)]
buf = np.zeros(64, dtype=np.uint8)
try:
    forced([buf.ctypes.data + 1], [buf.ctypes.data + 32], [8])
except InvalidTransferError as e:
    out["misaligned"] = str(e)
try:
    kvswap.resolve("h2d", device="cpu", policy=Policy(force="acme.copy"))
except ResolutionError as e:
    out["forced_on_cpu"] = str(e)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    blocked = create_plugin_host(env={"KVSWAP_DISABLE_PLUGINS": "acme"})
out["blocked_status"] = blocked.records["acme"].status
try:
    kvswap.resolve("h2d", device="acme", host=blocked)
except kvswap.ConfigurationError as e:
    out["blocked_resolve"] = str(e)
print(json.dumps(out))
"""


def test_installed_example_resolves_copies_is_forced_and_blocked(site, tmp_path):
    out = run(site, ["-c", RESOLVE], tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["auto_impls"] == ["acme.copy"] and got["auto_copy"] is True
    assert got["forced"] == ["acme.copy", True]
    assert "refused by acme.copy: addresses and size must be multiples of 8 bytes" in got["misaligned"]
    assert "'acme.copy' is not registered for platform 'cpu'" in got["forced_on_cpu"]
    assert got["blocked_status"] == "disabled"
    assert got["blocked_resolve"].startswith("device='acme'")


def test_disabled_plugin_disappears_from_kvswap_info(site, tmp_path):
    out = run(site, ["-m", "kvswap", "info", "--json"], tmp_path, KVSWAP_DISABLE_PLUGINS="acme")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    plugin = next(p for p in info["plugins"] if p["name"] == "acme")
    assert plugin["status"] == "disabled" and "KVSWAP_DISABLE_PLUGINS" in plugin["reason"]
    assert "acme.copy" not in {i["name"] for i in info["impls"]}
    forced = run(site, ["-m", "kvswap", "explain", "--direction", "h2d", "--device", "acme"], tmp_path,
                 KVSWAP_DISABLE_PLUGINS="acme")
    assert forced.returncode == 2 and "device='acme'" in forced.stderr


def test_installed_example_is_certified_by_the_kit(site, tmp_path):
    out = run(site, ["-m", "pytest", "-p", "kvswap.testing", "--kvswap-impl", "acme.copy",
                     "--kvswap-device", "acme", "-p", "no:cacheprovider", "-v"], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAILED" not in out.stdout and " passed" in out.stdout
    for label in ("src-misaligned", "dst-misaligned", "size-misaligned", "below-min", "above-max"):
        assert f"test_swapfn_refuses_what_the_impl_declares_it_cannot_copy[h2d-{label}] PASSED" in out.stdout


def test_info_and_explain_tell_a_vendor_what_its_device_takes(site, tmp_path):
    """``kvswap info`` names no Triton backend 'None', says once that the defaults are not
    measured, and shows the sizes acme.copy takes (8 B to 1 MiB, multiples of 8), as
    ``kvswap explain`` does for its route, not the size classes the route spans."""
    out = run(site, ["-m", "kvswap", "info", "--device", "acme"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "None backend" not in out.stdout and "Triton has no backend for acme devices" in out.stdout
    (cal,) = [line for line in out.stdout.splitlines() if line.startswith("calibration:")]
    assert cal.count("not measured") == 1 and "NOT calibrated: run `kvswap calibrate`" in cal
    acme = next(line for line in out.stdout.splitlines() if "acme.copy" in line)
    assert "available; takes blocks of 8 B to 1 MiB, in multiples of 8 B" in acme
    out = run(site, ["-m", "kvswap", "explain", "--direction", "h2d", "--device", "acme"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "8 B <= block <= 1 MiB, multiples of 8 B -> acme.copy" in out.stdout, out.stdout
    assert "1572863" not in out.stdout and "1.5 MiB" not in out.stdout
    assert "acme.copy (plugin acme), which takes blocks of 8 B to 1 MiB, in multiples of 8 B," in out.stdout
    for size in ("2097152", "4100"):  # what the implementation refuses is refused when resolved
        out = run(site, ["-m", "kvswap", "explain", "--direction", "h2d", "--device", "acme", "--block-bytes",
                         size], tmp_path)
        assert out.returncode == 1 and "acme.copy takes blocks of 8 B to 1 MiB, in multiples of 8 B" in out.stderr


def test_calibrating_the_example_device_says_what_it_measures(site, tmp_path):
    """acme's memory is host memory, but it is not the host reference: calibrate says it
    measures acme, carries over no direction acme.copy does not copy (d2d), and names what
    the resolver decides by where it reads no profile."""
    out = run(site, ["-m", "kvswap", "calibrate", "--quick", "--device", "acme", "--out", str(tmp_path / "p.json")],
              tmp_path, XDG_DATA_HOME=str(tmp_path / "xdg"))
    assert out.returncode == 0, out.stderr
    assert "host.reference" not in out.stderr and "HOST MEMORY COPIES" not in out.stdout + out.stderr
    assert "kvswap calibrate: acme device 'ACME Simulated Accelerator'" in out.stderr
    assert "h2d: measuring acme.copy" in out.stderr
    assert "d2d" not in out.stdout
    assert "it finds no profile for it, and decides by kvswap-acme defaults" in out.stdout
    assert "reads no profile" not in out.stdout
    profile = json.loads((tmp_path / "p.json").read_text())
    assert set(profile["decisions"]) == {"h2d", "d2h"} and profile.get("host_reference") is not True
