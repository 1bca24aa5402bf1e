"""triton.kernel on a GPU: both directions between pinned host memory and device memory,
the resolve() path, the SM budget, streams, and launch buffers under pressure.

Every case is ``gpu``-marked: skipped with a reason on machines without a GPU, where
``test_triton_copy.py`` runs the same kernel in Triton's interpreter.
"""
from __future__ import annotations

import numpy as np
import pytest

import kvswap
from kvswap import BindContext, Direction, Policy
from kvswap.backends import triton_generic as tg
from kvswap.backends.triton_generic import kernel as tk
from kvswap.backends.triton_generic.launch import interpreting
from kvswap.testing.memory import make_transfer

from triton_cases import log_sizes, mixed_layout

pytestmark = pytest.mark.gpu
KiB = 1024
DIRECTIONS = [Direction.H2D, Direction.D2H, Direction.D2D]




@pytest.fixture
def gpu():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: Triton would not run on the GPU")
    from kvswap.registry.platform import detect
    from kvswap.registry.plugins import plugin_host

    return detect(plugin_host(), "cuda:0")


def torch_device(info) -> str:
    return f"cuda:{info.index or 0}"


@pytest.mark.parametrize("alignment", [16, 8, 1])
@pytest.mark.parametrize("n", [1, 17, 2000])
@pytest.mark.parametrize("direction", DIRECTIONS, ids=str)
def test_random_descriptors_copied_exactly(gpu, direction: Direction, n: int, alignment: int) -> None:
    seed = 1000 * n + 10 * alignment + (direction is Direction.D2H)
    rng = np.random.default_rng(seed)
    sizes = log_sizes(rng, n, 1, 256 * KiB if n <= 17 else 64 * KiB)
    if alignment > 1:
        whole = rng.random(n) < 0.5
        sizes[whole] = np.maximum(sizes[whole] // alignment * alignment, alignment)
    t = make_transfer(rng, seed, direction, torch_device(gpu), alignment, sizes)
    launch = tg.copy(*t.descriptors, num_sms=4, device=torch_device(gpu))
    assert 1 <= launch.grid <= 4
    t.check(f"triton.kernel {direction}, n={n}, alignment {alignment}")


@pytest.mark.parametrize("alignment", [16, 8, 1])
@pytest.mark.parametrize("direction", DIRECTIONS, ids=str)
def test_each_kernel_variant(gpu, direction: Direction, alignment: int) -> None:
    # Everything a multiple of ``alignment``: 16-byte vectors, 8-byte words, any alignment.
    rng = np.random.default_rng(50 + alignment)
    sizes = log_sizes(rng, 700, 1, 128 * KiB) // alignment * alignment + alignment
    t = make_transfer(rng, 50 + alignment, direction, torch_device(gpu), alignment, sizes)
    launch = tg.copy(*t.descriptors, num_sms=6, device=torch_device(gpu))
    assert launch.tile.align == alignment
    t.check(f"variant align={alignment}, {direction}")


@pytest.mark.parametrize("direction", DIRECTIONS, ids=str)
def test_mixed_sizes_and_alignments(gpu, direction: Direction) -> None:
    rng = np.random.default_rng(7 + (direction is Direction.D2H))
    edge = np.array([1, 2, 7, 8, 9, 15, 16, 17, 24, 4095, 4096, 4100, 8200, 65536, 256 * KiB], dtype=np.int64)
    sizes = rng.permutation(np.concatenate([edge, log_sizes(rng, 985, 1, 128 * KiB)]))
    t = make_transfer(rng, 7, direction, torch_device(gpu), 1, sizes,
                      mixed_layout(rng, sizes), mixed_layout(rng, sizes))
    tg.copy(*t.descriptors, num_sms=8, device=torch_device(gpu))
    t.check(f"mixed sizes and alignments, {direction}")


@pytest.mark.parametrize("block", [4 * KiB, 64 * KiB])
@pytest.mark.parametrize("direction", DIRECTIONS, ids=str)
def test_full_batch_of_uniform_blocks(gpu, direction: Direction, block: int) -> None:
    rng = np.random.default_rng(block)
    n = 10_000 if block == 4 * KiB else 2_000
    sizes = np.full(n, block, dtype=np.int64)
    t = make_transfer(rng, block, direction, torch_device(gpu), 64, sizes)
    tg.copy(*t.descriptors, num_sms=4, device=torch_device(gpu))
    t.check(f"{n} x {block} B, {direction}")


@pytest.mark.parametrize("direction", DIRECTIONS, ids=str)
def test_resolve_forced_kernel(gpu, direction: Direction) -> None:
    fn = kvswap.resolve(direction, device=torch_device(gpu), policy=Policy(force="triton.kernel", max_sms=4))
    assert fn.impls == ("triton.kernel",)
    assert fn.plan.params["triton.kernel"]["num_sms"] <= 4
    rng = np.random.default_rng(3)
    sizes = log_sizes(rng, 300, 1, 64 * KiB)
    t = make_transfer(rng, 3, direction, torch_device(gpu), 1, sizes,
                      mixed_layout(rng, sizes), mixed_layout(rng, sizes))
    fn(*t.descriptors)
    t.check(f"resolve({direction}, force='triton.kernel')")


@pytest.mark.parametrize("direction", DIRECTIONS, ids=str)
def test_sm_budget_bounds_the_grid(gpu, direction: Direction) -> None:
    rng = np.random.default_rng(9)
    sizes_by_case = {
        "one block": np.array([300 * KiB], dtype=np.int64),
        "few large": np.full(3, 256 * KiB, dtype=np.int64),
        "many small": np.full(5000, 4 * KiB, dtype=np.int64),
        "many mixed": log_sizes(rng, 3000, 1, 32 * KiB),
    }
    for budget in (1, 2, 4, 8, 12, gpu.compute_units):
        fn = tk.bind(BindContext(direction, gpu, {"num_sms": budget}))
        assert fn.num_sms == budget
        for case, sizes in sizes_by_case.items():
            t = make_transfer(rng, budget, direction, torch_device(gpu), 1, sizes)
            launch = fn(*t.descriptors, None)
            assert launch is fn.last_launch
            work = -(-len(sizes) // launch.tile.jobs) * launch.tile.splits
            assert launch.grid == min(budget, work) <= budget, (budget, case, launch)
            t.check(f"budget {budget}, {case}, {direction}")
        # Enough work (hundreds of tiles) fills the whole budget.
        assert fn.last_launch.grid == budget


@pytest.mark.parametrize("host_tiles", [0, 1_000_000], ids=["uploaded", "read-from-host"])
@pytest.mark.parametrize("direction", DIRECTIONS, ids=str)
def test_launch_buffers_survive_a_busy_stream(gpu, direction: Direction, host_tiles: int) -> None:
    """40 launches enqueued while the stream is held up by a long kernel: each launch
    buffer (pinned, and its device twin where the descriptors are uploaded) must stay
    untouched until its own kernel ran, or blocks land in wrong places. 40 calls are more
    than the pool keeps, so the wait for the oldest buffer runs too."""
    import torch

    dev = torch_device(gpu)
    rng = np.random.default_rng(13)
    calls, per_call = 40, 50
    sizes = log_sizes(rng, calls * per_call, 1, 16 * KiB)
    t = make_transfer(rng, 13, direction, dev, 1, sizes, mixed_layout(rng, sizes), mixed_layout(rng, sizes))
    src, dst, n = t.descriptors
    fn = tk.bind(BindContext(direction, gpu, {"num_sms": 4, "host_tiles": host_tiles}))
    stream = torch.cuda.Stream(device=dev)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # roughly 0.1 s of GPU time before any copy runs
    for i in range(calls):
        sl = slice(i * per_call, (i + 1) * per_call)
        # Alternate the ways a stream may be passed: a torch stream and a raw handle.
        handle = stream if i % 2 else stream.cuda_stream
        fn(src[sl], dst[sl], n[sl], handle)
        assert fn.last_launch.descriptors == ("device" if host_tiles == 0 else "host")
    stream.synchronize()
    t.check(f"40 launches queued behind a busy stream, {direction}")


def test_available_on_this_gpu(gpu) -> None:
    assert tk.availability(gpu) is None
    fn = kvswap.resolve("h2d", device=torch_device(gpu), policy=Policy(force="triton.kernel"))
    cand = {c.name: c for c in fn.plan.candidates}
    assert cand["triton.kernel"].available


@pytest.mark.parametrize("direction", DIRECTIONS, ids=str)
def test_descriptors_read_from_host_or_uploaded(gpu, direction: Direction) -> None:
    # The same batch with the descriptors read straight from pinned memory, then uploaded
    # first; and the default choice: small batches from host, many tiles per program uploaded.
    rng = np.random.default_rng(17)
    sizes = log_sizes(rng, 300, 1, 16 * KiB)
    for host_tiles, where in ((1_000_000, "host"), (0, "device")):
        fn = tk.bind(BindContext(direction, gpu, {"num_sms": 4, "host_tiles": host_tiles}))
        t = make_transfer(rng, host_tiles, direction, torch_device(gpu), 1, sizes,
                          mixed_layout(rng, sizes), mixed_layout(rng, sizes))
        assert fn(*t.descriptors, None).descriptors == where
        t.check(f"descriptors from {where}, {direction}")
    fn = tk.bind(BindContext(direction, gpu, {"num_sms": 4}))
    for n, where in ((5, "host"), (5000, "device")):
        sizes = np.full(n, 4 * KiB, dtype=np.int64)
        t = make_transfer(rng, n, direction, torch_device(gpu), 16, sizes)
        assert fn(*t.descriptors, None).descriptors == where
        t.check(f"default choice for {n} blocks, {direction}")


@pytest.mark.parametrize("direction", DIRECTIONS, ids=str)
def test_one_compiled_variant_serves_every_batch_length(gpu, direction: Direction) -> None:
    # bind() compiles the variants for its block sizes; batches of other lengths and
    # splits reuse them (n and splits are not specialised) and are launched directly.
    from kvswap.backends.triton_generic.compiled import variant_key

    fn = tk.bind(BindContext(direction, gpu, {"num_sms": 4, "precompile": (64 * KiB,)}))
    (tile,) = fn.prepare((64 * KiB,))
    assert tile in fn.variants and fn.variants.get(tile).direct
    compiled = len(fn.variants)
    rng = np.random.default_rng(23)
    seen = set()
    for n in (1, 2, 16, 17, 40):
        sizes = np.full(n, 64 * KiB, dtype=np.int64)
        t = make_transfer(rng, n, direction, torch_device(gpu), 16, sizes)
        launch = fn(*t.descriptors, None)
        assert variant_key(launch.tile) == variant_key(tile)
        seen.add(launch.tile.splits)
        t.check(f"{n} x 64 KiB through one variant, {direction}")
    assert len(fn.variants) == compiled and len(seen) > 1


def test_launch_hooks_still_called(gpu) -> None:
    # A profiler's launch hook (Triton's knobs) sees the direct launches.
    knobs = pytest.importorskip("triton.knobs")
    chain = knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton keeps one launch hook, not a chain")
    seen = []
    hook = seen.append
    chain.add(hook)
    try:
        rng = np.random.default_rng(29)
        sizes = log_sizes(rng, 20, 1, 8 * KiB)
        t = make_transfer(rng, 29, Direction.H2D, torch_device(gpu), 1, sizes)
        tk.bind(BindContext(Direction.H2D, gpu, {"num_sms": 2}))(*t.descriptors, None)
    finally:
        chain.remove(hook)
    t.check("with a launch hook")
    assert len(seen) == 1 and "copy_kernel" in seen[0].get()["name"]


@pytest.mark.parametrize("direction", DIRECTIONS, ids=str)
def test_batch_tiers_launch_on_the_sms_of_the_batch_size(gpu, direction: Direction) -> None:
    from kvswap import Calibration, Curve

    curves = tuple(Curve(name, direction, ((4 * KiB, g), (64 * KiB, g)), sms)
                   for name, g, sms in (("*batch", 5.0, None), ("*kernel", 45.0, 4)))
    cal = Calibration(source="test tiers", platform=gpu.platform, scope="device", curves=curves,
                      kernel_sms={str(direction): 4}, kernel_min_batch={str(direction): 8},
                      kernel_sms_by_batch={str(direction): [[4 * KiB, [[1, 4], [100, 16], [3000, 4]]]]},
                      identity=gpu.identity)
    fn = kvswap.resolve(direction, device=torch_device(gpu), block_bytes=4 * KiB, calibration=cal)
    route = next(r for r in fn.plan.routes if r.at_bytes == 4 * KiB)
    assert route.impl == "triton.kernel" and route.sms_by_batch == ((1, 4), (100, 16), (3000, 4))
    rng = np.random.default_rng(21)
    for n, sms in ((20, 4), (500, 16), (5000, 4)):
        t = make_transfer(rng, n, direction, torch_device(gpu), 16, np.full(n, 4 * KiB, dtype=np.int64))
        ((name, got, _),) = fn.assign(*t.descriptors)
        assert (name, got) == ("triton.kernel", sms)
        fn(*t.descriptors)
        launch = fn._fns[(name, sms)].last_launch  # the binding at that SM count did the copy
        assert launch.n == n and 1 <= launch.grid <= sms
        t.check(f"tiered resolve {direction}, n={n} on {sms} SMs")
