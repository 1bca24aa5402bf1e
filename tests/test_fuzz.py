"""The fuzz script's logic on the CPU (host reference; the Triton kernel in its interpreter):
every route and path runs, a clean run finds nothing, and a sabotaged one is caught."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "bench" / "fuzz.py"


def load_fuzz():
    spec = importlib.util.spec_from_file_location("kvswap_fuzz", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


TINY = dict(device="cpu", transfers=900, pool_bytes=1 << 21, max_size=4096, inflight=4, max_batch=48)


def test_a_tiny_fuzz_on_the_cpu_covers_every_route_and_finds_nothing(tmp_path):
    fuzz = load_fuzz()
    report = fuzz.run(fuzz.Config(**TINY, seed=1))
    seen = {(r.path, r.direction, r.route) for r in report.rows}
    import kvswap

    for d in kvswap.Direction:
        fn = kvswap.resolve(d, device="cpu")
        for route in ["resolved"] + [c.name for c in fn.plan.candidates if c.available]:
            assert {("swapfn", str(d), route), ("mover", str(d), route)} <= seen
    for r in report.rows:
        assert (r.transfers > 0 or r.skipped) and r.first_error is None, r
    totals = report.totals()
    assert totals["wrong"] == totals["canaries"] == 0 and totals["transfers"] >= TINY["transfers"]
    out = tmp_path / "fuzz.json"
    assert fuzz.main(["--device", "cpu", "--transfers", "200", "--pool-mib", "2", "--max-size", "2048",
                      "--inflight", "2", "--directions", "h2d", "--json", str(out)]) == 0
    assert out.exists() and '"wrong": 0' in out.read_text()


def test_the_fuzz_catches_a_wrong_byte():
    fuzz = load_fuzz()
    report = fuzz.run(fuzz.Config(**dict(TINY, transfers=60), directions=("h2d",), seed=2, sabotage=True))
    swap_rows = [r for r in report.rows if r.path == "swapfn"]
    assert swap_rows and all(r.wrong == r.batches > 0 and r.first_error for r in swap_rows)
    assert "descriptor 0" in swap_rows[0].first_error
