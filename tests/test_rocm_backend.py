"""The ROCm backend on the CPU, against RecordingHipStandIn (a stand-in for libamdhip64).

Nothing here runs HIP: the stand-in records every call the backend makes through the real
ctypes prototypes and performs copies as host memmoves, so call sequences, version
gating, attributes, chunking, errors and address translation are checked exactly, and
the bytes that move are checked one by one. tests/test_rocm_gpu.py has the AMD GPU tests.
"""
from __future__ import annotations

import ctypes
import subprocess
import sys

import numpy as np
import pytest

from kvswap import (
    BindContext,
    CopyImpl,
    DeviceInfo,
    Direction,
    DriverError,
    InvalidTransferError,
    KvSwapWarning,
    Policy,
    hookimpl,
    resolve,
)
import kvswap.backends.rocm as rocm_plugin
from kvswap.backends.rocm import batch, hip
from kvswap.backends.rocm.batch import CHUNK_ENV, DEFAULT_CHUNK
from kvswap.backends.rocm.hip import HipUnavailable, HipVersion, load_hip
from kvswap.registry.plugins import create_plugin_host
from kvswap.resolution.resolver import collect_impls

from fakes import address
from rocm_standin import RecordingHipStandIn, fresh_hip  # noqa: F401 (fixture)

ROCM = DeviceInfo(platform="rocm", name="Stand-in AMD GPU", identity="rocm-standin-gfx942-304cu",
                  compute_units=304, index=0, arch="gfx942:sramecc+:xnack-")
CUDA = DeviceInfo(platform="cuda", name="Stand-in NVIDIA GPU", identity="cuda-standin", compute_units=132, index=0)
H2D, D2H, D2D = Direction.H2D, Direction.D2H, Direction.D2D
STREAM = 0x5EED


class FakeRocmDevice:
    """Announces a ROCm device, as the rocm plugin would on an AMD machine."""

    @hookimpl
    def kvswap_detect_platform(self, device):
        return ROCM


class FakeKernel:
    """A kernel route that only applies ``ctx.translate_host`` and records what it would launch."""

    def __init__(self) -> None:
        self.launched: list[np.ndarray] = []

    @hookimpl
    def kvswap_register_copy_impls(self, platform, register):
        if platform == "rocm":
            register(CopyImpl(name="fake.kernel", kind="kernel", platforms=("rocm",),
                              directions=(H2D, D2H), factory=self._factory))

    def _factory(self, ctx):
        def launch(src, dst, sizes, stream):
            self.launched.append(ctx.translate_host(src if ctx.direction.src_is_host else dst))
        return launch


def host_with(standin: RecordingHipStandIn, *extra):
    hip.reset(standin.api)
    return create_plugin_host(entry_points=[], extra=[("rocm", rocm_plugin), ("fakedev", FakeRocmDevice()), *extra])


def bound(standin: RecordingHipStandIn, direction: Direction, **params):
    hip.reset(standin.api)
    return batch.ROCM_BATCH.factory(BindContext(direction, ROCM, params))


def blocks(rng: np.random.Generator, n: int, size: int = 16, slot: int = 32):
    """Random pools and ``n`` descriptors that can never merge: every block starts a slot
    and is shorter than it. Returns (src pool, dst pool, src, dst, sizes)."""
    src_pool = rng.integers(0, 256, n * slot, dtype=np.uint8)
    dst_pool = np.full(n * slot, 0xA5, dtype=np.uint8)  # poison
    src = address(src_pool) + rng.permutation(n).astype(np.int64) * slot
    dst = address(dst_pool) + rng.permutation(n).astype(np.int64) * slot
    return src_pool, dst_pool, src, dst, np.full(n, size, dtype=np.int64)


def expected_dst(src_pool, dst_pool, src, dst, sizes) -> np.ndarray:
    want = dst_pool.copy()
    for s, d, n in zip((src - address(src_pool)).tolist(), (dst - address(dst_pool)).tolist(), sizes.tolist()):
        want[d:d + n] = src_pool[s:s + n]
    return want


def no_standin_errors(standin: RecordingHipStandIn) -> None:
    if standin.errors:
        raise standin.errors[0]


