"""tests/bench/bench_vllm_worker.py runs (on host memory here, at a small size): one row per
engine mode (here idle and python), direction, chunk size and job size, with both sides' times and their ratios, printed as a
table and written as JSON. It asserts nothing of the times: a benchmark is not a test."""
from __future__ import annotations

import json

from bench_scripts import load_bench


def test_the_bench_runs_and_writes_a_row_per_case(tmp_path, capsys):
    bench = load_bench("bench_vllm_worker.py", "bench_vllm_worker")
    rows = bench.main(["--out-dir", str(tmp_path), "--device", "cpu", "--layers", "3", "--page", "2048",
                       "--device-blocks", "48", "--host-blocks", "48", "--blocks", "4,9", "--k", "1,4",
                       "--reps", "3", "--warmup", "1", "--engine", "idle,python"])
    assert [(r["engine"], r["direction"], r["k"], r["blocks"]) for r in rows] == [
        (e, d, k, b) for e in ("idle", "python") for d in ("d2h", "h2d") for k in (1, 4) for b in (4, 9)]
    saved = json.loads((tmp_path / "bench_vllm_worker.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows))
    for r in rows:
        assert r["worker_host_us"] > 0 and r["bare_host_us"] > 0 and r["host_ratio"] > 0
        assert r["bytes"] == r["blocks"] * 3 * 2048 and "host.reference" in r["route"]
    out = capsys.readouterr().out
    assert out.count("\n| python | d2h |") == 8 and out.count("\n| idle | h2d |") == 8 and "| ratio |" in out
