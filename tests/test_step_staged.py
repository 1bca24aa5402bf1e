"""The step benchmark's staged contender and host layouts on the CPU: ``triton.staged``
registered for the CPU by a test plugin (its kernels in Triton's interpreter, its link the
host reference), every contender's bytes checked on both host layouts; and the route label
of a mover that takes a staged route by itself, as a device mover does on a block-major host."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import kvswap
from kvswap import BlockMover, Direction, Policy
from kvswap.cli import models
from kvswap.calibration import step, step_contenders, step_interference
from kvswap.calibration.step import HostEnv, StepSettings
from kvswap.mover.route_choice import MIN_RUN_BYTES, staged_choice
from kvswap.registry.platform import detect
from kvswap.registry.plugins import plugin_host
from fakes import install_staged_on_cpu

pytest.importorskip("triton")
from kvswap.backends.triton_generic.launch import interpreting  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the staged kernels in Triton's CPU interpreter")
TINY = models.ModelShape("tiny", layers=3, kv_heads=2, head_dim=16)


@pytest.fixture
def staged_on_cpu() -> None:
    install_staged_on_cpu()


def test_the_staged_contender_moves_every_byte_on_both_host_layouts(staged_on_cpu):
    assert step.routes_available(Direction.D2H, "cpu") == ("host.reference", None, "triton.staged")
    env = HostEnv(lambda: sum(range(2000)))
    settings = StepSettings(blocks=(5,), step_ms=1.0, reps=2)
    doc = step.run_step_bench(env, detect(plugin_host(), "cpu"), [TINY.at(1)], [Direction.H2D, Direction.D2H],
                              settings)
    assert [(c["host_layout"], c["direction"]) for c in doc["cases"]] == [
        ("per-layer", "h2d"), ("per-layer", "d2h"), ("block-major", "h2d"), ("block-major", "d2h")]
    assert not any("staged" in n for n in doc["notes"])
    for case in doc["cases"]:
        by = {c["name"]: c for c in case["contenders"]}
        assert list(by) == ["contiguous", "default", "low_interference", "batch", "staged", "vllm"]
        for c in by.values():
            assert c["error"] is None, c
            assert c["bytes_checked"] == 2 * 2 * case["bytes"]  # alone and beside, each repetition
            assert c["span_over_contiguous"] > 0
        assert (by["staged"]["route"], by["staged"]["staged"]) == ("triton.staged", True)
        # a mover between host tensors keeps its resolved route: only the forced contender stages
        assert (by["default"]["route"], by["default"]["staged"]) == ("host.reference", False)


def _long_run_mover() -> tuple[BlockMover, tuple, str]:
    """A default d2h mover onto a block-major host cache of one 64 KiB run per block, with
    what a device mover would hold there: the staged route's by-id steps and its note."""
    kb = MIN_RUN_BYTES // 1024
    gen = torch.Generator().manual_seed(5)
    device = [torch.randn(2, 8, kb // 4, 8, 64, generator=gen).to(torch.float16) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kvswap.NumaWarning)
        cache = kvswap.host_cache(device, 8, block_dim=1)
    mover = BlockMover(device, list(cache.views), "d2h", block_dim=1, issuing_thread=False)
    t = mover._plan.templates[0]
    fn = kvswap.resolve("d2h", device="cpu", block_bytes=t.chunk_sizes)
    steps, note = staged_choice(fn, t, Direction.D2H, Policy(), dict(device="cpu"))
    assert steps is not None
    return mover, steps, note


def test_a_mover_that_stages_by_itself_is_labelled_with_the_staged_route(staged_on_cpu, monkeypatch):
    mover, steps, note = _long_run_mover()
    sid, did = np.array([1, 4]), np.array([0, 6])
    assert step.route_label(mover, sid, did) == "host.reference"  # on the CPU: no staged route of its own
    plan = mover.explain()
    monkeypatch.setattr(mover, "explain", lambda: f"{plan}\n  note: {note}")
    assert step.route_label(mover, sid, did) == "host.reference"  # the note, but no staged by-id step
    mover._plan.ids = steps
    label = step.route_label(mover, sid, did)
    assert label == "triton.staged" and step_contenders.is_staged(mover, label)
    mover.close()


def test_step_interference_measures_the_staged_route_on_a_block_major_host(staged_on_cpu):
    env = HostEnv(lambda: sum(range(3000)))
    dev = detect(plugin_host(), "cpu")
    cache = models.ModelShape("t", 2, 2, 16).at(1)
    records = step_interference.measure(env, dev, [Direction.H2D, Direction.D2H], reps=2, cache=cache,
                                        num_blocks=40, staged=True, staged_pool_bytes=50 * cache.block_bytes)
    # after each staged row, a contiguous copy of its job's bytes, measured the same way
    assert [(r["direction"], r["route"], r["kind"], r["host_layout"]) for r in records] == [
        ("h2d", "host.reference", "batch", "per-layer"), ("d2h", "host.reference", "batch", "per-layer"),
        ("h2d", "triton.staged", "staged", "block-major"), ("h2d", "contiguous copy", "contiguous", "block-major"),
        ("d2h", "triton.staged", "staged", "block-major"), ("d2h", "contiguous copy", "contiguous", "block-major")]
    # the copies' buffers hold the largest job (25 blocks); a larger one says in how many pieces it went
    assert records[3]["route"] == "contiguous copy"
    for r in records:
        assert "error" not in r, r
        assert r["bytes_checked"] == 2 * r["blocks"] * cache.block_bytes
        # a job of half its pool (the probe, at least): 40 blocks per layer, 50 block-major (sized by bytes)
        assert r["blocks"] == (20 if r["kind"] == "batch" else 25)
        assert 0.0 <= r["slowdown"] < 1 and r["compute_ratio"] > 0
    assert "contiguous" not in str(step_interference.profile_rows(records))  # a reference, not a route
    # the staged route's device side runs on the SMs it was bound with
    assert all(r["num_sms"] >= 1 for r in records if r["kind"] == "staged")
    plain = step_interference.measure(env, dev, [Direction.H2D], reps=1, cache=cache, num_blocks=40)
    assert [r["kind"] for r in plain] == ["batch"]  # kvswap calibrate's call: the staged route left out