# -- versions and paths ---------------------------------------------------------------------
def test_version_decoding_and_ordering():
    v = HipVersion.from_int(7 * 10_000_000 + 13 * 100_000 + 42)
    assert (v.major, v.minor, v.patch, str(v)) == (7, 13, 42, "7.13.42")
    assert v.at_least(7, 13) and not v.at_least(7, 14) and HipVersion(7, 2) < HipVersion(7, 13)


@pytest.mark.parametrize("version, path, num_attrs", [
    ((6, 4, 43482), "per_copy", None),
    ((7, 0, 0), "per_copy", None),
    ((7, 1, 0), "batch", 0),
    ((7, 2, 53211), "batch", 0),
    ((7, 12, 9), "batch", 0),
    ((7, 13, 0), "batch", 1),
    ((8, 0, 0), "batch", 1),
])
@pytest.mark.parametrize("direction", [H2D, D2H, D2D])
def test_version_gating_makes_exactly_these_calls(version, path, num_attrs, direction):
    rng = np.random.default_rng()
    standin = RecordingHipStandIn(version=version)
    fn = bound(standin, direction)
    src_pool, dst_pool, src, dst, sizes = blocks(rng, 5)
    want = expected_dst(src_pool, dst_pool, src, dst, sizes)
    fn(src, dst, sizes, STREAM)
    no_standin_errors(standin)
    assert standin.calls[0] == ("hipRuntimeGetVersion",)
    kind = {H2D: 1, D2H: 2, D2D: 3}[direction]  # hipMemcpyHostToDevice, DeviceToHost, DeviceToDevice
    if path == "per_copy":
        assert standin.calls[1:] == [("hipMemcpyAsync", d, s, n, kind, STREAM)
                                     for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist())]
        assert "per-copy hipMemcpyAsync path" in fn.note and "< 7.1" in fn.note
    else:
        (_, call), = standin.calls[1:]
        assert call["dsts"].tolist() == dst.tolist() and call["srcs"].tolist() == src.tolist()
        assert call["sizes"].tolist() == sizes.tolist() and call["count"] == 5 and call["stream"] == STREAM
        assert call["num_attrs"] == num_attrs and call["fail_ptr"]
        if num_attrs == 0:
            assert call["attrs_ptr"] is None and call["attrs"] == [] and "numAttrs=0" in fn.note
        assert fn.note.startswith("hipMemcpyBatchAsync path")
    assert np.array_equal(dst_pool, want)


@pytest.mark.parametrize("direction, order, word", [(H2D, 3, "ANY"), (D2H, 1, "STREAM"), (D2D, 1, "STREAM")])
def test_attributes_any_only_for_a_host_source(direction, order, word):
    rng = np.random.default_rng()
    standin = RecordingHipStandIn(version=(7, 13, 1))
    fn = bound(standin, direction)
    src_pool, dst_pool, src, dst, sizes = blocks(rng, 3)
    fn(src, dst, sizes, STREAM)
    no_standin_errors(standin)
    (_, call), = standin.of("hipMemcpyBatchAsync")
    # One attribute for the whole batch: order, zeroed location hints, no flags.
    assert call["attrs"] == [(order, 0, 0, 0, 0, 0)] and call["idxs"] == [0] and call["num_attrs"] == 1
    assert f"source order {word}" in fn.note


def test_runtime_without_the_batch_symbol_copies_per_descriptor():
    rng = np.random.default_rng()
    standin = RecordingHipStandIn(version=(7, 2, 0), missing=("hipMemcpyBatchAsync",))
    fn = bound(standin, H2D)
    src_pool, dst_pool, src, dst, sizes = blocks(rng, 4)
    want = expected_dst(src_pool, dst_pool, src, dst, sizes)
    fn(src, dst, sizes, STREAM)
    assert standin.names() == ["hipRuntimeGetVersion"] + ["hipMemcpyAsync"] * 4
    assert "does not export hipMemcpyBatchAsync" in fn.note and np.array_equal(dst_pool, want)


