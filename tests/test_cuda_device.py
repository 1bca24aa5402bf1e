"""The CUDA device description and the CUDA defaults, without a GPU: sysfs, NVML and
torch's device query are played by stand-ins (a temporary sysfs tree, a fake ``pynvml``
module, monkeypatched ``torch.cuda`` queries)."""
from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from kvswap import DeviceInfo, Direction, Policy
from kvswap.backends.triton_generic import kernel as triton_kernel
from kvswap.backends.cuda.batch import CUDA_BATCH
from kvswap.backends.cuda import defaults, device, driver
from kvswap.resolution.lookup import find_calibration
from kvswap.registry.platform import cpu_device
from kvswap.registry.plugins import create_plugin_host

from cuda_standin import fresh_driver  # noqa: F401 (autouse fixture)

KiB = 1024




def test_spec_parsing():
    assert device.parse_spec(None) == (True, None)
    assert device.parse_spec("cuda") == (True, None)
    assert device.parse_spec("cuda:3") == (True, 3)
    assert device.parse_spec("xpu:0")[0] is False and device.parse_spec("cpu")[0] is False


def test_bus_ids_and_link_text():
    assert device.normalize_bus_id("00000000:19:00.0") == "0000:19:00.0"
    assert device.normalize_bus_id("0001:AB:1F.3") == "0001:ab:1f.3"
    assert device.normalize_bus_id("garbage") == "unknown"
    assert [device.link_generation(s) for s in ("2.5 GT/s PCIe", "32.0 GT/s PCIe", "16 GT/s", "Unknown")] == [1, 5, 4, None]
    assert device.link_text(5, 16) == "pcie-gen5-x16" and device.link_text(None, 16) == "unknown"


def test_identity_is_the_kind_of_device_never_the_slot():
    a = device.device_identity("NVIDIA H200", "sm_90", 132, "pcie-gen5-x16")
    assert a == "cuda-nvidia-h200-sm_90-132sm-pcie-gen5-x16"
    assert a == device.device_identity("NVIDIA H200", "sm_90", 132, "pcie-gen5-x16")
    assert a != device.device_identity("NVIDIA H200", "sm_90", 132, "pcie-gen4-x16")
    assert a != device.device_identity("NVIDIA H100 80GB HBM3", "sm_90", 132, "pcie-gen5-x16")


def fake_sysfs(tmp_path: Path, bus: str, dev_max=("32.0 GT/s PCIe", "16"), up_max=("16.0 GT/s PCIe", "16"),
               current=("2.5 GT/s PCIe", "16")) -> Path:
    """A sysfs stand-in: the GPU under its upstream port, linked from bus/pci/devices."""
    port = tmp_path / "devices" / "pci0000:00" / "0000:00:01.0"
    gpu = port / bus
    gpu.mkdir(parents=True)
    for where, (speed, width) in ((gpu, dev_max), (port, up_max)):
        if speed:
            (where / "max_link_speed").write_text(speed + "\n")
            (where / "max_link_width").write_text(width + "\n")
    (gpu / "current_link_speed").write_text(current[0] + "\n")
    (gpu / "current_link_width").write_text(current[1] + "\n")
    root = tmp_path / "bus"
    root.mkdir()
    (root / bus).symlink_to(gpu)
    return root


def test_sysfs_link_is_what_both_ends_support_not_the_idle_speed(tmp_path):
    root = fake_sysfs(tmp_path, "0000:19:00.0")
    gen, width, extra = device.sysfs_link("0000:19:00.0", root)
    assert (gen, width) == (4, 16) and extra["link_current"] == "pcie-gen1-x16"
    assert device.sysfs_link("0000:aa:00.0", root) == (None, None, {})


def test_sysfs_link_falls_back_to_the_current_values(tmp_path):
    root = fake_sysfs(tmp_path, "0000:19:00.0", dev_max=(None, None), up_max=(None, None),
                      current=("32.0 GT/s PCIe", "8"))
    assert device.sysfs_link("0000:19:00.0", root)[:2] == (5, 8)


class FakeCudaProps(types.SimpleNamespace):
    """Stand-in for torch's CUDA device properties."""


def _pretend_torch_sees_an_h200(monkeypatch, tmp_path, nvml=None):
    import torch

    props = FakeCudaProps(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
                          total_memory=141 << 30, pci_domain_id=0, pci_bus_id=0x19, pci_device_id=0)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(driver, "LIBRARY_NAMES", ("/nonexistent/libcuda.so.1",))
    monkeypatch.setattr(device, "SYSFS_PCI", fake_sysfs(tmp_path, "0000:19:00.0", up_max=("32.0 GT/s PCIe", "16")))
    monkeypatch.setattr(device, "NVIDIA_PROC_VERSION", tmp_path / "version")
    (tmp_path / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue Jan 1 2026\n")
    if nvml is not None:
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
    else:
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails: NVML absent


def test_describe_a_cuda_device_through_sysfs(monkeypatch, tmp_path):
    _pretend_torch_sees_an_h200(monkeypatch, tmp_path)
    info = device.describe(None)
    assert info.platform == "cuda" and info.index == 1 and info.name == "NVIDIA H200"
    assert (info.arch, info.compute_units, info.link) == ("sm_90", 132, "pcie-gen5-x16")
    assert info.identity == "cuda-nvidia-h200-sm_90-132sm-pcie-gen5-x16"
    assert info.pci_bus_id == "0000:19:00.0" and info.runtime_version == "13.0"
    assert info.driver_version == "580.159.04" and "libcuda" in info.details["driver_problem"]
    assert info.details["link_source"] == "sysfs" and info.torch_device == "cuda:1"
    assert device.describe("cuda:2") is None and device.describe("cuda:0").index == 0


def test_describe_prefers_nvml(monkeypatch, tmp_path):
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"580.159.04",
        nvmlDeviceGetHandleByPciBusId=lambda bus: ("handle", bus),
        nvmlDeviceGetMaxPcieLinkGeneration=lambda h: 4, nvmlDeviceGetMaxPcieLinkWidth=lambda h: 8,
        nvmlDeviceGetCurrPcieLinkGeneration=lambda h: 1, nvmlDeviceGetCurrPcieLinkWidth=lambda h: 8,
    )
    _pretend_torch_sees_an_h200(monkeypatch, tmp_path, nvml)
    info = device.describe("cuda:1")
    assert info.link == "pcie-gen4-x8" and info.details["link_source"] == "nvml"
    assert info.details["link_current"] == "pcie-gen1-x8" and info.driver_version == "580.159.04"


