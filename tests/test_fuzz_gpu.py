"""The fuzz on a GPU: random transfers through every route and both paths (SwapFn,
BlockMover with 256 jobs in flight), every byte and canary checked. The full count runs as
``python tests/bench/fuzz.py --device cuda:0 --transfers 100000 --json fuzz.json``."""
from __future__ import annotations

import pytest
from bench_scripts import load_bench

pytestmark = pytest.mark.gpu


def test_fuzz_every_route_on_the_gpu():
    import torch

    import kvswap

    fuzz = load_bench("fuzz.py", "kvswap_fuzz")
    report = fuzz.run(fuzz.Config(device=f"cuda:{torch.cuda.current_device()}", transfers=20_000,
                                  pool_bytes=64 << 20, inflight=256, seed=21))
    for r in report.rows:
        assert (r.transfers > 0 or r.skipped) and r.first_error is None, r
    routes = {(r.path, r.direction, r.route) for r in report.rows if not r.skipped}
    for d in ("h2d", "d2h"):  # and d2d where the device has a route for it
        fn = kvswap.resolve(d, device=f"cuda:{torch.cuda.current_device()}")
        for route in ["resolved"] + [c.name for c in fn.plan.candidates if c.available]:
            assert {("swapfn", d, route), ("mover", d, route)} <= routes
    totals = report.totals()
    assert totals["wrong"] == 0 and totals["canaries"] == 0
    assert totals["transfers"] >= 20_000 and totals["max_inflight"] >= 256
    print(report.to_dict()["totals"])
