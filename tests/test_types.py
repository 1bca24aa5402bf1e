"""The shared value types refuse incoherent values at construction, naming themselves."""
from __future__ import annotations

import numpy as np
import pytest

from kvswap import (
    Calibration, ConfigurationError, CopyImpl, Curve, DeviceInfo, Direction, InvalidImplError, Policy,
)
from kvswap.errors import DriverError, InvalidTransferError, KvSwapError, ResolutionError


def factory(ctx):
    return lambda src, dst, sizes, stream: None


def test_direction_accepts_strings_and_names_choices():
    assert Direction.parse("H2D") is Direction.H2D and Direction.parse(Direction.D2H) is Direction.D2H
    assert Direction.H2D == "h2d" and str(Direction.D2H) == "d2h"
    assert Direction.H2D.src_is_host and Direction.D2H.dst_is_host
    with pytest.raises(ConfigurationError, match="direction='x2y' is not valid; choose one of 'h2d', 'd2h'"):
        Direction.parse("x2y")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(name="Cuda Batch"), "name must look like"),
        (dict(kind="dma"), "kind='dma' is not valid"),
        (dict(platforms=()), "platforms=() must be a non-empty"),
        (dict(directions=("h2d", "h2d")), "without repeats"),
        (dict(directions=("sideways",)), "direction='sideways'"),
        (dict(factory=None), "factory must be callable"),
        (dict(availability="yes"), "availability must be callable"),
        (dict(alignment=3), "alignment=3 must be a power of two"),
        (dict(min_block_bytes=0), "min_block_bytes=0"),
        (dict(min_block_bytes=64, max_block_bytes=32), "max_block_bytes=32"),
    ],
)
def test_copyimpl_validates_itself_and_names_itself(change, message):
    args = dict(name="acme.copy", kind="batch", platforms=("cpu",), directions=("h2d",), factory=factory)
    args.update(change)
    with pytest.raises(InvalidImplError) as err:
        CopyImpl(**args)
    assert message in str(err.value)
    assert str(err.value).startswith(f"CopyImpl {args['name']!r}:")


def test_copyimpl_normalises_and_reports():
    impl = CopyImpl("acme.copy", "kernel", "cpu", "d2h", factory, alignment=8, max_block_bytes=1 << 20)
    assert impl.platforms == ("cpu",) and impl.directions == (Direction.D2H,) and impl.uses_sms
    src = np.array([8, 16, 24, 32], dtype=np.int64)
    dst = np.array([8, 9, 24, 32], dtype=np.int64)
    sizes = np.array([8, 8, 7, 2 << 20], dtype=np.int64)
    assert impl.refused(src, dst, sizes).tolist() == [False, True, True, True]
    assert "multiples of 8" in impl.why_refused(8, 9, 8)
    dev = DeviceInfo("cuda", "x", "x", 1)
    assert "serves platforms cpu, not cuda" in impl.unavailable_reason(dev)


def test_an_availability_check_that_raises_is_a_reason_not_a_crash():
    def boom(device):
        raise OSError("libacme.so: cannot open shared object file")

    impl = CopyImpl("acme.copy", "batch", ("cpu",), ("h2d",), factory, availability=boom)
    dev = DeviceInfo("cpu", "cpu", "cpu", 2)
    assert "raised OSError: libacme.so" in impl.unavailable_reason(dev)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(max_sms=-1), "max_sms=-1"),
        (dict(max_sms=True), "max_sms=True"),
        (dict(prefer="speed"), "prefer='speed' is not valid; choose one of 'throughput', 'low_interference'"),
        (dict(force=""), "force=''"),
    ],
)
def test_policy_refuses_bad_values(change, message):
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Policy(**change)


def test_deviceinfo_identity_is_a_safe_key():
    with pytest.raises(ConfigurationError, match="identity"):
        DeviceInfo("cuda", "H200", "NVIDIA H200/../../etc", 132)
    with pytest.raises(ConfigurationError, match="compute_units"):
        DeviceInfo("cuda", "H200", "h200", -1)
    d = DeviceInfo("cuda", "H200", "nvidia-h200", 132, index=1)
    assert d.to_dict()["identity"] == "nvidia-h200" and d.torch_device == "cuda:1"


def test_curve_interpolates_over_log_size_and_holds_ends():
    c = Curve("acme.copy", "h2d", ((4096, 10.0), (16384, 30.0)))
    assert c.gbps(1024) == 10.0 and c.gbps(1 << 20) == 30.0
    assert c.gbps(8192) == pytest.approx(20.0)
    with pytest.raises(InvalidImplError, match="repeated block size"):
        Curve("acme.copy", "h2d", ((4096, 1.0), (4096, 2.0)))
    with pytest.raises(InvalidImplError, match="points"):
        Curve("acme.copy", "h2d", ())


def test_calibration_picks_kernel_curve_by_sm_count_and_scales_below():
    curves = (
        Curve("k.k", "h2d", ((4096, 20.0),), num_sms=4),
        Curve("k.k", "h2d", ((4096, 40.0),), num_sms=8),
        Curve("*batch", "h2d", ((4096, 5.0),)),
    )
    cal = Calibration("test", "cuda", curves=curves)
    assert cal.predict("k.k", "kernel", Direction.H2D, 4096, 8) == 40.0
    assert cal.predict("k.k", "kernel", Direction.H2D, 4096, 6) == 20.0
    assert cal.predict("k.k", "kernel", Direction.H2D, 4096, 2) == 10.0
    assert cal.predict("other.dma", "batch", Direction.H2D, 4096) == 5.0
    assert cal.predict("other.k", "kernel", Direction.H2D, 4096, 8) is None
    with pytest.raises(InvalidImplError, match="scope"):
        Calibration("test", "cuda", scope="galaxy")
    with pytest.raises(InvalidImplError, match="slowdown"):
        Calibration("test", "cuda", slowdown={"kernel": 1.5})


def test_error_hierarchy():
    assert issubclass(InvalidTransferError, ValueError) and issubclass(InvalidTransferError, KvSwapError)
    assert issubclass(ConfigurationError, ValueError)
    assert issubclass(ResolutionError, RuntimeError) and issubclass(DriverError, RuntimeError)
    e = DriverError("cuMemcpyBatchAsync", 1, "CUDA_ERROR_INVALID_VALUE", "invalid argument", index=7)
    assert str(e) == "cuMemcpyBatchAsync failed: CUDA_ERROR_INVALID_VALUE (1): invalid argument [descriptor 7]"
    assert (e.code, e.index) == (1, 7)


def test_a_route_says_what_each_batch_size_runs_on():
    from kvswap import Route

    r = Route(min_bytes=1, max_bytes=None, impl="k.kernel", at_bytes=4096, predicted=(), min_batch=8,
              small_batch_impl="k.batch", sms_by_batch=((1, 24), (64, 4), (512, 0)))
    assert [r.runs(n) for n in (1, 7, 8, 63, 64, 511, 512, 10000)] == [
        ("k.batch", None), ("k.batch", None),  # under min_batch
        ("k.kernel", 24), ("k.kernel", 24), ("k.kernel", 4), ("k.kernel", 4),
        ("k.batch", None), ("k.batch", None)]  # a tier of 0 SMs
    bound = Route(min_bytes=1, max_bytes=None, impl="k.kernel", at_bytes=4096, predicted=())
    assert bound.runs(1) == bound.runs(10000) == ("k.kernel", None)  # the SMs it was bound with
