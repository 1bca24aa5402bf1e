"""tests/bench/bench_worker_python.py runs: one row per sleep (none, and before each call),
chunk size and job size, the worker's results checked job by job against stand-in movers.
It asserts nothing of the times: a benchmark is not a test."""
from __future__ import annotations

import json

from bench_scripts import load_bench


def test_the_bench_runs_and_writes_a_row_per_case(tmp_path, capsys):
    bench = load_bench("bench_worker_python.py", "bench_worker_python")
    out = tmp_path / "rows.json"
    rows = bench.main(["--k", "1,3", "--blocks", "5", "--reps", "4", "--pause", "0.2", "--json", str(out)])
    assert [(r["pause_ms"], r["k"], r["blocks"]) for r in rows] == [(0.0, 1, 5), (0.0, 3, 5), (0.2, 1, 5), (0.2, 3, 5)]
    assert json.loads(out.read_text()) == rows
    for r in rows:
        assert r["worker_submit_us"] > 0 and r["worker_get_us"] > 0 and r["bare_submit_us"] > 0
    assert capsys.readouterr().out.count("\n| 0.2 ms |") == 2
