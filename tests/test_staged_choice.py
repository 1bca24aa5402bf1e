"""Whether a device mover takes the staged route: by predicted makespan where the
calibration measured it, by rule where it did not, never on a per-layer host (hand-built
calibrations, a batch route, a kernel and ``triton.staged`` registered for the CPU, the
staged kernels in Triton's interpreter)."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import kvswap
from kvswap import BlockMover, Calibration, Curve, Direction, Policy
from kvswap.mover.route_choice import MIN_RUN_BYTES, REFERENCE_BLOCKS, staged_choice
from kvswap.registry.plugins import create_plugin_host, reset_plugin_host
from kvswap.resolution.routing import step_cost

from test_resolver import Offer, recording_impl

pytest.importorskip("triton")
from kvswap.backends.triton_generic.launch import interpreting  # noqa: E402
from kvswap.backends.triton_generic.staged import staged_impl  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="binds the staged kernels in Triton's CPU interpreter")
KiB = 1024
CHUNK = 4 * KiB
LAYERS = 8  # 16 chunks of 4 KiB: one 64 KiB run a block on a block-major host
DMA = [(4 * KiB, 5.0), (256 * KiB, 50.0)]
KERN = [(4 * KiB, 45.0), (256 * KiB, 48.0)]
HOST = [("acme.dma", 20.0, 0.5), ("acme.kern", 30.0, 0.01), ("triton.staged", 40.0, 0.01)]


def calibration(staged_gbps=None, staged_slow=0.01, kern_slow=0.3, **kw) -> Calibration:
    """The batch route at 5 GB/s and the kernel at 45 on 4 KiB chunks; the staged route at
    ``staged_gbps`` (None: not measured)."""
    curves = [Curve("acme.dma", d, DMA) for d in ("h2d", "d2h")] + [
        Curve("acme.kern", d, KERN, num_sms=8) for d in ("h2d", "d2h")]
    slow = [("acme.dma", 0, 0.0), ("acme.kern", 8, kern_slow)]
    if staged_gbps is not None:
        curves += [Curve("triton.staged", d, ((CHUNK, staged_gbps),)) for d in ("h2d", "d2h")]
        slow += [("triton.staged", 32, staged_slow, CHUNK), ("staged", 32, staged_slow, CHUNK)]
    return Calibration(source="test calibration", platform="cpu", scope="device", curves=tuple(curves),
                       kernel_sms={"h2d": 8, "d2h": 8}, host_cost={"h2d": HOST, "d2h": HOST},
                       slowdown_by_sms={"h2d": slow, "d2h": slow}, **kw)


@pytest.fixture
def host():
    impls = [recording_impl("acme.dma"), recording_impl("acme.kern", kind="kernel"),
             dataclasses.replace(staged_impl(), platforms=("cpu",), requires_pinned=False)]
    h = create_plugin_host(entry_points=[], env={}, extra=[("p", Offer(impls))])
    reset_plugin_host(h)
    yield h
    reset_plugin_host(None)


def _mover(block_major: bool, seed: int, layers: int = LAYERS) -> BlockMover:
    gen = torch.Generator().manual_seed(seed)
    device = [torch.randn(2, 8, 16, 2, 64, generator=gen).to(torch.float16) for _ in range(layers)]
    if block_major:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", kvswap.NumaWarning)
            host = list(kvswap.host_cache(device, 8, block_dim=1).views)
    else:
        host = [torch.empty_like(t) for t in device]
    return BlockMover(device, host, "d2h", block_dim=1, issuing_thread=False)


def _choose(host, cal, block_major=True, policy=Policy(), seed=0, layers=LAYERS):
    mover = _mover(block_major, seed, layers)
    t = mover._plan.templates[0]
    assert t.chunk_sizes == (CHUNK,)
    args = dict(device="cpu", block_bytes=list(t.chunk_sizes), calibration=cal, host=host)
    fn = kvswap.resolve("d2h", policy=policy, **args)
    choice = staged_choice(fn, t, Direction.D2H, policy, args)
    mover.close()
    return choice, fn, t, args


def _t(gbps: float, a_us: float, n: int = REFERENCE_BLOCKS) -> float:
    """The predicted copy of ``n`` blocks at ``gbps`` plus ``a_us`` + 10 ns a descriptor."""
    return n * 16 * CHUNK / (gbps * 1e9) + (a_us + 0.01 * n * 16) * 1e-6


MAKESPAN = "predicted step makespan max(compute + slowdown x transfer, transfer), compute = the quickest transfer"


def test_the_mover_takes_the_staged_route_where_it_is_predicted_faster(host):
    choice, fn, t, _ = _choose(host, calibration(staged_gbps=50.0))
    assert fn.plan.routes[0].impl == "acme.kern"  # the resolved route: 45 GB/s against 5
    assert choice.steps is not None
    note = choice.note
    assert note.startswith("staged: triton.staged moves each block as 1 host run(s) of 65536+ bytes")
    assert f"{MAKESPAN} for a job of {REFERENCE_BLOCKS} blocks (test calibration)" in note
    # Each candidate's prediction, the winner marked: 32 MiB at 50 GB/s plus 40 us + 8192 x 10 ns,
    # beside a compute as long as that, the quickest copy.
    want = _t(50.0, 40)
    assert f"triton.staged {want * 1e3:.3g} ms, step {step_cost(want, 0.01, want) * 1e3:.3g} ms " \
           f"(compute slowdown 1%) <- chosen" in note
    assert "acme.kern" in note and "acme.dma" in note and note.count("<- chosen") == 1


def test_the_mover_keeps_its_resolved_route_where_the_staged_route_is_predicted_slower(host):
    # Staged at 30 GB/s: 1.5 x the kernel's copy, longer than the kernel's 30% slowdown costs.
    choice, fn, _, _ = _choose(host, calibration(staged_gbps=30.0))
    assert choice.steps is None
    assert choice.note.startswith(f"staged route not used: {MAKESPAN}")
    assert "acme.kern" in choice.note.split("<- chosen")[0].rsplit(";", 1)[-1]


def test_a_route_as_fast_that_slows_the_compute_loses_to_the_staged_route(host):
    # Staged at 40 GB/s against the kernel at 45 that takes 30% of the compute: the kernel's
    # copy is quicker, its step is not.
    choice, _, _, _ = _choose(host, calibration(staged_gbps=40.0))
    assert _t(45.0, 30) < _t(40.0, 40) < step_cost(_t(45.0, 30), 0.3, _t(45.0, 30))
    assert choice.steps is not None and MAKESPAN in choice.note
    # The policy's preference does not change this decision: it ranks what an engine pays, the step.
    quiet, _, _, _ = _choose(host, calibration(staged_gbps=40.0), policy=Policy(prefer="low_interference"))
    assert quiet.steps is not None


def test_the_build_time_choice_weighs_each_routes_slowdown_with_its_copy(host):
    choice, _, _, _ = _choose(host, calibration(staged_gbps=42.0, kern_slow=0.05))
    assert choice.steps is None  # the kernel at 45 GB/s, 5% slowdown, against staged at 42
    choice, _, _, _ = _choose(host, calibration(staged_gbps=46.0, kern_slow=0.05))
    assert choice.steps is not None
    # The staged route slowing the compute by 20% and the kernel by 5%: the kernel ends the step sooner.
    choice, _, _, _ = _choose(host, calibration(staged_gbps=46.0, staged_slow=0.2, kern_slow=0.05))
    assert choice.steps is None


def test_without_staged_measurements_the_rule_decides_and_explain_says_so(host):
    choice, _, _, _ = _choose(host, calibration())  # runs of 64 KiB: the rule takes it
    assert choice.steps is not None
    assert "chosen by rule: host runs of 64 KiB or more (the calibration holds no staged measurement)" in choice.note
    assert MIN_RUN_BYTES == 64 * KiB


def test_runs_under_the_rules_length_take_the_staged_route_where_a_measurement_predicts_it(host):
    # 4 layers: one run of 32 KiB a block, under MIN_RUN_BYTES. Without a staged measurement the
    # rule leaves it; with one, the predicted step decides (50 GB/s against the kernel's 45 and 30%).
    ruled, _, _, _ = _choose(host, calibration(), layers=4)
    assert ruled.steps is None
    assert ruled.note.startswith("staged route not used (by rule: the calibration holds no staged measurement): "
                                 "the host side holds a block as 1 run(s) of 32768+ bytes")
    measured, _, _, _ = _choose(host, calibration(staged_gbps=50.0), layers=4)
    assert measured.steps is not None
    assert measured.note.startswith("staged: triton.staged moves each block as 1 host run(s) of 32768+ bytes")
    assert "triton.staged" in measured.note.split("<- chosen")[0].rsplit(";", 1)[-1]


def test_host_runs_shorter_than_measured_scale_the_staged_curve_by_what_the_link_loses(host):
    # Measured on runs of 64 chunks (256 KiB at 4 KiB chunks): the batch route runs at 50 GB/s
    # there and at 35 on this mover's 64 KiB runs, so 50 GB/s of staged becomes 35, under the kernel's 45
    # by more than the kernel's 10% slowdown costs.
    fast = calibration(staged_gbps=50.0, staged_chunks=64, kern_slow=0.1)
    scale = fast.predict("acme.dma", "batch", Direction.D2H, 64 * KiB) / 50.0
    assert scale == pytest.approx(0.7)
    choice, _, _, _ = _choose(host, fast)
    assert choice.steps is None and f"triton.staged {_t(50.0 * scale, 40) * 1e3:.3g} ms," in choice.note
    assert "the staged curve scaled by 0.70: host runs of 65536 bytes, shorter than the 64 chunks" in choice.note
    same, _, _, _ = _choose(host, calibration(staged_gbps=50.0, staged_chunks=16, kern_slow=0.1))  # runs as long
    assert same.steps is not None and "scaled" not in same.note
    assert f"triton.staged {_t(50.0, 40) * 1e3:.3g} ms," in same.note


def test_a_per_layer_host_never_takes_the_staged_route_even_where_predicted_faster(host):
    choice, _, _, _ = _choose(host, calibration(staged_gbps=500.0), block_major=False)
    assert choice.steps is None
    assert choice.note.startswith("staged route not used: the host side holds a block as 16 run(s) of 4096+ bytes, "
                                  "every chunk apart (a per-layer host cache)")