# -- chunking -------------------------------------------------------------------------------
@pytest.mark.parametrize("n, counts", [
    (DEFAULT_CHUNK, [DEFAULT_CHUNK]),
    (DEFAULT_CHUNK + 1, [DEFAULT_CHUNK, 1]),
    (2 * DEFAULT_CHUNK + 7, [DEFAULT_CHUNK, DEFAULT_CHUNK, 7]),
])
def test_chunks_of_at_most_8192(n, counts):
    rng = np.random.default_rng()
    standin = RecordingHipStandIn(version=(7, 2, 0))
    fn = bound(standin, H2D)
    src_pool, dst_pool, src, dst, sizes = blocks(rng, n)
    want = expected_dst(src_pool, dst_pool, src, dst, sizes)
    fn(src, dst, sizes, STREAM)
    no_standin_errors(standin)
    calls = [c[1] for c in standin.of("hipMemcpyBatchAsync")]
    assert [c["count"] for c in calls] == counts
    assert np.concatenate([c["dsts"] for c in calls]).tolist() == dst.tolist()
    assert np.concatenate([c["srcs"] for c in calls]).tolist() == src.tolist()
    assert np.array_equal(dst_pool, want)


def test_empty_batch_makes_no_call():
    standin = RecordingHipStandIn(version=(7, 2, 0))
    fn = bound(standin, D2H)
    empty = np.zeros(0, dtype=np.int64)
    fn(empty, empty, empty, STREAM)
    host = host_with(standin)
    resolve("h2d", host=host)(empty, empty, empty, stream=STREAM)
    assert "hipMemcpyBatchAsync" not in standin.names() and "hipMemcpyAsync" not in standin.names()


@pytest.mark.parametrize("how", ["env", "param"])
def test_chunk_size_is_overridable(how, monkeypatch):
    rng = np.random.default_rng()
    standin = RecordingHipStandIn(version=(7, 2, 0))
    if how == "env":
        monkeypatch.setenv(CHUNK_ENV, "100")
        fn = bound(standin, H2D)
    else:
        fn = bound(standin, H2D, batch_chunk=100)
    src_pool, dst_pool, src, dst, sizes = blocks(rng, 250)
    fn(src, dst, sizes, STREAM)
    assert [c[1]["count"] for c in standin.of("hipMemcpyBatchAsync")] == [100, 100, 50]
    assert "chunks of <= 100 descriptors" in fn.note


@pytest.mark.parametrize("bad", ["0", "-3", "many", "2.5"])
def test_bad_chunk_setting_rejects_the_impl_with_the_reason(bad, monkeypatch):
    monkeypatch.setenv(CHUNK_ENV, bad)
    standin = RecordingHipStandIn(version=(7, 2, 0))
    fn = resolve("h2d", host=host_with(standin, ("kernel", FakeKernel())))
    cand = next(c for c in fn.plan.candidates if c.name == "rocm.batch")
    assert not cand.available and CHUNK_ENV in cand.reason and repr(bad) in cand.reason


def _runs(rng):
    """Blocks 0-7 are one run on both sides; blocks 8 and 9 stand apart.
    Returns (src pool, dst pool, src, dst, sizes)."""
    src_pool = rng.integers(0, 256, 8192, dtype=np.uint8)
    dst_pool = np.full(8192, 0x5A, dtype=np.uint8)
    src = address(src_pool) + np.array([*range(0, 512, 64), 1024, 2048], dtype=np.int64)
    dst = address(dst_pool) + np.array([*range(512, 1024, 64), 3000, 5000], dtype=np.int64)
    return src_pool, dst_pool, src, dst, np.full(10, 64, dtype=np.int64)


def test_contiguous_runs_are_merged_before_the_call():
    # Merging is the SwapFn's (core's), once for every route: rocm.batch gets the merged batch.
    rng = np.random.default_rng()
    standin = RecordingHipStandIn(version=(7, 2, 0))
    fn = resolve("h2d", host=host_with(standin))
    src_pool, dst_pool, src, dst, sizes = _runs(rng)
    want = expected_dst(src_pool, dst_pool, src, dst, sizes)
    fn(src, dst, sizes, stream=STREAM)
    (_, call), = standin.of("hipMemcpyBatchAsync")
    assert call["sizes"].tolist() == [512, 64, 64] and call["dsts"].tolist() == [dst[0], dst[8], dst[9]]
    assert np.array_equal(dst_pool, want)


