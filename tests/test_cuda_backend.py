"""The CUDA backend without a GPU: registration, availability reasons, the driver ABI
choice, the attribute struct, errors, and the batch and per-copy paths.

Where the driver is needed, ``StandInLibcuda`` (tests/cuda_standin.py) plays libcuda
through the real foreign-call machinery, copying with host memmoves.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import subprocess
import sys

import numpy as np
import pytest

import kvswap
from kvswap import Direction, DriverError, KvSwapError
from kvswap.backends import cuda as plugin
from kvswap.backends.cuda import batch, device, driver
from kvswap.registry.platform import cpu_device
from kvswap.registry.plugins import create_plugin_host
from kvswap.resolution.resolver import collect_impls

from cuda_standin import HostPools, StandInLibcuda, fresh_driver, standin_driver  # noqa: F401 (fixture)


def _machine_has_a_cuda_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and not getattr(torch.version, "hip", None)


# These check what a machine without a CUDA GPU sees; everything else here runs anywhere.
without_cuda_gpu = pytest.mark.skipif(_machine_has_a_cuda_gpu(), reason="checks a machine without a CUDA GPU")





# ---------------------------------------------------------------------------------------
# Plugin, import, availability
# ---------------------------------------------------------------------------------------

def test_imports_light_and_loads_nothing():
    code = (
        "import sys, kvswap.backends.cuda as c\n"
        "from kvswap.backends.cuda import batch, defaults, device, driver\n"
        "print('torch' in sys.modules, driver._loaded is None and driver._failure is None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"]


def test_registers_cuda_batch_for_cuda_only():
    host = create_plugin_host()
    assert host.records["cuda"].status == "loaded"
    impls = {impl.name: (p, impl) for p, impl in collect_impls(host, "cuda")}
    owner, impl = impls["cuda.batch"]
    assert owner == "cuda"
    assert impl.kind == "batch" and impl.requires_pinned and impl.mixed_sizes
    assert set(impl.directions) == {Direction.H2D, Direction.D2H, Direction.D2D}
    assert impl.alignment == 1 and impl.min_block_bytes == 1
    for other in ("cpu", "rocm"):
        assert "cuda.batch" not in {i.name for _, i in collect_impls(host, other)}


@without_cuda_gpu
def test_unavailable_here_with_a_reason():
    reason = batch.availability(cpu_device())
    assert isinstance(reason, str) and reason
    assert "libcuda" in reason or "torch" in reason
    assert "not cpu" in batch.CUDA_BATCH.unavailable_reason(cpu_device())


def test_missing_libcuda_is_a_reason_not_an_import_error(monkeypatch):
    monkeypatch.setattr(driver, "LIBRARY_NAMES", ("/nonexistent/libcuda.so.1", "libcuda-nope.so"))
    reason = batch.availability(cpu_device())
    assert "libcuda cannot be loaded" in reason and "/nonexistent/libcuda.so.1" in reason
    assert "also tried libcuda-nope.so" in reason
    with pytest.raises(driver.DriverUnavailable):
        driver.get()
    assert driver.unavailable_reason() == reason  # remembered, not retried


def test_a_library_that_is_not_libcuda_is_refused():
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to stand for a non-CUDA library")
    with pytest.raises(driver.DriverUnavailable, match="not a CUDA driver"):
        driver.load((libm,))


@pytest.mark.parametrize("cuda, hip, available, want", [
    (None, None, False, "built without CUDA"),
    ("13.0", "6.4", True, "ROCm build"),
    ("13.0", None, False, "sees no CUDA device"),
    ("13.0", None, True, None),
])
def test_torch_reasons(monkeypatch, cuda, hip, available, want):
    import torch

    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    reason = device.torch_reason()
    assert reason is None if want is None else want in reason


@without_cuda_gpu
def test_detect_claims_nothing_without_a_cuda_gpu():
    assert device.describe(None) is None
    assert device.describe("cuda:0") is None
    assert plugin.kvswap_detect_platform(device="xpu:0") is None
    assert kvswap.resolve("h2d").plan.device.platform == "cpu"


# ---------------------------------------------------------------------------------------
# ABI choice
# ---------------------------------------------------------------------------------------

class RecordingLookup:
    """Stand-in for cuGetProcAddress: answers from a table, records what it was asked."""

    def __init__(self, table, raises=()):
        self.table, self.raises, self.asked = table, raises, []

    def __call__(self, symbol, version):
        self.asked.append((symbol, version))
        if version in self.raises:
            raise DriverError("cuGetProcAddress", 1, "CUDA_ERROR_INVALID_VALUE")
        return self.table.get(version, (0, 1))


def test_old_driver_has_no_batch_and_is_not_asked():
    look = RecordingLookup({12080: (0x1000, 0)})
    abi, why = driver.choose_batch_abi(12060, look)
    assert abi is None and "12.6" in why and "12.8" in why
    assert look.asked == []


@pytest.mark.parametrize("version", [12080, 12090, 13000, 13020])
def test_the_12_8_abi_is_asked_first_on_any_new_driver(version):
    look = RecordingLookup({12080: (0x1000, 0), 13000: (0x2000, 0)})
    abi, why = driver.choose_batch_abi(version, look)
    assert look.asked == [("cuMemcpyBatchAsync", 12080)]
    assert abi.requested == 12080 and abi.address == 0x1000 and abi.has_fail_idx
    assert "12.8 ABI" in why and "failIdx" in why


def test_the_13_abi_is_the_fallback_on_13_drivers_only():
    look = RecordingLookup({12080: (0, 2), 13000: (0x2000, 0)})
    abi, _ = driver.choose_batch_abi(13000, look)
    assert look.asked == [("cuMemcpyBatchAsync", 12080), ("cuMemcpyBatchAsync", 13000)]
    assert abi.requested == 13000 and not abi.has_fail_idx
    look = RecordingLookup({12080: (0, 2), 13000: (0x2000, 0)})
    abi, why = driver.choose_batch_abi(12090, look)  # never ask above the driver's version
    assert abi is None and look.asked == [("cuMemcpyBatchAsync", 12080)]
    assert "version not sufficient" in why


def test_a_failing_lookup_is_a_reason():
    look = RecordingLookup({13000: (0x2000, 0)}, raises={12080})
    abi, _ = driver.choose_batch_abi(13000, look)
    assert abi.requested == 13000
    look = RecordingLookup({}, raises={12080, 13000})
    abi, why = driver.choose_batch_abi(13000, look)
    assert abi is None and "CUDA_ERROR_INVALID_VALUE" in why


def test_prototypes_match_the_abis():
    assert len(driver.BATCH_PROTOTYPES[12080]._argtypes_) == 9
    assert len(driver.BATCH_PROTOTYPES[13000]._argtypes_) == 8
    assert driver.version_text(12080) == "12.8" and driver.version_text(13000) == "13.0"


# ---------------------------------------------------------------------------------------
# The attribute struct
# ---------------------------------------------------------------------------------------

def test_attribute_struct_layout_matches_cuda_h():
    A, L = driver.MemcpyAttributes, driver.MemLocation
    assert ctypes.sizeof(L) == 8 and ctypes.sizeof(A) == 24 and ctypes.alignment(A) == 4
    assert [getattr(A, f).offset for f in ("srcAccessOrder", "srcLocHint", "dstLocHint", "flags")] == [0, 4, 12, 20]
    assert (L.type.offset, L.id.offset) == (0, 4)


@pytest.mark.parametrize("direction, order", [("h2d", 3), ("d2h", 1), ("d2d", 1)])
def test_one_attribute_any_only_for_a_host_source(direction, order):
    attr = batch.make_attributes(Direction.parse(direction))
    raw = bytes(attr)
    assert raw[:4] == order.to_bytes(4, "little") and raw[4:] == bytes(20)
    assert batch.access_order(direction) == order


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------

def test_error_carries_code_name_text_and_index():
    err = driver.make_error("cuMemcpyBatchAsync", 1, lambda c: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"), 7)
    assert isinstance(err, DriverError) and isinstance(err, RuntimeError) and isinstance(err, KvSwapError)
    assert (err.call, err.code, err.name, err.text, err.index) == (
        "cuMemcpyBatchAsync", 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", 7)
    assert str(err) == "cuMemcpyBatchAsync failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument [descriptor 7]"


def test_error_naming_that_fails_keeps_the_code():
    def broken(code):
        raise OSError("gone")

    err = driver.make_error("cuMemcpyAsync", 999, broken)
    assert err.code == 999 and err.name is None and err.index is None
    assert "unknown error (999)" in str(err)


def test_fail_index_ignores_size_max_and_out_of_range():
    assert driver.fail_index(3, 10) == 3
    assert driver.fail_index(10, 10) is None
    assert driver.fail_index(driver.SIZE_MAX, 10) is None


def test_driver_names_errors_through_cuGetErrorName():
    d, _ = standin_driver()
    assert d.describe(201) == ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context")
    assert d.describe(12345) == (None, None)
    with pytest.raises(DriverError, match=r"CUDA_ERROR_INVALID_VALUE \(1\): invalid argument"):
        d.check("cuSomething", 1)


def test_driver_reads_the_version_and_asks_for_legacy_stream_entry_points():
    d, lib = standin_driver(version=12090)
    assert d.version == 12090
    abi, _ = d.batch_abi()
    assert abi.requested == 12080
    assert lib.of("cuGetProcAddress") == [("cuGetProcAddress", "cuMemcpyBatchAsync", 12080, driver.PROC_LEGACY_STREAM)]
    with pytest.raises(driver.DriverUnavailable, match="no cuNotThere"):
        d.proc("cuNotThere", 4000, driver.MEMCPY_ASYNC)


def test_entry_point_queries_init_the_driver_when_it_asks():
    d, lib = standin_driver(needs_init=True)
    abi, _ = d.batch_abi()
    assert abi.requested == 12080
    assert [c[0] for c in lib.calls] == ["cuGetProcAddress", "cuInit", "cuGetProcAddress"]
    d.device(0)
    assert len(lib.of("cuInit")) == 1  # once


# ---------------------------------------------------------------------------------------
# Paths and copies through the stand-in driver
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("ready, handle, path", [
    (True, 0, "per-copy"), (True, 1, "per-copy"), (True, 2, "batch"), (True, 0x7F3A12345600, "batch"),
    (False, 0x7F3A12345600, "per-copy"), (False, 0, "per-copy"),
])
def test_path_selection(ready, handle, path):
    assert batch.choose_path(ready, handle) == path


def test_notes_say_which_path_and_why():
    d, _ = standin_driver(version=13000)
    note = batch.bind(d, Direction.H2D, 0).note
    assert note.startswith("batch path") and "CUDA 12.8 ABI" in note and "ANY" in note and "legacy default stream" in note
    assert "STREAM" in batch.bind(d, Direction.D2H, 0).note
    assert "STREAM" in batch.bind(d, Direction.D2D, 0).note
    old, _ = standin_driver(version=12040)
    note = batch.bind(old, Direction.H2D, 0).note
    assert note.startswith("per-copy path") and "12.4" in note and "12.8" in note


@pytest.mark.parametrize("direction, order", [(Direction.H2D, 3), (Direction.D2H, 1), (Direction.D2D, 1)])
def test_one_batch_call_moves_every_block(direction, order):
    rng = np.random.default_rng(1)
    d, lib = standin_driver()
    fn = batch.bind(d, direction, 0)
    sizes = rng.integers(1, 3000, 300)
    pools = HostPools(rng, sizes, pool=4 << 20, slot=4096)
    fn(pools.src, pools.dst, sizes, 0x5EED)
    pools.check()
    (call,) = [c[1] for c in lib.of("cuMemcpyBatchAsync")]
    assert call["abi"] == 12080 and call["count"] == len(sizes) and call["stream"] == 0x5EED
    assert (call["dst"] == pools.dst).all() and (call["src"] == pools.src).all() and (call["sizes"] == sizes).all()
    assert call["order"] == order and call["flags"] == 0 and call["hint_types"] == (0, 0)
    assert (call["attr_idx"], call["num_attrs"]) == (0, 1) and call["fail_idx"]
    assert not lib.of("cuMemcpyAsync") and fn.last_path == "batch"


def test_the_primary_context_is_made_current_only_when_it_is_not():
    d, lib = standin_driver()
    fn = batch.bind(d, Direction.H2D, 1)
    pools = HostPools(np.random.default_rng(2), [64, 100])
    fn(pools.src, pools.dst, pools.sizes, 7)
    assert lib.of("cuDevicePrimaryCtxRetain") == [("cuDevicePrimaryCtxRetain", 1)]
    assert lib.of("cuCtxPushCurrent") == [("cuCtxPushCurrent", StandInLibcuda.PRIMARY + 1)]
    assert lib.of("cuMemcpyBatchAsync")[0][1]["context"] == StandInLibcuda.PRIMARY + 1
    assert lib.current == 0 and len(lib.of("cuCtxPopCurrent")) == 1
    lib.current = StandInLibcuda.PRIMARY + 1
    fn(pools.src, pools.dst, pools.sizes, 7)
    assert len(lib.of("cuCtxPushCurrent")) == 1 and len(lib.of("cuCtxPopCurrent")) == 1
    pools.check()


@pytest.mark.parametrize("handle", [0, 1])
def test_the_legacy_stream_takes_the_per_copy_path(handle):
    rng = np.random.default_rng(3)
    d, lib = standin_driver()
    fn = batch.bind(d, Direction.D2H, 0)
    pools = HostPools(rng, rng.integers(1, 500, 40), slot=512)
    fn(pools.src, pools.dst, pools.sizes, handle)
    pools.check()
    copies = lib.of("cuMemcpyAsync")
    assert not lib.of("cuMemcpyBatchAsync") and fn.last_path == "per-copy"
    assert [(c[1], c[2], c[3], c[4]) for c in copies] == list(
        zip(pools.dst.tolist(), pools.src.tolist(), pools.sizes.tolist(), [handle] * 40))


def test_an_old_driver_copies_per_descriptor_on_any_stream():
    rng = np.random.default_rng(4)
    d, lib = standin_driver(version=12040)
    fn = batch.bind(d, Direction.H2D, 0)
    pools = HostPools(rng, [8, 13, 4096, 1], slot=8192)
    fn(pools.src, pools.dst, pools.sizes, 0x1234)
    pools.check()
    assert len(lib.of("cuMemcpyAsync")) == 4 and not lib.of("cuMemcpyBatchAsync")
    assert all(c[1] != "cuMemcpyBatchAsync" for c in lib.of("cuGetProcAddress"))


def test_nothing_is_called_for_an_empty_batch():
    d, lib = standin_driver()
    fn = batch.bind(d, Direction.H2D, 0)
    before = len(lib.calls)
    empty = np.zeros(0, dtype=np.int64)
    fn(empty, empty, empty, 5)
    assert len(lib.calls) == before and fn.last_path is None


def test_batch_failure_names_the_descriptor_the_driver_blamed():
    d, _ = standin_driver(fail_at=3)
    fn = batch.bind(d, Direction.H2D, 0)
    pools = HostPools(np.random.default_rng(5), [64] * 8)
    with pytest.raises(DriverError) as e:
        fn(pools.src, pools.dst, pools.sizes, 9)
    assert (e.value.call, e.value.code, e.value.name, e.value.index) == (
        "cuMemcpyBatchAsync", 1, "CUDA_ERROR_INVALID_VALUE", 3)
    assert "[descriptor 3]" in str(e.value) and "invalid argument" in str(e.value)


def test_the_13_abi_reports_no_index():
    d, lib = standin_driver(batch_abis=(13000,), fail_at=3)
    fn = batch.bind(d, Direction.D2H, 0)
    assert fn.abi.requested == 13000 and "CUDA 13.0 ABI" in fn.note
    pools = HostPools(np.random.default_rng(6), [64] * 8)
    with pytest.raises(DriverError) as e:
        fn(pools.src, pools.dst, pools.sizes, 9)
    assert e.value.index is None and e.value.name == "CUDA_ERROR_INVALID_VALUE"
    assert lib.of("cuMemcpyBatchAsync")[0][1]["fail_idx"] is None


# ---------------------------------------------------------------------------------------
# Huge batches: calls of at most the cap, in order, on one stream
# ---------------------------------------------------------------------------------------

def _many(rng, n, mixed=True):
    """``n`` descriptors of 1-24 bytes (else all of 16), scattered over random/poisoned pools."""
    sizes = rng.integers(1, 25, n) if mixed else np.full(n, 16, dtype=np.int64)
    return HostPools(rng, sizes, pool=32 * n, slot=32)


@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
def test_200000_descriptors_become_ordered_calls_of_at_most_the_cap(direction):
    rng = np.random.default_rng()
    d, lib = standin_driver()
    fn = batch.bind(d, direction, 0)
    assert fn.chunk == batch.DEFAULT_CHUNK == 32768 and "at most 32768 descriptors a call" in fn.note
    pools = _many(rng, 200_000, mixed=False)
    fn(pools.src, pools.dst, pools.sizes, 0x5EED)
    calls = [c[1] for c in lib.of("cuMemcpyBatchAsync")]
    assert [c["count"] for c in calls] == [32768] * 6 + [200_000 - 6 * 32768]
    assert {c["stream"] for c in calls} == {0x5EED}  # one stream: the pieces run in the order issued
    # In order and complete: the pieces, joined, are the caller's batch.
    for key, want in (("src", pools.src), ("dst", pools.dst), ("sizes", pools.sizes)):
        assert np.array_equal(np.concatenate([c[key] for c in calls]), want), key
    assert all(c["num_attrs"] == 1 for c in calls)
    pools.check()


@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
def test_a_long_batch_of_mixed_sizes_goes_in_calls_of_at_most_the_mixed_cap(direction):
    """Mixed sizes past the direction's cap (MIXED_CHUNK_H2D host to device, else
    MIXED_CHUNK): calls of that many (the driver's faults on long mixed-size batches), in
    order on one stream, every byte checked."""
    rng = np.random.default_rng()
    d, lib = standin_driver()
    fn = batch.bind(d, direction, 0)
    pools = _many(rng, 10_000)
    fn(pools.src, pools.dst, pools.sizes, 0x5EED)
    calls = [c[1] for c in lib.of("cuMemcpyBatchAsync")]
    cap = batch.MIXED_CHUNK_H2D if direction is Direction.H2D else batch.MIXED_CHUNK
    assert (cap, fn.mixed_chunk) == ((512, 512) if direction is Direction.H2D else (4096, 4096))
    assert [c["count"] for c in calls] == [cap] * (10_000 // cap) + [10_000 % cap]
    for key, want in (("src", pools.src), ("dst", pools.dst), ("sizes", pools.sizes)):
        assert np.array_equal(np.concatenate([c[key] for c in calls]), want), key
    pools.check()
    d2, lib2 = standin_driver()  # one size: one call
    one = _many(rng, 10_000, mixed=False)
    batch.bind(d2, direction, 0)(one.src, one.dst, one.sizes, 7)
    assert [c[1]["count"] for c in lib2.of("cuMemcpyBatchAsync")] == [10_000]
    one.check()


@pytest.mark.parametrize("how", ["param", "env"])
def test_the_cap_comes_from_the_bind_parameter_or_the_environment(how, monkeypatch):
    rng = np.random.default_rng()
    d, lib = standin_driver()
    if how == "env":
        monkeypatch.setenv(batch.CHUNK_ENV, "1000")
        chunk = batch.chunk_size({})
    else:
        monkeypatch.setenv(batch.CHUNK_ENV, "7")  # the parameter wins
        chunk = batch.chunk_size({"batch_chunk": 1000})
    fn = batch.bind(d, Direction.D2H, 0, chunk)  # mixed sizes: device to host caps them at 4,096
    pools = _many(rng, 2500)
    fn(pools.src, pools.dst, pools.sizes, 3)
    assert [c[1]["count"] for c in lib.of("cuMemcpyBatchAsync")] == [1000, 1000, 500]
    pools.check()


@pytest.mark.parametrize("bad", ["0", "-1", "lots", "2.5"])
def test_a_bad_cap_is_refused_with_where_it_came_from(bad, monkeypatch):
    monkeypatch.setenv(batch.CHUNK_ENV, bad)
    with pytest.raises(kvswap.ConfigurationError, match=batch.CHUNK_ENV) as e:
        batch.chunk_size({})
    assert repr(bad) in str(e.value)
    with pytest.raises(kvswap.ConfigurationError, match="batch_chunk"):
        batch.chunk_size({"batch_chunk": 0})


def test_a_failing_piece_names_the_callers_descriptor_and_stops_there():
    rng = np.random.default_rng()
    d, lib = standin_driver(fail_at=5, fail_calls={2})
    fn = batch.bind(d, Direction.H2D, 0, 100)
    pools = _many(rng, 450)
    with pytest.raises(DriverError) as e:
        fn(pools.src, pools.dst, pools.sizes, 3)
    assert (e.value.name, e.value.index) == ("CUDA_ERROR_INVALID_VALUE", 205)
    assert [c[1]["count"] for c in lib.of("cuMemcpyBatchAsync")] == [100, 100, 100]  # no call after it


# ---------------------------------------------------------------------------------------
# Driver-error recovery
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("abi", [12080, 13000])
def test_after_a_failed_batch_the_next_transfer_works(abi):
    """A failed call raises DriverError by the driver's name; the bound function keeps no
    state from it (context popped, nothing half-set), so the next transfer copies."""
    rng = np.random.default_rng()
    d, lib = standin_driver(batch_abis=(abi,), fail_at=0, fail_calls={0})
    fn = batch.bind(d, Direction.H2D, 1)
    first = HostPools(rng, rng.integers(1, 2000, 64), slot=2048)
    with pytest.raises(DriverError) as e:
        fn(first.src, first.dst, first.sizes, 0x77)
    assert e.value.name == "CUDA_ERROR_INVALID_VALUE" and e.value.call == "cuMemcpyBatchAsync"
    assert np.array_equal(first.dst_pool, first.before)  # the failed call moved nothing
    assert lib.current == 0 and lib.stack == []  # the pushed context was popped
    again = HostPools(rng, rng.integers(1, 2000, 64), slot=2048)
    fn(again.src, again.dst, again.sizes, 0x77)
    again.check()
    fn(first.src, first.dst, first.sizes, 0x77)  # and the batch that failed, retried
    first.check()
    assert len(lib.of("cuMemcpyBatchAsync")) == 3 and fn.last_path == "batch"


def test_per_copy_failure_names_its_descriptor_and_stops():
    d, lib = standin_driver(fail_at=2)
    fn = batch.bind(d, Direction.H2D, 0)
    pools = HostPools(np.random.default_rng(7), [64] * 6)
    with pytest.raises(DriverError) as e:
        fn(pools.src, pools.dst, pools.sizes, 0)
    assert (e.value.call, e.value.index) == ("cuMemcpyAsync", 2)
    assert len(lib.of("cuMemcpyAsync")) == 3


def test_the_cuda_plugin_creates_streams_only_for_cuda_and_only_with_libcuda(monkeypatch):
    import kvswap.backends.cuda as plugin

    assert plugin.kvswap_create_stream(platform="rocm", device_index=0) is None
    monkeypatch.setattr(driver, "LIBRARY_NAMES", ("/nonexistent/libcuda.so.1",))
    driver.reset()
    try:
        assert plugin.kvswap_create_stream(platform="cuda", device_index=0) is None
    finally:
        driver.reset()


@pytest.mark.parametrize("direction", [Direction.H2D, Direction.D2H])
def test_a_cap_under_the_mixed_cap_still_splits_a_short_batch(direction):
    """A batch short enough for one call of mixed sizes still goes in pieces of a smaller
    bound cap, in order, every byte where it belongs."""
    rng = np.random.default_rng()
    d, lib = standin_driver()
    fn = batch.bind(d, direction, 0, 4)
    pools = HostPools(rng, rng.integers(1, 300, 10))
    fn(pools.src, pools.dst, pools.sizes, 3)
    calls = lib.of("cuMemcpyBatchAsync")
    assert [c[1]["count"] for c in calls] == [4, 4, 2]
    np.testing.assert_array_equal(np.concatenate([c[1]["dst"] for c in calls]), pools.dst)
    pools.check()
    one = HostPools(rng, np.full(9, 128))  # one size, under the cap of one call
    fn2 = batch.bind(d, direction, 0, 16)
    fn2(one.src, one.dst, one.sizes, 3)
    assert lib.of("cuMemcpyBatchAsync")[-1][1]["count"] == 9 and fn2.last_path == batch.BATCH
    one.check()
