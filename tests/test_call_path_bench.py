"""tests/bench/bench_call_path.py runs on a CPU (the CUDA backend's Python on a stand-in
libcuda, and the host reference) at a tiny size: one row per call, route and size, each
with its time and the kvswap modules the call passed through. It asserts nothing of the
times: a benchmark is not a test."""
from __future__ import annotations

import json

from bench_scripts import load_bench


def _bench():
    return load_bench("bench_call_path.py", "bench_call_path")


def test_the_bench_runs_on_the_stand_ins_and_writes_a_row_per_case(tmp_path, capsys):
    out = tmp_path / "path.json"
    rows = _bench().main(["--device", "cpu", "--descriptors", "1,40", "--blocks", "1,3", "--layers", "2",
                          "--reps", "3", "--profile", "--json", str(out)])
    swap = [(r["route"], r["n"]) for r in rows if r["call"] == "swapfn"]
    assert swap == [(route, n) for route in ("cuda.batch", "host.reference") for n in (1, 40)]
    submits = [(r["route"], r["n"]) for r in rows if r["call"] == "submit"]
    assert submits == [(f"{route}/{how}", b) for route in ("cuda.batch", "host.reference")
                       for how in ("here", "thread") for b in (1, 3)]
    for r in rows:
        assert r["us"] > 0 and r["stops"] == len(r["path"]) >= r["modules"] >= 1
        assert r["returns"] == r["stops"] - r["modules"] and r["by_module_us"]
        assert all(m.startswith("kvswap.") for m in r["path"])
    for r in rows:
        if r["call"] == "swapfn":  # the SwapFn, and through it the route's backend
            assert r["path"][0] == "kvswap.resolution.swapfn" and r["raw_us"] > 0
            want = "kvswap.backends.cuda.batch" if r["route"] == "cuda.batch" else "kvswap.registry.reference"
            assert want in r["path"]
        else:
            assert r["path"][0] == "kvswap.mover.serial"
    saved = json.loads(out.read_text())
    assert saved["device"] == "cpu" and saved["rows"] == json.loads(json.dumps(rows))
    printed = capsys.readouterr().out
    assert printed.count("\nswapfn ") == 4 and printed.count("\nsubmit ") == 8


def test_stops_count_each_entry_into_a_module(tmp_path):
    bench = _bench()
    from kvswap.addressing import descriptors

    import numpy as np

    rng = np.random.default_rng()
    s = rng.integers(1, 1 << 40, 3, dtype=np.int64) * 4096
    seq = bench.stops(lambda: descriptors.validate(s, s + (1 << 60), np.full(3, 8, dtype=np.int64)))
    assert seq == ["kvswap.addressing.descriptors"]  # one module, entered once, however many calls in it


def test_the_cold_call_diagnostic_times_each_call_after_each_wait(tmp_path, capsys):
    bench = load_bench("diag_cold_calls.py", "diag_cold_calls")
    out = tmp_path / "cold.json"
    rows = bench.main(["--descriptors", "3,40", "--wait-ms", "0.5", "--reps", "2", "--json", str(out)])
    assert [r["call"] for r in rows] == ["check n=3", "check n=40", "numpy", "python"]
    for r in rows:
        assert all(r[f"{k}_us"] > 0 for k in bench.WAITS), r
    assert json.loads(out.read_text())["rows"] == rows
    assert capsys.readouterr().out.count("x\n") == 4  # a nap/warm ratio per call
    calls = []
    bench.wait("spin-self", 0.002, lambda: calls.append(1))
    assert calls  # the wait that keeps the call warm runs the call itself
    calls.clear()
    bench.wait("spin", 0.002, lambda: calls.append(1))
    assert not calls
