"""``submit(..., within=seconds)``: where the copy has time beside the engine's compute, a
job that would run on a kernel takes the route that uses no SMs when that is predicted to
end the step sooner (hand-built calibrations and routes, on the CPU)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import kvswap
from kvswap import BlockMover, ConfigurationError, Policy
from kvswap.mover.within import QuietChoice
from kvswap.registry.plugins import create_plugin_host, reset_plugin_host
from kvswap.resolution.routing import step_cost

from mover_layouts import Pool, expected_after, layouts
from test_resolver import LOG, Offer, cpu_cal, recording_impl

KiB = 1024
# At 4 KiB the kernel is 9x faster than the batch route, but slows the compute by 30%.
DMA = [(4 * KiB, 5.0), (256 * KiB, 50.0)]
KERN = [(4 * KiB, 45.0), (256 * KiB, 48.0)]
HOST = {"h2d": [("acme.dma", 20.0, 0.5), ("acme.kern", 30.0, 0.01)],
        "d2h": [("acme.dma", 20.0, 0.5), ("acme.kern", 30.0, 0.01)]}
SLOW = {d: [("acme.dma", 0, 0.0), ("acme.kern", 4, 0.2), ("acme.kern", 8, 0.3)] for d in ("h2d", "d2h")}


def _host(**kw):
    impls = [recording_impl("acme.dma"), recording_impl("acme.kern", kind="kernel")]
    cal = cpu_cal([("acme.dma", DMA, None), ("acme.kern", KERN, 8)], host_cost=HOST, slowdown_by_sms=SLOW,
                  kernel_sms={"h2d": 8, "d2h": 8}, **kw)
    return create_plugin_host(entry_points=[], env={}, extra=[("p", Offer(impls, cal))])


@pytest.fixture
def installed():
    reset_plugin_host(_host())
    yield
    reset_plugin_host(None)


def test_step_cost_is_the_later_of_the_slowed_compute_and_the_copy():
    assert step_cost(0.004, 0.3, 0.020) == pytest.approx(0.020 + 0.3 * 0.004)
    assert step_cost(0.030, 0.3, 0.020) == pytest.approx(0.030)  # the copy ends last
    assert step_cost(0.030, 0.0, 0.020) == pytest.approx(0.030)
    # The copy outlasts the compute alone, but not the slowed compute: 6.3 ms late.
    assert step_cost(0.021, 0.3, 0.020) == pytest.approx(0.020 + 0.3 * 0.021)
    assert step_cost(0.027, 0.5, 0.020) == pytest.approx(0.0335)
    # It outlasts the slowed compute (20 ms of work at 70% is done at 28.6 ms).
    assert step_cost(0.029, 0.3, 0.020) == pytest.approx(0.029)


def test_the_batch_route_where_it_finishes_in_time_the_kernel_where_it_would_not():
    fn = kvswap.resolve("h2d", device="cpu", host=_host(), block_bytes=[4 * KiB])
    assert "acme.dma" in fn.quiet_impls and "acme.kern" not in fn.quiet_impls
    n = 2048
    nbytes = n * 4 * KiB
    # Kernel: 8 MiB / 45 GB/s + 50 us = 0.24 ms at 30%: +0.07 ms of compute. Batch:
    # 8 MiB / 5 GB/s + 1.04 ms = 2.7 ms, no slowdown: within 20 ms it costs nothing.
    assert fn.quieter(4 * KiB, n, nbytes, 0.020) == "acme.dma"
    assert fn.quieter(4 * KiB, n, nbytes, 0.001) is None  # 1 ms: the batch route would end last
    assert fn.quieter(4 * KiB, n, nbytes, 0.0) is None
    # 2.2 ms: the bytes alone (1.68 ms) would fit, but the call's host cost is added to them
    # (2.7 ms): the kernel, whose slowdown costs less than a copy that ends the step late.
    assert fn.quieter(4 * KiB, n, nbytes, 0.0022) is None
    assert fn.quieter(4 * KiB, n, nbytes, 0.0028) == "acme.dma"


def test_predictions_made_up_front_serve_every_batch_length(monkeypatch):
    # A mover predicts once per size and batch tier when it is built; a step then pays a
    # few float operations per new batch length, with the same verdicts as predicting then.
    fresh = kvswap.resolve("h2d", device="cpu", host=_host(), block_bytes=[4 * KiB])
    ready = kvswap.resolve("h2d", device="cpu", host=_host(), block_bytes=[4 * KiB])
    ready.prepare_quieter(4 * KiB)
    lengths = [1, 7, 64, 512, 2048, 8192, 100_000]
    want = {(n, w): fresh.quieter(4 * KiB, n, n * 4 * KiB, w) for n in lengths for w in (0.0, 0.0022, 0.02, 1.0)}
    assert set(want.values()) == {None, "acme.dma"}

    def no_more(*a, **k):
        raise AssertionError("predicted again during a step")

    monkeypatch.setattr(kvswap.resolution.swapfn, "quiet_rates", no_more)
    assert {(n, w): ready.quieter(4 * KiB, n, n * 4 * KiB, w) for n, w in want} == want


def test_a_forced_route_or_a_calibration_without_host_cost_never_switches():
    forced = kvswap.resolve("h2d", device="cpu", host=_host(), block_bytes=[4 * KiB],
                            policy=Policy(force="acme.kern"))
    assert forced.quiet_impls == () and forced.quieter(4 * KiB, 2048, 8 * 2**20, 0.02) is None
    impls = [recording_impl("acme.dma"), recording_impl("acme.kern", kind="kernel")]
    cal = cpu_cal([("acme.dma", DMA, None), ("acme.kern", KERN, 8)], slowdown_by_sms=SLOW)
    bare = kvswap.resolve("h2d", device="cpu", host=create_plugin_host(entry_points=[], env={}, extra=[
        ("p", Offer(impls, cal))]), block_bytes=[4 * KiB])
    assert bare.quieter(4 * KiB, 2048, 8 * 2**20, 0.02) is None  # no host cost: not predicted


@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_a_job_with_time_to_spare_runs_on_the_batch_route_and_every_byte_lands(installed, direction, threaded,
                                                                                monkeypatch):
    # With an issuing thread, that thread decides the route for within, off the engine's.
    decided_on = []
    choose = QuietChoice.__call__

    def recording(self, n, within):
        decided_on.append(threading.current_thread())
        return choose(self, n, within)

    monkeypatch.setattr(QuietChoice, "__call__", recording)
    layout = layouts(bs=16, heads=4, head_dim=32, layers=2)["flash"]  # 4 KiB chunks
    gen = torch.Generator().manual_seed(3)
    src, dst = Pool(layout, 96, gen), Pool(layout, 80, gen)
    before, src_before = dst.snapshot(), src.snapshot()
    rng = np.random.default_rng(4)
    jobs = [(rng.permutation(96)[:64].astype(np.int64), rng.permutation(80)[:64].astype(np.int64)) for _ in range(3)]
    with BlockMover(src.tensors, dst.tensors, direction, block_dim=layout.block_dim,
                    issuing_thread=threaded) as mover:
        assert "acme.kern" in mover.swap_fn.impls and mover.issuing_thread == threaded
        LOG.clear()
        mover.submit(*jobs[0])  # no within: the resolved kernel
        mover.submit(*jobs[1], within=0.020)
        mover.submit(*jobs[2], within=1e-6)  # no time to spare: the kernel
        mover.wait()
        results = mover.poll()
    assert [name for name, _ in LOG] == ["acme.kern", "acme.dma", "acme.kern"]
    assert len(decided_on) == 2
    assert all((t is threading.main_thread()) != threaded for t in decided_on)
    assert all(r.ok for r in results)
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


@pytest.mark.parametrize("within", [-0.001, "soon", True, float("nan")])
def test_within_that_is_no_number_of_seconds_is_refused_before_anything_moves(installed, within):
    layout = layouts()["mla"]
    gen = torch.Generator().manual_seed(5)
    src, dst = Pool(layout, 8, gen), Pool(layout, 8, gen)
    before = dst.snapshot()
    with BlockMover(src.tensors, dst.tensors, "h2d", block_dim=layout.block_dim) as mover:
        with pytest.raises(ConfigurationError, match="within="):
            mover.submit([1], [2], within=within)
        assert mover.poll() == []
    assert dst.matches(before)
