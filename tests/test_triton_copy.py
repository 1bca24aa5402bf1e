"""triton.kernel without a GPU: the real kernel in Triton's interpreter over host buffers,
plus its registration, availability and launch shapes.

The kernel tests run where ``TRITON_INTERPRET=1`` (conftest sets it on machines without a
GPU); on a GPU machine the same cases run on the device in ``test_triton_gpu.py``.
"""
from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import numpy as np
import pytest

import kvswap
from kvswap import BindContext, DeviceInfo, Direction, Policy
from kvswap.registry import plugins
from kvswap.backends import triton_generic as tg
from kvswap.backends.triton_generic import kernel as tk
from kvswap.backends.triton_generic import launch
from kvswap.backends.triton_generic.launch import DEFAULT_PLANS, KernelCopy, TilePlan, batch_alignment, interpreting
from kvswap.registry.platform import cpu_device
from kvswap.testing.memory import Layout, make_transfer, scattered

from triton_cases import log_sizes, mixed_layout

KiB = 1024
needs_interpreter = pytest.mark.skipif(
    not (tg.HAS_TRITON and interpreting()),
    reason="runs the kernel in Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest without a GPU); "
    "test_triton_gpu.py runs these cases on a GPU",
)




def run_case(seed: int, sizes: np.ndarray, alignment: int, num_sms: int = 4, mixed: bool = False,
             direction: Direction = Direction.H2D):
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, dtype=np.int64)
    layouts = (mixed_layout(rng, sizes), mixed_layout(rng, sizes)) if mixed else (None, None)
    t = make_transfer(rng, seed, direction, "cpu", alignment, sizes, *layouts)
    launch = tg.copy(*t.descriptors, num_sms=num_sms)
    t.check(f"triton.kernel (interpreter), seed {seed}, alignment {alignment}, mixed={mixed}")
    return launch


# -- the kernel in the interpreter --------------------------------------------------------