def test_the_bound_function_copies_the_batch_as_given():
    rng = np.random.default_rng()
    standin = RecordingHipStandIn(version=(7, 2, 0))
    fn = bound(standin, H2D)
    src_pool, dst_pool, src, dst, sizes = _runs(rng)
    want = expected_dst(src_pool, dst_pool, src, dst, sizes)
    fn(src, dst, sizes, STREAM)
    (_, call), = standin.of("hipMemcpyBatchAsync")
    assert call["sizes"].tolist() == sizes.tolist() and call["dsts"].tolist() == dst.tolist()
    assert np.array_equal(dst_pool, want)


def test_overlapping_destinations_are_refused_before_any_call():
    # Refused by the SwapFn's whole-batch check, before rocm.batch is called.
    standin = RecordingHipStandIn(version=(7, 2, 0))
    fn = resolve("h2d", host=host_with(standin))
    buf = np.zeros(256, dtype=np.uint8)
    with pytest.raises(InvalidTransferError, match="descriptors 0 and 1 overlap"):
        fn(np.array([address(buf), address(buf) + 128]), np.array([address(buf) + 8, address(buf) + 16]),
           np.array([16, 16]), stream=STREAM)
    assert not [n for n in standin.names() if n.startswith("hipMemcpy")]


# -- errors ---------------------------------------------------------------------------------
def test_batch_error_names_the_hip_error_and_the_descriptor():
    rng = np.random.default_rng()
    standin = RecordingHipStandIn(version=(7, 2, 0), fail_batch=(1, 3, 1))  # 2nd chunk, its 4th copy
    fn = bound(standin, H2D, batch_chunk=10)
    _, _, src, dst, sizes = blocks(rng, 25)
    with pytest.raises(DriverError) as e:
        fn(src, dst, sizes, STREAM)
    err = e.value
    assert (err.call, err.code, err.name, err.text, err.index) == (
        "hipMemcpyBatchAsync", 1, "hipErrorInvalidValue", "invalid argument", 13)
    assert str(err) == "hipMemcpyBatchAsync failed: hipErrorInvalidValue (1): invalid argument [descriptor 13]"
    assert isinstance(err, RuntimeError) and len(standin.of("hipMemcpyBatchAsync")) == 2  # stops there


def test_error_index_refers_to_the_callers_descriptor_after_merging():
    standin = RecordingHipStandIn(version=(7, 2, 0), fail_batch=(0, 1, 1))  # merged copy 1 fails
    fn = resolve("h2d", host=host_with(standin))
    src_pool, dst_pool, src, dst, sizes = _runs(np.random.default_rng())  # 0-7 merge into one
    with pytest.raises(DriverError) as e:
        fn(src, dst, sizes, stream=STREAM)
    assert standin.of("hipMemcpyBatchAsync")[0][1]["count"] == 3
    assert e.value.index == 8


def test_per_copy_error_and_a_runtime_without_error_names():
    rng = np.random.default_rng()
    standin = RecordingHipStandIn(version=(6, 4, 0), fail_copy=(2, 101),
                                  missing=("hipGetErrorName", "hipGetErrorString"))
    fn = bound(standin, D2H)
    _, _, src, dst, sizes = blocks(rng, 6)
    with pytest.raises(DriverError) as e:
        fn(src, dst, sizes, STREAM)
    assert (e.value.name, e.value.index) == (None, 2)
    assert str(e.value) == "hipMemcpyAsync failed: unknown error (101) [descriptor 2]"
    assert len(standin.of("hipMemcpyAsync")) == 3


# -- host-address translation ---------------------------------------------------------------
def translator(standin: RecordingHipStandIn, device: DeviceInfo = ROCM):
    hip.reset(standin.api)
    return rocm_plugin.kvswap_host_address_translator(device=device)


