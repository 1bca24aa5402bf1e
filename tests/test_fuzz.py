"""The fuzz script's logic on the CPU (host reference; the Triton kernel in its interpreter):
every route and path runs, a clean run finds nothing, and a sabotaged one is caught."""
from __future__ import annotations

from bench_scripts import load_bench


def load_fuzz():
    return load_bench("fuzz.py", "kvswap_fuzz")


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
    assert sum(r.block_major_rounds for r in report.rows if r.path == "mover") > 0  # both host layouts
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


LIMITS = dict(device="cpu", limits=True, mixed_limit=48, uniform_limit=64, limit_sizes=(512,), far_counts=(300,),
              directions=("h2d", "d2h"))


def test_the_limits_entry_copies_batches_at_and_over_each_limit_through_every_route():
    fuzz = load_fuzz()
    report = fuzz.run(fuzz.Config(**LIMITS, seed=4))
    cases = {r.case for r in report.rows}
    assert cases == {"mixed 1-4096 odd x 48", "mixed 1-4096 odd x 49", "mixed 1-4096 odd x 99",
                     "mixed 1-4096 odd x 300", "512 B x 64", "512 B x 65"}
    import kvswap

    for d in ("h2d", "d2h"):
        fn = kvswap.resolve(d, device="cpu")
        routes = {r.route for r in report.rows if r.direction == d}
        assert routes == {"resolved"} | {c.name for c in fn.plan.candidates if c.available}
    assert all(r.path == "limits" and r.batches == 1 and r.first_error is None for r in report.rows)
    totals = report.totals()
    assert totals["wrong"] == totals["canaries"] == 0
    assert totals["transfers"] == len(report.rows) // 6 * (48 + 49 + 99 + 300 + 64 + 65)


def test_the_limits_entry_catches_a_wrong_byte_and_places_blocks_as_asked():
    fuzz = load_fuzz()
    report = fuzz.run(fuzz.Config(**dict(LIMITS, directions=("h2d",)), seed=5, sabotage=True))
    assert all(r.wrong == 1 and r.first_error for r in report.rows)
    import numpy as np

    rng = np.random.default_rng(6)
    sizes = rng.integers(1, 4097, 500)
    odd, span = fuzz.pack(rng, sizes, True)
    assert (odd % 2 == 1).all() and span >= int(sizes.sum())
    aligned, _ = fuzz.pack(rng, np.full(50, 4096), False)
    assert (aligned % 256 == 0).all()
    ends = np.sort(odd + sizes)
    starts = np.sort(odd)
    assert (starts[1:] >= ends[:-1]).all()  # no two blocks overlap
