"""Several GPUs of different kinds in one process, played by a fake plugin on the CPU:
each ``cuda:N`` is described, calibrated, capped and listed as itself."""
from __future__ import annotations

import numpy as np
import pytest

import kvswap
from kvswap import Calibration, CopyImpl, Curve, DeviceInfo, Policy, hookimpl
from kvswap.memory import numa
from kvswap.cli.inventory import format_report, report
from kvswap.memory.numa import Topology
from kvswap.registry.platform import detect
from kvswap.registry.plugins import create_plugin_host
from kvswap.registry.reference import host_copy

from numa_fakes import fake_sysfs

KiB = 1024
BOTH = ("h2d", "d2h")
# Two kinds on one host: a big GPU on each socket, a small one on each socket.
KINDS = {0: ("Big GPU", 132, "0000:17:00.0"), 1: ("Big GPU", 132, "0000:c1:00.0"),
         2: ("Small GPU", 8, "0000:18:00.0"), 3: ("Small GPU", 8, "0000:c2:00.0")}
NODES = {"0000:17:00.0": "0", "0000:18:00.0": "0", "0000:c1:00.0": "1", "0000:c2:00.0": "1"}


def identity(name: str, sms: int) -> str:
    return f"cuda-{name.lower().replace(' ', '-')}-{sms}sm"


class Rig:
    """Describes cuda:0..3 and registers a batch and a kernel route that really copy host
    memory, and one calibration per kind: the big kind's knee 16 SMs, the small kind's 32
    (more than it has: the resolver must cap it at 8)."""

    def __init__(self) -> None:
        self.bound: list[tuple[str, int, int | None]] = []

    @hookimpl
    def kvswap_detect_platform(self, device):
        if device is None or not device.startswith("cuda:"):
            return None
        i = int(device.split(":")[1])
        if i not in KINDS:
            return None
        name, sms, bus = KINDS[i]
        return DeviceInfo("cuda", name, identity(name, sms), sms, index=i, arch="sm_90", link="pcie-gen5-x16",
                          pci_bus_id=bus, details={"torch_type": "cuda"})

    def _route(self, name):
        def factory(ctx):
            self.bound.append((name, ctx.device.index, ctx.params.get("num_sms")))
            return lambda src, dst, sizes, stream: host_copy(src, dst, sizes)
        return factory

    @hookimpl
    def kvswap_register_copy_impls(self, platform, register):
        if platform == "cuda":
            register(CopyImpl("rig.batch", "batch", ("cuda",), BOTH, self._route("rig.batch")))
            register(CopyImpl("rig.kernel", "kernel", ("cuda",), BOTH, self._route("rig.kernel")))

    @hookimpl
    def kvswap_register_calibrations(self, device, register):
        knee = 16 if device.compute_units > 100 else 32
        # The kernel wins small blocks on both kinds; the batch route wins from 64 KiB.
        curves = (
            [Curve("rig.kernel", d, ((4 * KiB, 40.0), (256 * KiB, 40.0)), num_sms=knee) for d in BOTH]
            + [Curve("rig.batch", d, ((4 * KiB, 4.0), (32 * KiB, 20.0), (64 * KiB, 50.0)), None) for d in BOTH]
        )
        register(Calibration(source=f"rig calibration for {device.identity}", platform="cuda", scope="device",
                             identity=device.identity, curves=tuple(curves), kernel_sms={d: knee for d in BOTH}))


def route_for(plan, size: int) -> str:
    return next(r.impl for r in plan.routes if r.min_bytes <= size and (r.max_bytes is None or size <= r.max_bytes))


@pytest.fixture
def rig():
    plugin = Rig()
    return plugin, create_plugin_host(entry_points=[], env={}, extra=[("rig", plugin)])