def test_describe_leaves_rocm_torch_alone(monkeypatch, tmp_path):
    import torch

    _pretend_torch_sees_an_h200(monkeypatch, tmp_path)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert device.describe(None) is None

# ---------------------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------------------

def gpu(name: str) -> DeviceInfo:
    return DeviceInfo(platform="cuda", name=name, identity=device.device_identity(name, "sm_90", 132, "unknown"),
                      compute_units=132, index=0)


@pytest.mark.parametrize("name, family", [
    ("NVIDIA H200", defaults.H200), ("NVIDIA H200 NVL", defaults.H200),
    ("NVIDIA H100 80GB HBM3", defaults.H100), ("NVIDIA H100 PCIe", defaults.H100),
    ("NVIDIA GH200 480GB", None), ("NVIDIA L4", None),
])
def test_defaults_match_devices_by_family(name, family):
    cals = defaults.calibrations_for(gpu(name))
    assert cals[-1] is defaults.UNKNOWN
    assert cals[:-1] == ([family] if family else [])
    host = create_plugin_host(env={"KVSWAP_PLUGINS": "cuda"})
    assert find_calibration(host, gpu(name)) is (family or defaults.UNKNOWN)


def test_no_cuda_defaults_for_other_platforms():
    assert defaults.calibrations_for(cpu_device()) == []


@pytest.mark.parametrize("cal", [defaults.H200, defaults.H100, defaults.UNKNOWN], ids=lambda c: c.source[:40])
def test_defaults_are_well_formed(cal):
    assert cal.platform == "cuda" and cal.source.startswith("cuda defaults: ")
    assert any(w in cal.source for w in ("measured", "published", "guess"))
    assert {c.impl for c in cal.curves} == {"cuda.batch", "triton.kernel"}
    for d in (Direction.H2D, Direction.D2H):
        assert cal.predict("cuda.batch", "batch", d, 16 * KiB) is not None
        assert cal.predict("triton.kernel", "kernel", d, 16 * KiB, cal.sms(d)) is not None
    assert all(c.num_sms for c in cal.curves if c.impl == "triton.kernel")
    assert all(c.num_sms is None for c in cal.curves if c.impl == "cuda.batch")
    assert cal.scope == ("platform" if cal is defaults.UNKNOWN else "family")
    assert cal.calibrated is (cal is defaults.H200)


def test_h200_defaults_hold_our_measurements_and_their_crossover():
    h2d, d2h = Direction.H2D, Direction.D2H
    cal = defaults.H200
    assert cal.predict("cuda.batch", "batch", h2d, 4 * KiB) == pytest.approx(4.1)
    assert cal.predict("cuda.batch", "batch", d2h, 64 * KiB) == pytest.approx(42.5)
    assert cal.predict("triton.kernel", "kernel", h2d, 4 * KiB, 4) == pytest.approx(49.9)
    assert cal.predict("triton.kernel", "kernel", h2d, 4 * KiB, 2) == pytest.approx(36.9)
    assert cal.predict("triton.kernel", "kernel", d2h, 16 * KiB, 12) == pytest.approx(52.3)  # the 8-SM curve
    assert cal.ceiling_gbps == {"h2d": 55.5, "d2h": 55.4}
    for d in (Direction.H2D, Direction.D2H):  # the H200 table: the kernel wins below 128 KiB in both directions
        for size in (4 * KiB, 16 * KiB, 64 * KiB):
            assert cal.predict("triton.kernel", "kernel", d, size, cal.sms(d)) > cal.predict("cuda.batch", "batch", d, size)


def test_h100_curves_cross_at_28_kib():
    cal = defaults.H100
    for d in (Direction.H2D, Direction.D2H):
        sms = cal.sms(d)
        assert sms == 12 and cal.min_batch(d) == 16

        def kernel_lead(size):
            return cal.predict("triton.kernel", "kernel", d, size, sms) - cal.predict("cuda.batch", "batch", d, size)

        assert kernel_lead(4 * KiB) > 0 and kernel_lead(27 * KiB) > 0
        assert kernel_lead(28 * KiB) == pytest.approx(0)
        assert kernel_lead(29 * KiB) < 0 and kernel_lead(256 * KiB) < 0


def test_published_h100_thresholds_resolve_as_published_without_the_measurement_margin():
    from kvswap.resolution.routing import rank

    impls = [CUDA_BATCH, triton_kernel.copy_impl()]
    for size, route in ((27 * KiB, "triton.kernel"), (28 * KiB - 1, "triton.kernel"), (28 * KiB, "cuda.batch")):
        ranked = rank(impls, defaults.H100, Direction.H2D, Policy(), size, True, 12)
        assert ranked[0][0].name == route, size
