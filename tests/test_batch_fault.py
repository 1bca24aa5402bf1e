"""The driver-fault reproducer and its envelope script, run against a stand-in libcuda
(tests/bench/batch_fault/fake_libcuda.c: host memory, memcpy, and switches that make it
fault, hang, fail or copy wrong): every exit status, the child-process map, the limits
derived from it and the doc section it rewrites."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "tests" / "bench" / "batch_fault"


envelope = load_bench("batch_fault/envelope.py", "kvswap_envelope")
CC = shutil.which("cc") or shutil.which("gcc")
INCLUDE = envelope.cuda_include(shutil.which("nvcc"))
pytestmark = pytest.mark.skipif(CC is None or INCLUDE is None, reason="needs a C compiler and CUDA's cuda.h")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``(repro binary, folder of the stand-in libcuda.so.1)``."""
    out = tmp_path_factory.mktemp("batch_fault")
    lib = out / "lib"
    lib.mkdir()
    subprocess.run([CC, "-shared", "-fPIC", f"-I{INCLUDE}", "-o", str(lib / "libcuda.so.1"),
                    str(HERE / "fake_libcuda.c")], check=True, capture_output=True)
    subprocess.run([CC, "-O2", "-std=gnu11", f"-I{INCLUDE}", "-o", str(out / "repro"), str(HERE / "repro.c"), "-ldl"],
                   check=True, capture_output=True)
    return str(out / "repro"), str(lib)


def _env(lib: str, **fake: int) -> dict:
    return {"LD_LIBRARY_PATH": lib, "PATH": "/usr/bin:/bin", **{f"FAKE_CUDA_{k.upper()}": str(v) for k, v in fake.items()}}


def _repro(built, *args: str, **fake: int) -> tuple[int, dict]:
    binary, lib = built
    p = subprocess.run([binary, *args], capture_output=True, text=True, env=_env(lib, **fake), timeout=60)
    line = next((x for x in p.stdout.splitlines() if x.startswith("{")), "{}")
    return p.returncode, json.loads(line)


@pytest.mark.parametrize("args", [
    ("-n", "3000", "-s", "m1-4096", "-a", "odd", "-d", "h2d"),
    ("-n", "2000", "-s", "u4096", "-a", "256", "-d", "d2h"),
    ("-n", "1500", "-s", "m1-65536", "-a", "8", "-d", "d2d", "-b", "12080"),
    ("-n", "500", "-s", "m1-300", "-a", "odd", "-d", "h2d", "-b", "export", "-c", "3", "-o", "stream"),
])
def test_the_reproducer_copies_and_checks_every_byte(built, args):
    rc, out = _repro(built, *args)
    assert rc == 0 and out["result"] == "ok" and out["wrong"] == out["canaries"] == 0
    assert out["count"] == int(args[1]) and out["direction"] == args[-1 - args[::-1].index("-d") + 1]
    assert out["calls"] == (3 if "-c" in args else 1)


@pytest.mark.parametrize("fake, status, result", [
    (dict(corrupt=1), 5, "wrong bytes"),
    (dict(spill=1), 6, "canaries changed"),
    (dict(batch_rc=1), 3, "call error"),
])
def test_each_failure_has_its_own_exit_status(built, fake, status, result):
    rc, out = _repro(built, "-n", "64", **fake)
    assert (rc, out["status"], out["result"]) == (status, status, result)
    if status == 5:
        assert out["wrong"] == 1 and out["canaries"] == 0
    if status == 6:
        assert out["canaries"] == 1 and out["wrong"] == 0
    if status == 3:
        assert out["error"] == "CUDA_ERROR_INVALID_VALUE"


def test_a_fault_in_the_call_ends_the_process_by_a_signal(built):
    rc, out = _repro(built, "-n", "300", fault_above=100)
    assert rc == -signal.SIGSEGV and out == {}
    assert _repro(built, "-n", "100", fault_above=100)[0] == 0
    assert _repro(built, "-n", "300", "-s", "u512", fault_above=100)[0] == 0  # one size: no fault


def test_bad_options_are_a_usage_error(built):
    for args in (("-d", "sideways"), ("-s", "x12"), ("-n", "0"), ("-b", "11000"), ("-o", "sometimes")):
        assert _repro(built, *args)[0] == 1


def test_the_envelope_maps_faults_and_hangs_derives_limits_and_rewrites_the_doc(built, tmp_path, monkeypatch):
    binary, lib = built
    for k, v in _env(lib, fault_above=2500, hang_above=3000).items():
        monkeypatch.setenv(k, v)
    doc = tmp_path / "known-issues.md"
    doc.write_text(f"# head\n\n{envelope.BEGIN}\nold table\n{envelope.END}\n\ntail\n")
    out = tmp_path / "out"
    assert envelope.main(["--binary", binary, "--out", str(out), "--budget-s", "120", "--timeout-s", "2",
                          "--jobs", "2", "--counts", "1000,2000,4000", "--sizes", "m1-4096,u512",
                          "--aligns", "odd,256", "--directions", "h2d,d2h", "--bisect", "1",
                          "--update-doc", str(doc)]) == 0
    data = json.loads((out / "envelope.json").read_text())
    runs = data["runs"]
    by = {}
    for r in runs:
        if not r["abi"] and not r["order"]:
            by.setdefault((r["direction"], r["sizes"], r["align"], r["count"]), []).append(r["outcome"])
    for d in ("h2d", "d2h"):
        for a in ("odd", "256"):
            assert by[(d, "m1-4096", a, 1000)] == ["ok"] and by[(d, "m1-4096", a, 2000)] == ["ok"]
            assert by[(d, "m1-4096", a, 4000)] == ["signal", "signal"]  # every fault is run twice
            assert by[(d, "u512", a, 4000)] == ["hang", "hang"] and by[(d, "u512", a, 2000)] == ["ok"]
            bisected = [c for (dd, z, aa, c) in by if (dd, z, aa) == (d, "m1-4096", a) and c not in (1000, 2000, 4000)]
            assert bisected and all(2000 < c < 4000 for c in bisected)
    assert {r["detail"] for r in runs if r["outcome"] == "signal"} == {"SIGSEGV"}
    variants = [r for r in runs if r["abi"] or r["order"]]
    assert {(r["abi"], r["order"]) for r in variants} == {("12080", ""), ("export", ""), ("", "stream")}
    assert all(r["outcome"] == "signal" for r in variants)
    lim = data["limits"]
    for d in ("h2d", "d2h"):
        assert 2000 <= lim["mixed"][d]["safe"] <= 2500 < lim["mixed"][d]["first_fault"] <= 4000
        assert 2000 <= lim["uniform"][d]["safe"] <= 3000 < lim["uniform"][d]["first_fault"] <= 4000
    text = doc.read_text()
    assert text.startswith("# head\n\n") and text.endswith("\n\ntail\n") and "old table" not in text
    assert "| m1-4096 | odd | ok | ok |" in text and "SIGSEGV 2/2" in text and "hang 2/2" in text
    assert text == f"# head\n\n{envelope.BEGIN}\n{(out / 'envelope.md').read_text()}{envelope.END}\n\ntail\n"


def test_the_known_issues_doc_has_an_envelope_section():
    text = (ROOT / "docs" / "known-issues.md").read_text()
    assert text.count(envelope.BEGIN) == 1 and text.count(envelope.END) == 1
    assert "MIXED_CHUNK" in text and "580.159.04" in text