@needs_interpreter
@pytest.mark.parametrize("alignment", [16, 8, 1])
@pytest.mark.parametrize("n", [1, 17, 2000])
def test_random_descriptors_copied_exactly(n: int, alignment: int) -> None:
    rng = np.random.default_rng(1000 * n + alignment)
    # Big batches keep to small blocks so the interpreter stays quick.
    hi = 256 * KiB if n <= 17 else 512
    sizes = log_sizes(rng, n, 1, hi)
    if alignment > 1:
        # Aligned addresses with sizes that are and are not multiples of the alignment.
        whole = rng.random(n) < 0.5
        sizes[whole] = np.maximum(sizes[whole] // alignment * alignment, alignment)
    launch = run_case(n * 7 + alignment, sizes, alignment)
    assert 1 <= launch.grid <= 4


@needs_interpreter
@pytest.mark.parametrize("alignment", [16, 8, 1])
def test_each_kernel_variant(alignment: int) -> None:
    # Addresses and sizes all multiples of ``alignment``: the launcher picks the 16-byte
    # vector, 8-byte word or any-alignment variant, and each copies exactly.
    rng = np.random.default_rng(90 + alignment)
    sizes = log_sizes(rng, 40, 1, 64 * KiB) // alignment * alignment + alignment
    launch = run_case(90 + alignment, sizes, alignment, num_sms=5)
    assert launch.tile.align == alignment


def test_batch_alignment() -> None:
    assert batch_alignment(np.array([32, 48, 4096], dtype=np.int64)) == 16
    assert batch_alignment(np.array([32, 40, 4096], dtype=np.int64)) == 8
    assert batch_alignment(np.array([32, 40, 4095], dtype=np.int64)) == 1
    assert TilePlan(align_max=8).pick(10, 10 * 4096, 4, 16).align == 8
    general = TilePlan(tile_elems=16384, warps=32).pick(10_000, 10_000 * 4096, 4, 1)
    assert general.align == 1 and general.jobs * general.words <= 4096 and general.warps <= 8


@needs_interpreter
def test_empty_batch_launches_nothing() -> None:
    rng = np.random.default_rng(5)
    t = make_transfer(rng, 5, Direction.H2D, "cpu", 16, np.array([64], dtype=np.int64))
    empty = np.zeros(0, dtype=np.int64)
    launch = tg.copy(empty, empty, empty, num_sms=4)
    assert launch.grid == 0 and launch.n == 0
    t.check_untouched("an empty batch")


@needs_interpreter
def test_mixed_sizes_and_alignments_in_one_batch() -> None:
    rng = np.random.default_rng(11)
    edge = np.array([1, 2, 7, 8, 9, 15, 16, 17, 24, 4095, 4096, 4100, 8192 + 8, 65536, 256 * KiB], dtype=np.int64)
    sizes = rng.permutation(np.concatenate([edge, log_sizes(rng, 49, 1, 64 * KiB)]))
    launch = run_case(11, sizes, 1, num_sms=3, mixed=True)
    assert launch.grid <= 3


@needs_interpreter
def test_source_and_destination_misaligned_differently() -> None:
    rng = np.random.default_rng(12)
    sizes = log_sizes(rng, 40, 100, 20 * KiB)
    src = scattered(rng, sizes, 16)
    dst = scattered(rng, sizes, 16)
    # Source aligned, destination not, and the reverse, in one batch.
    half = np.arange(len(sizes)) % 2 == 0
    src = Layout(src.offsets + np.where(half, 0, 3), src.nbytes)
    dst = Layout(dst.offsets + np.where(half, 5, 0), dst.nbytes)
    t = make_transfer(rng, 12, Direction.D2H, "cpu", 1, sizes, src, dst)
    tg.copy(*t.descriptors, num_sms=2)
    t.check("src/dst misaligned differently")


@needs_interpreter
def test_few_large_blocks_shared_by_all_programs() -> None:
    sizes = np.array([256 * KiB, 200 * KiB + 3], dtype=np.int64)
    launch = run_case(21, sizes, 8, num_sms=8)
    # Two descriptors, eight programs: the tile is split so every program gets steps.
    assert launch.tile.splits > 1
    assert launch.grid == 8


@needs_interpreter
def test_16_and_8_byte_aligned_tiles_in_one_batch() -> None:
    # Consecutive descriptors alternate: a tile is 16-byte aligned throughout only by
    # chance; the kernel must pick the word path per tile and still copy every byte.
    rng = np.random.default_rng(31)
    sizes = np.full(64, 4 * KiB, dtype=np.int64)
    sizes[::3] += 8
    src = scattered(rng, sizes, 16)
    dst = scattered(rng, sizes, 16)
    dst = Layout(dst.offsets + np.where(np.arange(64) % 5 == 0, 8, 0), dst.nbytes)
    t = make_transfer(rng, 31, Direction.H2D, "cpu", 8, sizes, src, dst)
    tg.copy(*t.descriptors, num_sms=4)
    t.check("16- and 8-byte aligned tiles")


@needs_interpreter
@pytest.mark.parametrize("shape", [
    {"align_max": 8, "prefetch": True},
    {"align_max": 1, "tile_elems": 8192, "warps": 16},
    {"tile_elems": 256, "row_max": 64, "warps": 2},
    {"cache": ".cg", "warps": 16},
])
def test_other_launch_shapes(shape: dict) -> None:
    # The paths a calibration may choose instead of the defaults copy exactly too.
    fn = tk.bind(BindContext(Direction.H2D, cpu_device(), {"num_sms": 3, **shape}))
    rng = np.random.default_rng(81)
    sizes = rng.permutation(np.concatenate([log_sizes(rng, 60, 1, 4 * KiB), [12 * KiB, 20 * KiB + 5]]))
    t = make_transfer(rng, 81, Direction.H2D, "cpu", 1, sizes, mixed_layout(rng, sizes), mixed_layout(rng, sizes))
    launch = fn(*t.descriptors, None)
    assert launch.grid <= 3
    t.check(f"launch shape {shape}")


@needs_interpreter
@pytest.mark.parametrize("direction", ["h2d", "d2h", "d2d"])
def test_resolve_forced_on_cpu_uses_the_kernel(direction: str) -> None:
    fn = kvswap.resolve(direction, device="cpu", policy=Policy(force="triton.kernel"))
    assert fn.impls == ("triton.kernel",)
    assert fn.requires_pinned
    assert "triton.kernel" in fn.explain()
    rng = np.random.default_rng(41)
    sizes = log_sizes(rng, 30, 1, 32 * KiB)
    t = make_transfer(rng, 41, Direction.parse(direction), "cpu", 1, sizes,
                      mixed_layout(rng, sizes), mixed_layout(rng, sizes))
    fn(*t.descriptors)
    t.check(f"resolve({direction!r}, force='triton.kernel') on the CPU")


@needs_interpreter
@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
def test_host_side_addresses_are_translated(direction: Direction) -> None:
    # A fake platform whose kernel sees host memory at another address (as ROCm can):
    # the caller passes host addresses shifted by SHIFT, the translator undoes it, and
    # only the host side of the direction goes through it.
    shift = 1 << 40
    seen = []

    def translate(addrs: np.ndarray) -> np.ndarray:
        seen.append(addrs.copy())
        return addrs - shift

    fn = tk.bind(BindContext(direction, cpu_device(), {"num_sms": 2}, translate))
    rng = np.random.default_rng(51)
    sizes = log_sizes(rng, 9, 1, 8 * KiB)
    t = make_transfer(rng, 51, direction, "cpu", 1, sizes)
    src, dst, n = t.descriptors
    if direction is Direction.H2D:
        src = src + shift
    else:
        dst = dst + shift
    fn(src, dst, n, None)
    t.check(f"translated host addresses ({direction})")
    assert len(seen) == 1 and np.array_equal(seen[0], src if direction is Direction.H2D else dst)


@needs_interpreter
def test_bad_input_is_refused_before_any_byte_moves() -> None:
    rng = np.random.default_rng(61)
    sizes = np.array([100, 200, 300], dtype=np.int64)
    t = make_transfer(rng, 61, Direction.H2D, "cpu", 1, sizes)
    src, dst, n = t.descriptors
    overlapping = dst.copy()
    overlapping[2] = overlapping[1] + 50
    with pytest.raises(kvswap.InvalidTransferError, match="overlap"):
        tg.copy(src, overlapping, n, num_sms=2)
    with pytest.raises(kvswap.InvalidTransferError, match="equal length"):
        tg.copy(src, dst[:2], n, num_sms=2)
    with pytest.raises(kvswap.InvalidTransferError, match="sizes"):
        tg.copy(src, dst, np.array([100, 0, 300]), num_sms=2)
    with pytest.raises(kvswap.ConfigurationError, match="num_sms"):
        tg.copy(src, dst, n, num_sms=0)
    with pytest.raises(kvswap.ConfigurationError, match="TRITON_INTERPRET"):
        tg.copy(src, dst, n, num_sms=2, device="cuda:0")
    t.check_untouched("refused batches")


# -- launch shapes, registration, availability (no kernel runs) ---------------------------

def test_grid_never_exceeds_the_sm_budget() -> None:
    rng = np.random.default_rng(71)
    plan = TilePlan()
    for _ in range(300):
        num_sms = int(rng.integers(1, 140))
        n = int(rng.integers(1, 50_000))
        mean = int(rng.integers(1, 1 << 20))
        tile = plan.pick(n, mean * n, num_sms)
        work = -(-n // tile.jobs) * tile.splits
        assert min(num_sms, work) <= num_sms
        assert tile.jobs * tile.words <= plan.tile_elems
        assert tile.splits == 1 or -(-n // tile.jobs) < num_sms
        assert tile.words & (tile.words - 1) == 0 and tile.jobs & (tile.jobs - 1) == 0


def test_tile_shape_follows_block_size() -> None:
    plan = TilePlan(tile_elems=4096, row_max=1024)
    small = plan.pick(10_000, 10_000 * 4 * KiB, 4)
    large = plan.pick(10_000, 10_000 * 128 * KiB, 4)
    assert (small.jobs, small.words) == (8, 512)  # eight whole 4 KiB blocks per step
    assert large.words == plan.row_max and large.jobs * large.words == plan.tile_elems


def test_warp_elems_sets_the_warps_of_a_tile() -> None:
    # The staged route's device side: rows of 512 B, four per warp, on 32 warps at any chunk size.
    d2d = DEFAULT_PLANS["d2d"]
    for kib in (4, 16, 32):
        tile = d2d.pick(512 * 64, 512 * 64 * kib * KiB, 32)
        assert (tile.jobs, tile.words, tile.warps) == (128, 64, 32)
    assert TilePlan(warps=32).pick(10_000, 10_000 * 4 * KiB, 4).warps == 8192 // 512
    assert TilePlan(warps=32, warp_elems=1024).pick(10_000, 10_000 * 4 * KiB, 4).warps == 8192 // 1024


def test_tile_plan_rejects_bad_params() -> None:
    with pytest.raises(kvswap.ConfigurationError, match="power of two"):
        TilePlan(tile_elems=3000)
    with pytest.raises(kvswap.ConfigurationError, match="row_max"):
        TilePlan(tile_elems=1024, row_max=2048)
    with pytest.raises(kvswap.ConfigurationError, match="warp_elems"):
        TilePlan(warp_elems=100)
    with pytest.raises(kvswap.ConfigurationError, match="align_max"):
        TilePlan(align_max=4)
    with pytest.raises(kvswap.ConfigurationError, match="cache"):
        TilePlan(cache=".cs")
    with pytest.raises(kvswap.ConfigurationError, match="num_sms"):
        KernelCopy(0, None)


def test_bind_takes_params_from_the_context() -> None:
    ctx = BindContext(Direction.H2D, cpu_device(), {"num_sms": 6, "warps": 4, "row_max": 256})
    fn = tk.bind(ctx)
    assert fn.num_sms == 6
    assert (fn.tiles.warps, fn.tiles.row_max) == (4, 256)
    assert fn.tiles.tile_elems == tk.DEFAULT_PLANS["h2d"].tile_elems  # the rest from the defaults
    d2h = tk.bind(BindContext(Direction.D2H, cpu_device(), {"num_sms": 2}))
    assert d2h.tiles == tk.DEFAULT_PLANS["d2h"]
    assert "6 SMs" in fn.note


def test_host_tiles_param() -> None:
    assert TilePlan.from_params({"host_tiles": 0}).host_tiles == 0
    assert tk.DEFAULT_PLANS["h2d"].host_tiles >= 1
    for bad in (-1, 1.5, True):
        with pytest.raises(kvswap.ConfigurationError, match="host_tiles"):
            TilePlan(host_tiles=bad)


# -- the GPU launch path's pieces, with stand-ins for the driver ---------------------------

class _Event:
    finished = waited = False

    def query(self) -> bool:
        return self.finished

    def synchronize(self) -> None:
        self.finished = self.waited = True


def _fake_pool(monkeypatch: pytest.MonkeyPatch):
    import torch

    from kvswap.backends.triton_generic import launch_buffers

    pool = launch_buffers.LaunchBufferPool(0)
    made = []

    def new(count: int) -> launch_buffers.LaunchBuffer:
        entry = launch_buffers.LaunchBuffer(torch.empty(max(count, 16), dtype=torch.int64), 4096 * (len(made) + 1),
                                            _Event())
        made.append(entry)
        return entry

    monkeypatch.setattr(pool, "_new", new)
    return pool, made, launch_buffers


def test_launchers_of_one_device_share_one_launch_buffer_pool() -> None:
    from kvswap.backends.triton_generic import launch_buffers

    def translate(addrs):
        return addrs + 1

    assert launch_buffers.shared_pool(0) is launch_buffers.shared_pool(0)
    assert launch_buffers.shared_pool(1) is not launch_buffers.shared_pool(0)
    assert launch_buffers.shared_pool(0, translate) is launch_buffers.shared_pool(0, translate)
    assert launch_buffers.shared_pool(0, translate) is not launch_buffers.shared_pool(0)  # mapped buffers apart
    assert launch_buffers.shared_pool(0, translate)._translate is translate
    # a pool mapped through a translator goes with it (plugins may make one per resolve)
    mapped = launch_buffers.shared_pool(0, lambda addrs: addrs + 2)
    ref = weakref.ref(mapped)
    del mapped
    gc.collect()
    assert ref() is None


def test_the_identity_translation_costs_a_kernel_route_nothing_per_call() -> None:
    from kvswap.registry.impl import same_addresses

    ctx = BindContext(Direction.H2D, cpu_device(), {"num_sms": 2, "precompile": ()})
    assert ctx.translate_host is same_addresses
    fn = tk.bind(ctx)
    assert fn._translate_src is None and fn._translate_dst is None
    mapped = tk.bind(BindContext(Direction.D2H, cpu_device(), {"num_sms": 2, "precompile": ()}, lambda a: a))
    assert mapped._translate_dst is not None and mapped._translate_src is None


def test_a_launch_buffer_is_reused_only_after_its_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, made, launch_buffers = _fake_pool(monkeypatch)
    a = pool.take(30)
    pool.give(a)  # its kernel is still queued
    b = pool.take(30)
    assert b is not a
    pool.give(b)
    a.done.finished = True
    assert pool.take(30) is a  # finished: reused
    pool.give(a)
    a.done.finished = False
    # Every kept buffer busy: a new one is made; a busy one is never taken, never waited for.
    for _ in range(40):
        pool.give(pool.take(30))
    assert len(made) == 42 and len(pool) == 42
    assert not any(e.done.finished or e.done.waited for e in made if e is not a)
    # A finished buffer too small for the batch is replaced, not reused.
    for e in made:
        e.done.finished = True
    big = pool.take(10_000)
    assert big.capacity >= 10_000 and big not in made[:-1]


def test_launch_buffer_probes_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    pool, made, launch_buffers = _fake_pool(monkeypatch)
    for _ in range(10):
        pool.give(pool.take(8))
    queries = []
    for e in made:
        e.done.query = lambda e=e: queries.append(e) or False
    pool.take(8)
    assert len(queries) == launch_buffers.PROBES  # a busy pool costs a few driver queries, not one each


def test_direct_launch_arguments_follow_the_kernel_signature() -> None:
    pytest.importorskip("triton")
    from kvswap.backends.triton_generic import compiled
    from kvswap.backends.triton_generic.jit import copy_kernel

    tile = TilePlan().pick(100, 100 * 4096, 4)
    assert copy_kernel.arg_names == ["desc", "n", "splits", *compiled.constexprs(tile)]
    calls = []

    class Compiled:
        def launch_metadata(self, grid, stream, *args):
            calls.append(("meta", grid, stream, args))
            return "meta"

    v = compiled.Variant(Compiled(), lambda *a: calls.append(a), "fn", "md")
    variants = compiled.Variants(0)
    variants._runtime = rt = type("Runtime", (), {})()
    rt.launch_enter_hook = rt.launch_exit_hook = None
    variants.launch(v, tile, 3, 0x1000, 100, tile.splits, 77)
    args = (0x1000, 100, tile.splits, tile.jobs, tile.words, tile.align, tile.prefetch, tile.cache)
    assert calls == [(3, 1, 1, 77, "fn", "md", None, None, None, *args)]
    # A profiler's hook set: the launch carries Triton's metadata and the hooks.
    calls.clear()
    rt.launch_enter_hook = hook = print
    variants.launch(v, tile, 3, 0x1000, 100, tile.splits, 77)
    assert calls[0] == ("meta", (3, 1, 1), 77, args)
    assert calls[1] == (3, 1, 1, 77, "fn", "md", "meta", hook, None, *args)


def test_hooks_and_direct_parts() -> None:
    from kvswap.backends.triton_generic import compiled

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not compiled.hook_is_set(None) and not compiled.hook_is_set(Chain([]))
    assert compiled.hook_is_set(Chain([print])) and compiled.hook_is_set(print)
    assert compiled.direct_parts(object()) is None  # a Triton without the attributes: JIT path

    class Compiled:
        run, function, packed_metadata = "run", "fn", "md"

    if tg.HAS_TRITON:
        assert compiled.direct_parts(Compiled()) == ("run", "fn", "md")


def _gpu_device(**details) -> DeviceInfo:
    return DeviceInfo(platform="cuda", name="Fake GPU", identity="cuda-fake", compute_units=132,
                      index=0, details=details)


def test_registered_platforms_follow_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    impl = tk.copy_impl()
    assert impl.platforms == ("cuda", "rocm", "cpu")
    assert impl.kind == "kernel" and impl.requires_pinned and impl.alignment == 1
    assert set(impl.directions) == {Direction.H2D, Direction.D2H, Direction.D2D}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert tk.copy_impl().platforms == ("cuda", "rocm")
    got = []
    tg.kvswap_register_copy_impls(platform="cpu", register=got.append)
    assert got == []
    tg.kvswap_register_copy_impls(platform="rocm", register=got.append)
    assert [(i.name, i.kind) for i in got] == [("triton.kernel", "kernel"), ("triton.staged", "staged")]


def test_availability_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = tk.availability(cpu_device())
    assert reason and "TRITON_INTERPRET=1" in reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert tk.availability(cpu_device()) is None
    reason = tk.availability(_gpu_device())
    assert reason and "TRITON_INTERPRET" in reason
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if tg.HAS_TRITON:
        assert tk.availability(_gpu_device()) is None
    reason = tk.availability(_gpu_device(can_map_host_memory=False))
    assert reason and "cannot address host memory" in reason
    monkeypatch.setattr(launch, "HAS_TRITON", False)  # what kernel and copy() ask
    reason = tk.availability(_gpu_device())
    assert reason and "not installed" in reason
    with pytest.raises(kvswap.ConfigurationError, match="not installed"):
        tg.copy([1], [2], [1], num_sms=1)


def test_cpu_without_interpreter_lists_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fn = kvswap.resolve("h2d", device="cpu")
    cand = {c.name: c for c in fn.plan.candidates}
    assert cand["triton.kernel"].available == tg.HAS_TRITON
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    plugins.reset_plugin_host()
    with pytest.raises(kvswap.ResolutionError, match="triton.kernel"):
        kvswap.resolve("h2d", device="cpu", policy=Policy(force="triton.kernel"))


def test_import_is_light() -> None:
    code = (
        "import sys, kvswap.backends.triton_generic as t; "
        "from kvswap.backends.triton_generic import kernel, launch; "
        "import kvswap.backends.triton_generic.copy; "
        "assert 'triton' not in sys.modules, 'triton imported'; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(kernel.NAME, t.copy.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["triton.kernel", "kvswap.backends.triton_generic.copy"]
