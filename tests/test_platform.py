"""Which device a resolve is for."""
from __future__ import annotations

import pytest

import kvswap
from kvswap import ConfigurationError, DeviceInfo, PluginWarning, hookimpl
from kvswap.registry.platform import cpu_device, detect, device_spec
from kvswap.registry.plugins import create_plugin_host


@pytest.mark.parametrize("given, spec", [(None, None), ("CPU", "cpu"), ("cuda", "cuda"), ("cuda:1", "cuda:1"), (2, "cuda:2")])
def test_device_spec(given, spec):
    assert device_spec(given) == spec


def test_device_spec_accepts_torch_devices_and_refuses_nonsense():
    import torch

    assert device_spec(torch.device("cuda", 3)) == "cuda:3"
    for bad in ("cuda:x", "", True, -1):
        with pytest.raises(ConfigurationError):
            device_spec(bad)


def test_cpu_identity_is_stable_and_safe():
    d = cpu_device()
    assert d.platform == "cpu" and d.compute_units >= 1
    assert d.identity == cpu_device().identity and d.identity.startswith("cpu-")


def test_asking_for_a_gpu_on_a_machine_without_one_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigurationError, match="torch sees no CUDA or ROCm device"):
        kvswap.resolve("h2d", device="cuda:0")


class Claim:
    def __init__(self, platform):
        self.platform = platform

    @hookimpl
    def kvswap_detect_platform(self, device):
        return DeviceInfo(self.platform, f"{self.platform} dev", f"{self.platform}-dev", 8)


def test_two_claims_prefer_torchs_view_then_plugin_name_and_warn():
    host = create_plugin_host(entry_points=[], env={}, extra=[("zeta", Claim("cpu")), ("alpha", Claim("acme"))])
    with pytest.warns(PluginWarning, match="'alpha' .*also claimed device default; kvswap uses 'zeta'"):
        info = detect(host, None)
    assert info.platform == "cpu"  # torch sees a CPU here: the claim that agrees wins
    host = create_plugin_host(entry_points=[], env={}, extra=[("zeta", Claim("xpu")), ("alpha", Claim("acme"))])
    with pytest.warns(PluginWarning, match="'zeta' .*also claimed"):
        assert detect(host, "acme:0").platform == "acme"
