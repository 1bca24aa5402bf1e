"""tests/bench/step_vs_base.py: which cases it compares and what it computes, on two made-up
step JSON documents (the older one without host layouts, as runs from before them were)."""
from __future__ import annotations

import json
import math

import numpy as np

from bench_scripts import load_bench


def _load():
    return load_bench("step_vs_base.py", "step_vs_base")


def _case(model, tp, direction, blocks, spans, host_layout=None, error=None):
    case = dict(model=model, tp=tp, direction=direction, blocks=blocks,
                contenders=[dict(name=n, makespan_over_compute=v, error=error if n == "default" else None)
                            for n, v in spans.items()])
    if host_layout:
        case["host_layout"] = host_layout
    return case


def test_it_compares_the_defaults_of_the_per_layer_cases_both_runs_have(tmp_path, capsys):
    bench = _load()
    rng = np.random.default_rng(3)
    keys = [("llama-3.1-8b", 1, "h2d", 32), ("llama-3.1-8b", 1, "d2h", 512), ("qwen2.5-7b", 8, "h2d", 512)]
    base_spans = {k: (1.0 + rng.random(), 1.0 + rng.random()) for k in keys}
    head_ratio = {keys[0]: 0.97, keys[1]: 1.08, keys[2]: 1.02}
    base = dict(cases=[_case(*k, {"default": d, "batch": b}) for k, (d, b) in base_spans.items()]
                + [_case("gone", 1, "h2d", 32, {"default": 1.1})])
    head = dict(cases=[_case(*k, {"default": d * head_ratio[k], "batch": b * 1.01, "staged": 9.0},
                             host_layout="per-layer") for k, (d, b) in base_spans.items()]
                + [_case(*k, {"default": 50.0}, host_layout="block-major") for k in keys]  # never compared
                + [_case("broken", 1, "h2d", 32, {"default": 1.2}, host_layout="per-layer", error="Boom")])
    (tmp_path / "b.json").write_text(json.dumps(base))
    (tmp_path / "h.json").write_text(json.dumps(head))
    result = bench.main([str(tmp_path / "b.json"), str(tmp_path / "h.json")])
    got = {(r["model"], r["tp"], r["direction"], r["blocks"]): r for r in result["rows"]}
    assert set(got) == set(keys)
    for k in keys:
        assert math.isclose(got[k]["ratio"], head_ratio[k]) and math.isclose(got[k]["batch_ratio"], 1.01)
    assert result["cases"] == 3 and result["within"] == 2 and math.isclose(result["worst"], 1.08)
    assert math.isclose(result["geomean"], (0.97 * 1.08 * 1.02) ** (1 / 3))
    assert result["only_base"] == [("gone", 1, "h2d", 32)] and result["only_head"] == []
    out = capsys.readouterr().out
    assert "2/3 cases; worst 1.080" in out and "| llama-3.1-8b | 1 | d2h | 512 |" in out and "only in base: 1" in out