@pytest.mark.parametrize("index", list(KINDS))
def test_each_index_resolves_as_its_own_device(rig, index):
    plugin, host = rig
    name, sms, bus = KINDS[index]
    fn = kvswap.resolve("h2d", device=f"cuda:{index}", block_bytes=[8 * KiB, 128 * KiB], host=host)
    plan = fn.plan
    assert plan.device.index == index and plan.device.pci_bus_id == bus
    assert plan.device.identity == identity(name, sms)
    assert plan.calibration["source"] == f"rig calibration for {identity(name, sms)}"
    assert plan.params["rig.kernel"]["num_sms"] == (16 if sms > 100 else 8)  # the small kind capped at its 8
    assert {(n, i) for n, i, _ in plugin.bound} == {("rig.batch", index), ("rig.kernel", index)}
    assert route_for(fn.plan, 8 * KiB) == "rig.kernel" and route_for(fn.plan, 128 * KiB) == "rig.batch"
    assert f"cuda:{index}" in fn.explain() or name in fn.explain()
    # The copy really happens, through this device's bound function.
    rng = np.random.default_rng(index)
    src = rng.integers(0, 256, 64 * KiB, dtype=np.uint8)
    dst = rng.integers(0, 256, 64 * KiB, dtype=np.uint8)
    want = dst.copy()
    want[16 * KiB:24 * KiB] = src[:8 * KiB]
    fn(np.array([src.ctypes.data], dtype=np.int64), np.array([dst.ctypes.data + 16 * KiB], dtype=np.int64),
       np.array([8 * KiB], dtype=np.int64))
    assert np.array_equal(dst, want)


def test_an_sm_budget_is_per_resolve_and_capped_by_each_device(rig):
    _, host = rig
    got = {i: kvswap.resolve("d2h", device=f"cuda:{i}", policy=Policy(max_sms=12), host=host).plan.params
           for i in KINDS}
    assert {i: p["rig.kernel"]["num_sms"] for i, p in got.items()} == {0: 12, 1: 12, 2: 8, 3: 8}
    none = kvswap.resolve("d2h", device="cuda:2", policy=Policy(max_sms=0), host=host)
    assert route_for(none.plan, 8 * KiB) == "rig.batch"
    # Resolving for one device never changed what another resolves to.
    assert kvswap.resolve("d2h", device="cuda:0", host=host).plan.params["rig.kernel"]["num_sms"] == 16


def test_calibration_settings_take_each_devices_sm_count(rig):
    from kvswap.calibration.sweep import settings_for

    _, host = rig
    big, small = detect(host, "cuda:0"), detect(host, "cuda:2")
    assert max(settings_for(big).sm_counts) > 8 and max(settings_for(small).sm_counts) <= 8
    from kvswap.resolution import profiles

    assert profiles.default_path(big) != profiles.default_path(small)
    assert profiles.default_path(big) == profiles.default_path(detect(host, "cuda:1"))  # one kind, one profile


def test_info_lists_every_gpu_with_link_node_and_near_cpus(rig, tmp_path, monkeypatch):
    _, host = rig
    root = fake_sysfs(tmp_path, {0: "0-15", 1: "16-31"},
                      {bus: (node, "0-7" if bus == "0000:17:00.0" else "") for bus, node in NODES.items()})
    monkeypatch.setattr(numa, "SYSFS_ROOT", root)
    monkeypatch.setattr(numa, "accelerator_count", lambda: 5)  # cuda:4 is one the plugin cannot describe
    info = report(host, "cuda:1")
    rows = info["gpus"]
    assert [r["device"] for r in rows] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:4"]
    assert [r.get("numa_node") for r in rows[:4]] == [0, 1, 0, 1]
    assert [r.get("near_cpus") for r in rows[:4]] == ["0-7", "16-31", "0-15", "16-31"]
    assert rows[2]["link"] == "pcie-gen5-x16" and rows[2]["name"] == "Small GPU"
    assert "error" in rows[4]
    text = format_report(info)
    assert ("  cuda:1  Big GPU (link pcie-gen5-x16, PCI 0000:c1:00.0, NUMA node 1, near CPUs 16-31)"
            in text.splitlines())
    assert "  cuda:4  not described: " in text
    import json

    assert json.loads(json.dumps(info))["gpus"][0]["numa_node"] == 0


def test_info_on_a_machine_without_gpus(rig):
    _, host = rig
    info = report(host, "cpu")
    assert info["gpus"] == [] and "gpus: none seen by torch" in format_report(info).splitlines()


def test_gpu_rows_with_unknown_nodes(rig, tmp_path):
    _, host = rig
    topo = Topology(fake_sysfs(tmp_path, {0: "0-3"}, {"0000:17:00.0": ("-1", "")}))
    rows = numa.gpu_rows(host, count=2, topo=topo)
    assert rows[0]["numa_node"] is None and rows[0]["near_cpus"] == ""
    assert rows[1]["numa_node"] is None  # no sysfs entry at all
    assert "NUMA node unknown, near CPUs unknown" in numa.format_gpu_rows(rows)[1]