def test_translation_maps_each_allocation_with_three_queries():
    rng = np.random.default_rng()
    standin = RecordingHipStandIn()
    a_host, a_dev, b_host, b_dev = 0x10_0000_0000, 0x7F00_0000_0000, 0x20_0000_0000, 0x7E00_0000_0000
    standin.register(a_host, 1 << 30, a_dev)
    standin.register(b_host, 1 << 20, b_dev)
    offs_a = rng.integers(0, 1 << 30, 700)
    offs_b = rng.integers(0, 1 << 20, 300)
    addrs = np.concatenate([a_host + offs_a, b_host + offs_b])
    perm = rng.permutation(len(addrs))
    out = translator(standin)(addrs[perm])
    want = np.concatenate([a_dev + offs_a, b_dev + offs_b])[perm]
    assert out.dtype == np.int64 and np.array_equal(out, want)
    first_a, first_b = a_host + int(offs_a.min()), b_host + int(offs_b.min())
    assert standin.calls == [
        ("hipGetDevice",),
        ("hipPointerGetAttribute", 11, first_a), ("hipMemPtrGetInfo", first_a), ("hipHostGetDevicePointer", a_host, 0),
        ("hipPointerGetAttribute", 11, first_b), ("hipMemPtrGetInfo", first_b), ("hipHostGetDevicePointer", b_host, 0),
    ]


def test_translation_is_the_identity_where_host_and_device_agree():
    rng = np.random.default_rng()
    standin = RecordingHipStandIn()
    base = 0x30_0000_0000
    standin.register(base, 1 << 24, base)  # hipHostMalloc memory: mapped at the same address
    addrs = base + rng.integers(0, 1 << 24, 500)
    assert np.array_equal(translator(standin)(addrs), addrs)


def test_translation_checks_ends_when_given_sizes():
    standin = RecordingHipStandIn()
    standin.register(0x1000_0000, 4096, 0x9000_0000)
    tr = translator(standin)
    assert tr([0x1000_0000 + 4000], [96]).tolist() == [0x9000_0000 + 4000]
    with pytest.raises(InvalidTransferError, match="descriptor 1.*runs past the end"):
        tr([0x1000_0000, 0x1000_0000 + 4000], [16, 97])


def test_translation_switches_to_the_resolved_device_and_back():
    standin = RecordingHipStandIn(current_device=1)
    standin.register(0x1000_0000, 4096, 0x9000_0000)
    translator(standin)([0x1000_0010])
    assert standin.names()[:2] == ["hipGetDevice", "hipSetDevice"] and standin.calls[1] == ("hipSetDevice", 0)
    assert standin.calls[-1] == ("hipSetDevice", 1) and standin.current_device == 1


def test_unreachable_address_fails_before_any_copy():
    standin = RecordingHipStandIn()
    standin.register(0x1000_0000, 4096, 0x9000_0000)
    kernel = FakeKernel()
    fn = resolve("h2d", policy=Policy(force="fake.kernel"), host=host_with(standin, ("kernel", kernel)))
    dst = np.zeros(64, dtype=np.uint8)
    with pytest.raises(InvalidTransferError, match=r"0xdead000 \(descriptor 1\).*cannot reach it"):
        fn([0x1000_0000, 0xDEAD000], [address(dst), address(dst) + 32], [16, 16], stream=STREAM)
    assert kernel.launched == []
    assert not [n for n in standin.names() if n.startswith("hipMemcpy")]
    fn([0x1000_0000 + 8], [address(dst)], [16], stream=STREAM)  # the seam hands the mapping to kernels
    assert kernel.launched[0].tolist() == [0x9000_0008]


def test_no_translator_for_other_platforms_and_a_refusing_one_without_hip():
    assert translator(RecordingHipStandIn(), CUDA) is None  # CUDA: the core's identity applies
    hip.reset(_missing)
    assert rocm_plugin.kvswap_host_address_translator(device=CUDA) is None
    refusing = rocm_plugin.kvswap_host_address_translator(device=ROCM)
    with pytest.raises(InvalidTransferError, match="no libamdhip64 here"):
        refusing(np.array([0x1000]))


def _missing():
    raise HipUnavailable("no libamdhip64 here")


