"""ROCm DeviceInfo and defaults on the CPU: torch's device queries are replaced by a fake
ROCm build, and the HIP runtime by RecordingHipStandIn (a stand-in, not HIP)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvswap import ConfigurationError, DeviceInfo, Direction
import kvswap.backends.rocm as rocm_plugin
from kvswap.backends.rocm import hip
from kvswap.backends.rocm.defaults import calibration_for
from kvswap.backends.rocm.device import detect
from kvswap.backends.rocm.hip import HipUnavailable
from kvswap.registry.platform import detect as core_detect
from kvswap.registry.plugins import create_plugin_host

from rocm_standin import RecordingHipStandIn, fresh_hip  # noqa: F401 (fixture)

MI300X = dict(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-", multi_processor_count=304,
              pci_bus_id=0x83, pci_domain_id=0, pci_device_id=0)


@pytest.fixture
def rocm_torch(monkeypatch):
    """torch as a ROCm build would answer: two devices, the current one is 1."""
    import torch

    props = [SimpleNamespace(**MI300X), SimpleNamespace(**dict(MI300X, gcnArchName="gfx942:sramecc-:xnack+",
                                                                pci_bus_id=0x03))]
    monkeypatch.setattr(torch.version, "hip", "7.2.53211-e6c0f8d", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    return props


def test_describes_the_current_device_with_hip_versions(rocm_torch):
    standin = RecordingHipStandIn(version=(7, 2, 53211))
    info = detect(None, standin.api)
    assert (info.platform, info.name, info.index, info.compute_units) == ("rocm", "AMD Instinct MI300X", 1, 304)
    assert info.arch == "gfx942:sramecc-:xnack+" and info.details["gcn_arch"] == info.arch
    assert (info.runtime_version, info.driver_version) == ("7.2.53211", "7.2.53211")
    assert info.identity == "rocm-amd-instinct-mi300x-gfx942-304cu"
    assert info.pci_bus_id == "0000:03:00" and info.details["hip_library"] == "RecordingHipStandIn"
    assert standin.names() == ["hipRuntimeGetVersion", "hipDriverGetVersion"]


def test_identity_ignores_the_slot_and_the_xnack_mode(rocm_torch):
    api = RecordingHipStandIn().api
    one, zero = detect("cuda:1", api), detect("cuda:0", api)
    assert one.pci_bus_id != zero.pci_bus_id and one.arch != zero.arch
    assert one.identity == zero.identity and "83" not in zero.identity


def test_other_device_types_are_not_ours_and_bad_indices_are_refused(rocm_torch):
    api = RecordingHipStandIn().api
    assert detect("xpu:0", api) is None
    assert detect("cuda", api).index == 1
    with pytest.raises(ConfigurationError, match=r"device='cuda:7'.*0\.\.1"):
        detect("cuda:7", api)


def test_without_the_hip_library_torch_still_describes_it(rocm_torch):
    def missing():
        raise HipUnavailable("no libamdhip64 here")

    info = detect(None, missing)
    assert info.runtime_version == "7.2.53211-e6c0f8d" and info.driver_version == "unknown"
    assert info.details["hip_error"] == "no libamdhip64 here"


def test_the_plugin_answers_for_core_detection(rocm_torch):
    hip.reset(RecordingHipStandIn().api)
    host = create_plugin_host(entry_points=[], extra=[("rocm", rocm_plugin)])
    info = core_detect(host, None)
    assert info.platform == "rocm" and info.details["source"] == "kvswap.backends.rocm"


def test_not_a_rocm_build_means_no_answer(monkeypatch):
    import torch

    api = RecordingHipStandIn().api
    if getattr(torch.version, "hip", None):
        pytest.skip("this torch is a ROCm build")
    assert detect(None, api) is None  # this machine: CPU torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA build with a GPU
    assert detect(None, api) is None


def _rocm(runtime):
    return DeviceInfo(platform="rocm", name="AMD Instinct MI300X", identity="rocm-mi300x", compute_units=304,
                      index=0, arch="gfx942", runtime_version=runtime)


@pytest.mark.parametrize("runtime", ["7.2.53211", "7.13.0", "8.0.1", "6.4.43482", None])
def test_defaults_rank_the_batch_route_above_any_kernel_everywhere(runtime):
    cal = calibration_for(_rocm(runtime))
    assert not cal.calibrated and cal.platform == "rocm" and "nothing measured" in cal.source
    for d in (Direction.H2D, Direction.D2H):
        for size in [1 << k for k in range(8, 24)] + [3 << 12, 24 << 10]:
            batch = cal.predict("rocm.batch", "batch", d, size)
            for sms in (1, 8, 64, 304):
                assert batch > cal.predict("triton.kernel", "kernel", d, size, sms), (d, size, sms)


@pytest.mark.parametrize("runtime, batches", [
    ("7.1.25424", False), ("7.2.53211-e6c0f8d", False), ("7.12.0", False), (None, False), ("garbled", False),
    ("7.13.0", True), ("7.14.2", True), ("8.0.0", True),
])
def test_the_batch_route_is_credited_as_a_per_copy_loop_until_hip_7_13(runtime, batches):
    """ROCm/clr issue 273: on 7.2.x hipMemcpyBatchAsync loops over single copies inside."""
    cal = calibration_for(_rocm(runtime))
    loop = calibration_for(_rocm("7.2.0"))
    real = calibration_for(_rocm("7.13.0"))
    for d in Direction:
        for size in (4096, 16384, 65536):
            got = cal.predict("rocm.batch", "batch", d, size)
            assert got == (real if batches else loop).predict("rocm.batch", "batch", d, size)
        # A loop of single copies pays a fixed cost per descriptor: far slower at 4 KiB.
        assert loop.predict("rocm.batch", "batch", d, 4096) < real.predict("rocm.batch", "batch", d, 4096) / 3
    assert ("ROCm/clr issue 273" in cal.source) is not batches
