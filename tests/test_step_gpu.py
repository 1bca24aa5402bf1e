"""The step benchmark on a GPU: real per-layer device tensors against both host layouts,
GEMMs beside BlockMover jobs, every contender's bytes checked (no timed assertions)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvswap.cli import models
from kvswap.calibration import step, step_report
from kvswap.mover.route_choice import MIN_RUN_BYTES
from kvswap.registry.platform import detect
from kvswap.registry.plugins import plugin_host
from kvswap.types import Direction

pytestmark = pytest.mark.gpu


def staged_measured() -> bool:
    """Whether the device's calibration measured the staged route: then a mover ranks it
    against its resolved route by the predicted step (a short job may keep the kernel),
    otherwise it stages host runs of MIN_RUN_BYTES or longer by rule."""
    import kvswap

    cal = kvswap.resolve("h2d", device="cuda:0").calibration
    return bool(cal is not None and cal.staged_chunks)


def test_step_bench_on_the_gpu_checks_every_contender():
    dev = detect(plugin_host(), "cuda:0")
    env = step.DeviceEnv(dev, step_ms=2.0)
    assert env.gemms >= 1 and env.gemm_seconds > 0
    # llama-3.1-70b tp8: blocks of 640 KiB (a block-major host run a mover stages by itself);
    # the MLA shape: blocks of 54 KiB, under MIN_RUN_BYTES (by rule the mover keeps its resolved
    # route; where the calibration measured the staged route, the predicted step decides)
    shapes = [models.get("llama-3.1-70b").at(8), models.ModelShape("mla", 3, 1, 576, layout="mla").at(1)]
    measured = staged_measured()
    doc = step.run_step_bench(env, dev, shapes, [Direction.H2D, Direction.D2H],
                              step.StepSettings(blocks=(4, 40), step_ms=2.0, reps=2))
    json.dumps(doc)
    assert len(doc["cases"]) == 16
    assert {c["host_layout"] for c in doc["cases"]} == set(step.HOST_LAYOUTS)
    for case in doc["cases"]:
        by = {c["name"]: c for c in case["contenders"]}
        assert list(by) == [step.CONTIGUOUS, *step.CONTENDERS], by
        assert by[step.CONTIGUOUS]["route"] == "contiguous copy" and by[step.CONTIGUOUS]["span_over_contiguous"] == 1
        assert by["kernel@12"]["route"] == "triton.kernel@12"
        assert (by["staged"]["route"], by["staged"]["staged"]) == ("triton.staged", True)
        long_runs = case["bytes"] // case["blocks"] >= MIN_RUN_BYTES
        for name in ("default", "low_interference"):
            staged = by[name]["staged"]
            assert (by[name]["route"] == "triton.staged") is staged, by[name]
            if case["host_layout"] == "per-layer":  # a per-layer host side is never staged
                assert staged is False, by[name]
            elif not measured:  # by rule: host runs of MIN_RUN_BYTES or longer
                assert staged is long_runs, by[name]
        for c in case["contenders"]:
            assert c["error"] is None, (case["model"], case["host_layout"], case["direction"], c)
            assert c["bytes_checked"] == 2 * 2 * case["bytes"]
            assert c["makespan_ms"] > 0 and c["slowdown"] > 0 and c["submit_us"] > 0
            assert c["span_over_contiguous"] > 0 and c["makespan_over_compute"] >= c["slowdown"]
        assert case["ceiling_gbps"] > 1
        if case["direction"] == "d2h":
            assert by["vllm"]["same_as"] == "batch"
    assert step_report.bars([doc])[0]["cases"] == 16


def test_bench_model_command_on_the_gpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvswap", "bench", "--model", "qwen2.5-7b", "--tp", "4",
                          "--blocks", "8", "--reps", "2", "--step-ms", "2", "--host-layouts", "block-major",
                          "--json", str(tmp_path / "s.json")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "s.json").read_text())
    assert len(doc["cases"]) == 2 and "qwen2.5-7b" in out.stdout and "| bar |" in out.stdout
    measured = staged_measured()
    for case in doc["cases"]:  # blocks of 224 KiB: by rule the default stages them
        default = case["contenders"][1]  # after the contiguous reference
        assert case["host_layout"] == "block-major" and default["name"] == "default"
        assert (default["route"] == "triton.staged") is default["staged"] and (measured or default["staged"])