# -- availability, registration, calibration -------------------------------------------------
def test_unavailable_on_this_machine_with_the_reason(tmp_path):
    try:
        load_hip()
    except HipUnavailable as e:
        reason = str(e)
    else:
        pytest.skip("a HIP runtime is installed here; this test is about machines without one")
    assert "libamdhip64" in reason and "libamdhip64.so.6" in reason
    hip.reset()
    assert batch.ROCM_BATCH.unavailable_reason(ROCM) == reason
    fake = tmp_path / "libamdhip64.so"
    fake.write_bytes(b"not a library")
    with pytest.raises(HipUnavailable, match="tried .*libamdhip64.so.*last error"):
        load_hip(paths=[str(fake)])


def test_library_without_required_symbols_is_refused():
    with pytest.raises(HipUnavailable, match="lacks hipRuntimeGetVersion, hipMemcpyAsync"):
        load_hip(paths=["libc.so.6"], opener=ctypes.CDLL)


def test_import_loads_nothing():
    code = ("import sys, kvswap.backends.rocm as r; "
            "from kvswap.backends.rocm import hip; "
            "assert hip._loaded is None and hip._failure is None, 'HIP touched at import'; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_entry_point_registers_the_plugin_and_its_hooks():
    host = create_plugin_host()
    record = host.records["rocm"]
    assert (record.status, record.module) == ("loaded", "kvswap.backends.rocm")
    assert ("rocm", "rocm.batch") in [(p, i.name) for p, i in collect_impls(host, "rocm")]
    assert "rocm.batch" not in [i.name for _, i in collect_impls(host, "cuda")]
    for name in ("kvswap_register_copy_impls", "kvswap_register_calibrations",
                 "kvswap_detect_platform", "kvswap_host_address_translator"):
        assert "rocm" in [h.plugin_name for h in getattr(host.pm.hook, name).get_hookimpls()], name


def test_uncalibrated_rocm_prefers_the_batch_route_and_says_how_to_calibrate():
    rng = np.random.default_rng()
    standin = RecordingHipStandIn(version=(7, 2, 0))
    fn = resolve("d2h", host=host_with(standin, ("kernel", FakeKernel())))
    assert {r.impl for r in fn.plan.routes} == {"rocm.batch"} and not fn.plan.calibration["calibrated"]
    assert all(r.predicted[0][0] == "rocm.batch" for r in fn.plan.routes)
    text = fn.explain()
    assert "NOT calibrated" in text and "kvswap calibrate" in text and "rocm defaults" in text
    assert "note: rocm.batch: hipMemcpyBatchAsync path: numAttrs=0" in text
    src_pool, dst_pool, src, dst, sizes = blocks(rng, 40, size=24, slot=64)
    want = expected_dst(src_pool, dst_pool, src, dst, sizes)
    fn(src, dst, sizes, stream=STREAM)
    assert np.array_equal(dst_pool, want)


def test_the_rocm_plugin_creates_non_blocking_streams_on_the_asked_device_and_leaves_the_current_one():
    standin = RecordingHipStandIn(current_device=1)
    hip.reset(standin.api)
    assert rocm_plugin.kvswap_create_stream(platform="cuda", device_index=0) is None
    assert rocm_plugin.kvswap_create_stream(platform="rocm", device_index=3) == 0x5001
    assert standin.of("hipStreamCreateWithFlags") == [("hipStreamCreateWithFlags", 3, 1)]
    assert standin.current_device == 1 and standin.of("hipSetDevice")[-1] == ("hipSetDevice", 1)
    hip.reset(_missing)
    assert rocm_plugin.kvswap_create_stream(platform="rocm", device_index=0) is None
    hip.reset(RecordingHipStandIn(missing=("hipStreamCreateWithFlags",)).api)
    assert rocm_plugin.kvswap_create_stream(platform="rocm", device_index=0) is None


def test_a_stream_the_runtime_refuses_is_a_warning_and_the_plugin_stays():
    class Refusing(RecordingHipStandIn):
        def hipStreamCreateWithFlags(self, out, flags):
            return 2  # hipErrorOutOfMemory

    hip.reset(Refusing().api)
    with pytest.warns(KvSwapWarning, match="rocm: kvswap could not create a stream of its own on device 0"):
        assert rocm_plugin.kvswap_create_stream(platform="rocm", device_index=0) is None
