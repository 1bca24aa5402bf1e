"""NUMA topology from a fake sysfs tree, page placement queried of this kernel, and
``kvswap.host_empty`` placing its pages by first touch from bound threads."""
from __future__ import annotations

import gc
import os
import threading
import warnings

import numpy as np
import pytest
import torch

import kvswap
from kvswap import ConfigurationError, NumaWarning
from kvswap.memory import numa
from kvswap.memory import host_memory
from kvswap.memory.numa import PagePlacement, Topology, format_cpulist, parse_cpulist, pci_address

from numa_fakes import allowed_cpus, fake_sysfs, gpu


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(host_memory, "_warned", set())


def _query_works() -> bool:
    buf = np.ones(4096 * 4, dtype=np.uint8)
    placed = numa.page_nodes(int(buf.ctypes.data), buf.nbytes)
    return placed is not None and bool(placed.nodes)


QUERY = _query_works()
needs_query = pytest.mark.skipif(not QUERY, reason="this kernel refuses move_pages(2) queries")


# -- parsing -------------------------------------------------------------------------

@pytest.mark.parametrize("text, cpus", [
    ("0-3,8-11", (0, 1, 2, 3, 8, 9, 10, 11)),
    ("5", (5,)),
    ("", ()),
    ("\n", ()),
    ("0-15,32-47", tuple(range(16)) + tuple(range(32, 48))),
    ("0-7:2/4", (0, 1, 4, 5)),
    ("3,1,2", (1, 2, 3)),
])
def test_parse_cpulist(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("bad", ["a", "3-1", "1-", "0-7:5/4", "1,,x"])
def test_parse_cpulist_refuses_what_is_not_one(bad):
    with pytest.raises(ValueError, match="not a cpulist"):
        parse_cpulist(bad)


def test_format_cpulist_is_compact_and_round_trips():
    rng = np.random.default_rng()
    cpus = sorted(set(rng.integers(0, 200, 60).tolist()))
    assert parse_cpulist(format_cpulist(cpus)) == tuple(cpus)
    assert format_cpulist([3, 0, 1, 2, 8, 10, 11]) == "0-3,8,10-11"
    assert format_cpulist([]) == ""


@pytest.mark.parametrize("given, want", [
    ("0000:17:00.0", "0000:17:00.0"),
    ("00000000:17:00.0", "0000:17:00.0"),  # NVML / cuDeviceGetPCIBusId spelling
    ("0000:C1:00", "0000:c1:00.0"),  # no function number, upper case
    ("17:00.1", "0000:17:00.1"),
    ("unknown", None),
    ("", None),
])
def test_pci_address(given, want):
    assert pci_address(given) == want


# -- topology ------------------------------------------------------------------------

def two_sockets(tmp_path, **kw):
    return fake_sysfs(tmp_path, {0: "0-15,32-47", 1: "16-31,48-63"}, {
        "0000:17:00.0": ("0", "0-15,32-47"),
        "0000:c1:00.0": ("1", ""),
        "0000:50:00.0": ("-1", ""),
        "0000:51:00.0": ("garbage", ""),
    }, **kw)


def test_topology_reads_nodes_cpus_and_devices(tmp_path):
    topo = Topology(two_sockets(tmp_path))
    assert topo.nodes() == (0, 1) and topo.memory_nodes() == (0, 1)
    assert topo.node_cpus(1) == tuple(range(16, 32)) + tuple(range(48, 64))
    assert topo.node_cpus(7) == ()
    assert topo.pci_node("0000:17:00.0") == 0
    assert topo.pci_node("00000000:C1:00.0") == 1
    assert topo.pci_node("0000:50:00.0") is None  # -1: the firmware does not say
    assert topo.pci_node("0000:51:00.0") is None
    assert topo.pci_node("0000:99:00.0") is None  # no such device
    assert topo.pci_local_cpus("0000:17:00.0") == tuple(range(16)) + tuple(range(32, 48))
    assert topo.pci_local_cpus("0000:c1:00.0") == ()


def test_near_cpus_fall_back_to_the_nodes_cpus(tmp_path):
    topo = Topology(two_sockets(tmp_path))
    assert topo.near_cpus(gpu(bus="0000:c1:00.0")) == topo.node_cpus(1)
    assert topo.near_cpus(gpu(bus="0000:50:00.0")) == ()
    assert topo.near_cpus(kvswap.registry.platform.cpu_device()) == ()


def test_nodes_without_online_list_come_from_the_folders(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-1", 2: "2-3"})
    (root / "devices/system/node/online").unlink()
    (root / "devices/system/node/has_memory").unlink()
    topo = Topology(root)
    assert topo.nodes() == (0, 2) and topo.memory_nodes() == (0, 2)
    assert Topology(tmp_path / "nothing").nodes() == ()


def test_placement_target(tmp_path):
    topo = Topology(two_sockets(tmp_path))
    assert topo.placement_target(gpu(bus="0000:c1:00.0")) == (1, "")
    node, why = topo.placement_target(gpu(bus="0000:50:00.0"))
    assert node is None and "numa_node is -1 or missing" in why and "0000:50:00.0" in why
    node, why = topo.placement_target(gpu(bus="unknown"))
    assert node is None and "no known PCI address" in why
    node, why = topo.placement_target(kvswap.registry.platform.cpu_device())
    assert node is None and "host itself" in why


def test_one_memory_node_has_nothing_to_place(tmp_path):
    # Two nodes, but memory on one (the other CPU-only): every page is local to every GPU.
    topo = Topology(two_sockets(tmp_path, has_memory="0"))
    assert topo.placement_target(gpu(bus="0000:50:00.0")) == (None, "")


def test_device_row(tmp_path):
    row = numa.device_row(gpu(index=3, bus="00000000:C1:00.0"), Topology(two_sockets(tmp_path)))
    assert row["device"] == "cuda:3" and row["numa_node"] == 1 and row["near_cpus"] == "16-31,48-63"
    assert row["link"] == "pcie-gen5-x16" and row["name"] == "Fake GPU"


# -- where pages sit -----------------------------------------------------------------

@needs_query
def test_page_nodes_sees_touched_and_untouched_pages():
    nodes = Topology().memory_nodes() or (0,)
    buf = np.random.default_rng().integers(0, 255, 64 * numa.PAGE, dtype=np.uint8)
    placed = numa.page_nodes(int(buf.ctypes.data), buf.nbytes)
    assert placed.missing == 0 and placed.sampled == 64 and set(placed.nodes) <= set(nodes)
    import mmap

    mm = mmap.mmap(-1, 16 * numa.PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    import ctypes

    arr = (ctypes.c_ubyte * len(mm)).from_buffer(mm)
    addr = ctypes.addressof(arr)
    assert numa.page_nodes(addr, len(mm)) == PagePlacement({}, 16)  # never touched: not resident
    arr[5 * numa.PAGE] = 1
    placed = numa.page_nodes(addr, len(mm))
    assert placed.missing == 15 and sum(placed.nodes.values()) == 1
    del arr
    mm.close()


def test_page_nodes_samples_evenly_and_says_unknown(monkeypatch):
    asked = []

    def fake(n, pages, status):
        asked.extend(pages[i] for i in range(n))
        for i in range(n):
            status[i] = i % 2
        return 0, 0

    monkeypatch.setattr(numa, "_move_pages", lambda: fake)
    base = 1000 * numa.PAGE
    placed = numa.page_nodes(base + 7, 1000 * numa.PAGE, sample=10)
    assert asked[0] == base and asked[-1] == base + 1000 * numa.PAGE  # first and last page
    assert len(asked) == 10 and placed.nodes == {0: 5, 1: 5}
    monkeypatch.setattr(numa, "_move_pages", lambda: (lambda n, p, s: (-1, 1)))
    assert numa.page_nodes(base, numa.PAGE) is None
    monkeypatch.setattr(numa, "_move_pages", lambda: None)
    assert numa.page_nodes(base, numa.PAGE) is None
    assert numa.page_nodes(base, 0) == PagePlacement()


@needs_query
def test_remote_host_memory_names_tensors_off_the_devices_node(tmp_path, monkeypatch):
    tensors = [torch.randn(4096), torch.randn(64, 1024)]
    nodes = {n for t in tensors for n in numa.tensor_nodes(t).nodes}
    if len(nodes) != 1:
        pytest.skip(f"this machine spread two small tensors over nodes {sorted(nodes)}")
    here = nodes.pop()
    other = here + 1
    cpus = format_cpulist(allowed_cpus())
    monkeypatch.setattr(numa, "SYSFS_ROOT", fake_sysfs(tmp_path, {here: cpus, other: ""}, {
        "0000:17:00.0": (str(here), ""), "0000:c1:00.0": (str(other), ""), "0000:50:00.0": ("-1", "")}))
    assert numa.remote_host_memory(tensors, gpu(bus="0000:17:00.0")) == []
    assert numa.remote_host_memory(tensors, gpu(bus="0000:50:00.0")) == []  # unknown: never "remote"
    remote = numa.remote_host_memory(tensors, gpu(index=1, bus="0000:c1:00.0"))
    assert [r.index for r in remote] == [0, 1]
    assert all(r.device_node == other and r.remote_share == 1.0 for r in remote)
    note = numa.remote_note(remote, gpu(index=1, bus="0000:c1:00.0"), len(tensors))
    assert note.startswith(f"2 of 2 host tensor(s) have pages on NUMA node(s) {here}, while cuda:1 (Fake GPU) "
                           f"is on node {other}")
    assert "kvswap.host_empty(..., device='cuda:1')" in note
    assert numa.remote_note([], gpu(), 2) is None
    assert numa.host_memory_note(tensors, gpu(index=1, bus="0000:c1:00.0")) == note
    assert numa.host_memory_note(tensors, gpu(bus="0000:17:00.0")) is None
    assert numa.tensor_nodes(torch.empty(0)) == PagePlacement()


# -- host_empty ----------------------------------------------------------------------

def _record_touches(monkeypatch):
    seen = []
    real = host_memory._touch

    def touch(addr, nbytes, cpus):
        real(addr, nbytes, cpus)
        seen.append((threading.get_ident(), frozenset(os.sched_getaffinity(0)), addr, nbytes))

    monkeypatch.setattr(host_memory, "_touch", touch)
    return seen


def _check_tensor(t, shape, dtype):
    assert t.shape == shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert not t.any()  # zeroed
    src = torch.randint(-100, 100, shape).to(dtype)
    t.copy_(src)
    assert torch.equal(t, src)


@needs_query
def test_host_empty_touches_its_pages_from_threads_bound_to_the_node(tmp_path, monkeypatch):
    real = Topology()
    # The first real node with CPUs this process may use (on a machine of one node: all of them).
    node, cpus = next(((n, sorted(set(real.node_cpus(n)) & set(allowed_cpus()))) for n in real.memory_nodes()
                       if set(real.node_cpus(n)) & set(allowed_cpus())), (0, allowed_cpus()))
    # The fake node `node` is those CPUs; a second node makes placement matter.
    monkeypatch.setattr(numa, "SYSFS_ROOT", fake_sysfs(tmp_path, {node: format_cpulist(cpus), node + 1: ""},
                                                       {"0000:17:00.0": (str(node), format_cpulist(cpus))}))
    monkeypatch.setattr(host_memory, "TOUCH_THREADS", 3)
    seen = _record_touches(monkeypatch)
    before = os.sched_getaffinity(0)
    shape = (3, 257, 1031)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumaWarning)
        t = kvswap.host_empty(shape, torch.float32, device=gpu(bus="0000:17:00.0"), pin=False)
    _check_tensor(t, shape, torch.float32)
    main = threading.get_ident()
    assert seen and all(tid != main and aff == frozenset(cpus) for tid, aff, _, _ in seen)
    assert len(seen) == min(3, len(cpus))
    # The threads covered the mapping once, page-aligned, with no gap and no overlap.
    spans = sorted((a, a + n) for _, _, a, n in seen)
    assert spans[0][0] == t.data_ptr() and all(a % numa.PAGE == 0 for a, _ in spans)
    assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    assert spans[-1][1] >= t.data_ptr() + t.numel() * 4
    assert os.sched_getaffinity(0) == before  # the caller's thread was never bound
    placed = kvswap.memory.host_memory.host_placement(t)
    assert placed.missing == 0 and placed.nodes == {node: placed.sampled}


def test_host_empty_binds_to_exactly_the_nodes_cpus(tmp_path, monkeypatch):
    cpu = allowed_cpus()[-1]
    monkeypatch.setattr(numa, "SYSFS_ROOT", fake_sysfs(tmp_path, {0: "", 1: str(cpu)},
                                                       {"0000:c1:00.0": ("1", "")}))
    seen = _record_touches(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = kvswap.host_empty(5000, torch.int16, device=gpu(bus="0000:c1:00.0"), pin=False)
    _check_tensor(t, (5000,), torch.int16)
    assert len(seen) == 1 and seen[0][1] == frozenset({cpu})
    if QUERY and Topology().memory_nodes() == (0,):
        # This machine has one node: the pages asked for on node 1 sit on node 0, and it says so.
        assert [str(w.message) for w in caught if issubclass(w.category, NumaWarning)] == [
            "host memory asked for on NUMA node 1 landed partly elsewhere (3 pages sampled: 3 on node 0): "
            "the node may be short of free memory"]


def test_host_empty_skips_placement_and_says_why_once(tmp_path, monkeypatch):
    monkeypatch.setattr(numa, "SYSFS_ROOT", two_sockets(tmp_path))
    seen = _record_touches(monkeypatch)
    dev = gpu(bus="0000:50:00.0")  # numa_node -1 on a machine of two nodes
    with pytest.warns(NumaWarning, match="placed without regard to NUMA: sysfs gives no NUMA node for cuda:0"):
        t = kvswap.host_empty((7, 9), torch.float64, device=dev, pin=False)
    _check_tensor(t, (7, 9), torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_tensor(kvswap.host_empty((7, 9), torch.float64, device=dev, pin=False), (7, 9), torch.float64)
    assert not seen


def test_host_empty_on_a_node_this_process_may_not_run_on(tmp_path, monkeypatch):
    far = max(allowed_cpus()) + 1000
    monkeypatch.setattr(numa, "SYSFS_ROOT", fake_sysfs(tmp_path, {0: "0", 1: str(far)}, {"0000:c1:00.0": ("1", "")}))
    seen = _record_touches(monkeypatch)
    with pytest.warns(NumaWarning, match=f"not placed on NUMA node 1: none of its CPUs \\(\\[{far}\\]\\)"):
        t = kvswap.host_empty(100, torch.uint8, device=gpu(bus="0000:c1:00.0"), pin=False)
    _check_tensor(t, (100,), torch.uint8)
    assert not seen


def test_host_empty_on_one_node_places_nothing_and_says_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(numa, "SYSFS_ROOT", fake_sysfs(tmp_path, {0: "0-1"}, {"0000:17:00.0": ("-1", "")}))
    seen = _record_touches(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumaWarning)
        t = kvswap.host_empty([2, 3, 4], torch.bfloat16, device=gpu(), pin=False)
    _check_tensor(t, (2, 3, 4), torch.bfloat16)
    assert not seen


def test_host_empty_node_argument(tmp_path, monkeypatch):
    cpus = format_cpulist(allowed_cpus())
    monkeypatch.setattr(numa, "SYSFS_ROOT", fake_sysfs(tmp_path, {0: cpus, 1: cpus}, {"0000:17:00.0": ("0", "")}))
    seen = _record_touches(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumaWarning)  # this machine may hold only node 0
        t = kvswap.host_empty(4096, torch.uint8, device=gpu(), node=1, pin=False)
    _check_tensor(t, (4096,), torch.uint8)
    assert seen
    for bad in (2, -1, True, "1"):
        with pytest.raises(ConfigurationError, match="not a NUMA node with memory here; nodes: \\[0, 1\\]"):
            kvswap.host_empty(16, torch.uint8, device=gpu(), node=bad, pin=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without an accelerator")
def test_host_empty_without_an_accelerator_returns_a_correct_pageable_tensor():
    with pytest.warns(NumaWarning) as caught:
        t = kvswap.host_empty((16, 33), torch.float16, device="cuda:0")
    text = [str(w.message) for w in caught]
    assert any("not pinned: torch sees no CUDA or ROCm device" in m for m in text)
    assert any("device 'cuda:0' is not here" in m for m in text)
    _check_tensor(t, (16, 33), torch.float16)
    assert not t.is_pinned()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvswap.host_empty(3, torch.float16, device="cuda:0")  # once per reason


def test_host_empty_refuses_bad_arguments():
    for shape in (-1, (2, -3), 2.5, (True,)):
        with pytest.raises(ConfigurationError, match="shape="):
            kvswap.host_empty(shape, torch.float32, device="cpu", pin=False)
    with pytest.raises(ConfigurationError, match="dtype="):
        kvswap.host_empty(3, np.float32, device="cpu", pin=False)
    with pytest.raises(ConfigurationError, match="device="):
        kvswap.host_empty(3, torch.float32, device="cuda:x", pin=False)


def test_host_empty_zero_elements_and_default_dtype():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumaWarning)
        t = kvswap.host_empty((0, 5), device="cpu", pin=False)
        u = kvswap.host_empty((), torch.int64, device="cpu", pin=False)
    assert t.shape == (0, 5) and t.dtype == torch.get_default_dtype()
    assert u.shape == () and u.item() == 0


def test_host_empty_memory_lives_as_long_as_any_view():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumaWarning)
        t = kvswap.host_empty((64, 1024), torch.int32, device="cpu", pin=False)
    want = torch.randint(-2**31, 2**31 - 1, (64, 1024), dtype=torch.int32)
    t.copy_(want)
    view = t[40:].view(torch.uint8)
    del t
    gc.collect()
    junk = [torch.randint(0, 255, (1 << 16,), dtype=torch.uint8) for _ in range(64)]  # reuse freed memory
    assert torch.equal(view.view(torch.int32), want[40:])
    del junk


def test_host_empty_is_exported():
    assert kvswap.host_empty is host_memory.host_empty and "host_empty" in kvswap.__all__
    assert issubclass(NumaWarning, kvswap.KvSwapWarning)


def test_a_mover_warns_and_explains_host_memory_on_a_remote_node(monkeypatch):
    """BlockMover asks kvswap.memory.numa where its host tensors sit; a remote placement is one
    NumaWarning at construction and a note at the end of explain()."""
    import torch

    import kvswap
    from kvswap.memory import numa

    asked = []

    def note(tensors, device_info, topo=None):
        asked.append((len(tensors), device_info.platform))
        return "2 of 2 host tensor(s) have pages on NUMA node(s) 1"

    monkeypatch.setattr(numa, "host_memory_note", note)
    host = [torch.randn(4, 8, 16) for _ in range(2)]
    dev = [torch.zeros(4, 8, 16) for _ in range(2)]
    with pytest.warns(numa.NumaWarning, match="NUMA node"):
        mover = kvswap.BlockMover(host, dev, "h2d")
    assert asked == [(2, "cpu")]
    assert mover.explain().endswith("\n  note: 2 of 2 host tensor(s) have pages on NUMA node(s) 1")
    mover.close()


def test_a_mover_with_local_host_memory_says_nothing(monkeypatch):
    import warnings

    import torch

    import kvswap
    from kvswap.memory import numa

    monkeypatch.setattr(numa, "host_memory_note", lambda tensors, device_info, topo=None: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", numa.NumaWarning)
        mover = kvswap.BlockMover([torch.randn(4, 8)], [torch.zeros(4, 8)], "d2h")
    assert "NUMA" not in mover.explain()
    mover.close()
