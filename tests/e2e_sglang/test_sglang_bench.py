"""tests/bench/bench_sglang_hicache.py runs (on host memory here, at a tiny size): its grid of
cases, every contender's bytes checked before timing, one row per case and contender with the
ratios of one run, printed as a table and written as JSON. It asserts nothing of the times: a
benchmark is not a test. Runs where SGLang is installed."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from hicache import plugin  # noqa: F401  (skips the module where SGLang is absent; restores hooks)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_scripts import load_bench  # noqa: E402


def test_the_grid_is_the_issues_cases():
    bench = load_bench("bench_sglang_hicache.py", "bench_sglang_hicache")
    grid = bench.cases()
    assert len(grid) == 16 and {(c.op, c.tp, c.page, c.layout) for c in grid} == {
        (o, t, p, lay) for o in ("load", "backup") for t in (1, 8) for p in (16, 64)
        for lay in ("layer_first", "page_first_direct")}
    run = {(c.tp, c.page): c.run_bytes for c in grid}
    assert run == {(1, 16): 32 << 10, (1, 64): 128 << 10, (8, 16): 4 << 10, (8, 64): 16 << 10}


def test_ratios_are_taken_within_a_case():
    bench = load_bench("bench_sglang_hicache.py", "bench_sglang_hicache")
    rows = [dict(op="load", tp=1, page=16, layout="layer_first", contender=c, step_ms=s)
            for c, s in (("kvswap", 3.0), ("direct", 6.0), ("reference", 2.0), ("jit", None))]
    rows += [dict(op="load", tp=8, page=16, layout="layer_first", contender="kvswap", step_ms=5.0)]
    out = bench.with_ratios(rows)
    assert out[0]["step_over_reference"] == 1.5 and out[0]["step_over_direct"] == 0.5
    assert out[3]["step_over_reference"] is None and out[4]["step_over_reference"] is None


def test_the_bench_runs_checks_bytes_and_writes_a_row_per_case_and_contender(plugin, tmp_path, capsys):  # noqa: F811
    bench = load_bench("bench_sglang_hicache.py", "bench_sglang_hicache")
    rows = bench.main(["--device", "cpu", "--out", str(tmp_path), "--prefix", "64", "--tokens", "8", "--layers", "2",
                       "--scale", "16", "--reps", "3", "--warmup", "1", "--tp", "1,8", "--pages", "16",
                       "--ops", "load,backup"])
    keys = [(r["op"], r["tp"], r["layout"], r["contender"]) for r in rows]
    assert keys == [(o, t, lay, c) for o in ("load", "backup") for t in (1, 8)
                    for lay in ("layer_first", "page_first_direct") for c in bench.CONTENDERS]
    for r in rows:
        if r["contender"] == "jit":
            assert r["step_ms"] is None and r["skipped"] == "needs CUDA"
        else:
            assert r["step_ms"] > 0 and r["skipped"] is None and r["verified"] == (r["contender"] != "none")
            assert r["step_over_reference"] > 0 and r["step_over_direct"] > 0
        if r["contender"] == "kvswap":
            assert f"layout {r['layout']}" in r["route"] and "host.reference" in r["route"]
    saved = json.loads((tmp_path / "bench_sglang_hicache.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["meta"]["card"]
    out = capsys.readouterr().out
    assert out.count("| kvswap |") == 8 and "| step/ref | step/direct |" in out and "* jit skipped: needs CUDA" in out
