"""tests/bench/bench_staged_sms.py's markdown, from JSON of the shape its two parts write."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench_scripts import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("bench_staged_sms.py", "kvswap_bench_staged_sms")


def test_interference_table_puts_each_sm_count_beside_the_contiguous_range(bench):
    rng = np.random.default_rng(3)
    slow = {(d, c, k): float(rng.uniform(0.01, 0.2)) for d in ("h2d", "d2h") for c in (4, 16) for k in (32, 132)}
    ref = {(d, c, k): float(rng.uniform(0.0, 0.05)) for d in ("h2d", "d2h") for c in (4, 16) for k in (32, 132)}
    records = []
    for (d, c, k), v in slow.items():
        records.append({"direction": d, "chunk_bytes": c << 10, "kind": "staged", "device_sms": k, "slowdown": v})
        records.append({"direction": d, "chunk_bytes": c << 10, "kind": "contiguous", "device_sms": k,
                        "slowdown": ref[(d, c, k)]})
    records.append({"direction": "h2d", "chunk_bytes": 32 << 10, "kind": "staged", "device_sms": 32,
                    "error": "RuntimeError: out of memory"})
    text = bench.render({"device": "GPU X", "records": records})
    rows = [line for line in text.splitlines() if line.startswith("| h2d") or line.startswith("| d2h")]
    assert len(rows) == 4  # the failed record makes no row
    for d in ("h2d", "d2h"):
        for c in (4, 16):
            (row,) = [r for r in rows if r.startswith(f"| {d} | {c} KiB |")]
            lo, hi = sorted((ref[(d, c, 32)], ref[(d, c, 132)]))
            assert row == (f"| {d} | {c} KiB | {slow[(d, c, 32)]:.1%} | {slow[(d, c, 132)]:.1%} | "
                           f"{lo:.1%} to {hi:.1%} |")


def test_step_table_gives_alone_against_the_fewest_sms_and_the_geomean(bench):
    rng = np.random.default_rng(4)
    cases, spans = [], {32: [], 66: []}
    for model, d in (("m1", "h2d"), ("m2", "d2h")):
        contenders = [{"name": "contiguous", "transfer_alone_ms": 1.0, "span_over_contiguous": 1.0}]  # the reference
        for k in (32, 66):
            alone, span = float(rng.uniform(5, 50)), float(rng.uniform(1.0, 1.2))
            spans[k].append(span)
            contenders.append({"name": f"staged@{k}", "transfer_alone_ms": alone, "span_over_contiguous": span})
        cases.append({"model": model, "tp": 1, "direction": d, "chunk_bytes": 32 << 10, "blocks": 512, "reps": 3,
                      "contenders": contenders})
    text = bench.render({"device": {"name": "GPU Y"}, "cases": cases})
    assert text.startswith("GPU Y, 3 repetitions") and "| step/contiguous @32 | step/contiguous @66 |" in text
    for case in cases:
        _, a, b = case["contenders"]
        row = next(line for line in text.splitlines() if line.startswith(f"| {case['model']} |"))
        assert row == (f"| {case['model']} | 1 | {case['direction']} | 32 KiB | 512 | "
                       f"{b['transfer_alone_ms'] / a['transfer_alone_ms']:.3f} | "
                       f"{a['span_over_contiguous']:.3f} | {b['span_over_contiguous']:.3f} |")
    geo = next(line for line in text.splitlines() if line.startswith("| geomean"))
    for v in spans.values():
        assert f"{math.exp(sum(map(math.log, v)) / len(v)):.3f}" in geo
