"""``kvswap.host_empty`` on every GPU of the machine: pinned, mapped, placed on the GPU's
node where sysfs names one, and copied through every route of a BlockMover byte for byte."""
from __future__ import annotations

import gc
import warnings

import numpy as np
import pytest
import torch

import kvswap
from kvswap import BlockMover, NumaWarning, Policy
from kvswap.memory import numa

pytestmark = pytest.mark.gpu

DEVICES = list(range(torch.cuda.device_count())) or [0]
ROUTES = [None, "triton.kernel", "cuda.batch"]


def _host(shape, index, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumaWarning)  # a machine of one node has nothing to place
        return kvswap.host_empty(shape, torch.uint8, device=f"cuda:{index}", **kw)


@pytest.mark.parametrize("index", DEVICES)
def test_pinned_mapped_and_on_the_devices_node(index):
    t = _host((8, 1 << 20), index)
    assert t.is_pinned() and not t.any()
    dev = kvswap.registry.platform.detect(kvswap.registry.plugins.plugin_host(), f"cuda:{index}")
    node, why = numa.topology().placement_target(dev)
    placed = numa.tensor_nodes(t)
    print(f"cuda:{index} {dev.pci_bus_id}: node {node} ({why or 'placed'}); pages {placed and placed.describe()}")
    if node is not None and placed is not None:
        assert placed.missing == 0 and placed.off(node) == {}
        assert numa.remote_host_memory([t], dev) == []


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r or "default")
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("index", DEVICES)
def test_block_mover_copies_host_empty_memory(index, direction, route):
    rng = np.random.default_rng(index * 10 + len(direction) + len(route or ""))
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
    blocks, block = 64, 16 * 1024
    host = _host((blocks, block), index)
    host.copy_(torch.randint(0, 256, (blocks, block), dtype=torch.uint8, generator=gen))
    dev = torch.randint(0, 256, (blocks, block), dtype=torch.uint8, generator=gen).to(f"cuda:{index}")
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    src_before, dst_before = src.cpu().clone(), dst.cpu().clone()
    sid = rng.choice(blocks, 40, replace=False)
    did = rng.choice(blocks, 40, replace=False)
    policy = Policy(force=route) if route else None
    with BlockMover([src], [dst], direction, policy=policy) as mover:
        mover.submit(sid, did)
        mover.wait()
        (result,) = mover.poll()
    assert result.ok, result
    want = dst_before.clone()
    want[torch.as_tensor(did)] = src_before[torch.as_tensor(sid)]
    assert torch.equal(dst.cpu(), want)  # every byte: copied blocks and the untouched rest
    assert torch.equal(src.cpu(), src_before)


@pytest.mark.parametrize("index", DEVICES)
def test_freed_memory_is_unpinned_and_can_be_allocated_again(index):
    for _ in range(16):
        t = _host(64 << 20, index)
        t[::4096] = 7
        assert t.is_pinned()
        del t
        gc.collect()
    torch.cuda.synchronize(index)


def test_the_wrong_node_lands_where_asked():
    nodes = numa.topology().memory_nodes()
    if len(nodes) < 2:
        pytest.skip("one NUMA node with memory: no wrong node")
    dev = kvswap.registry.platform.detect(kvswap.registry.plugins.plugin_host(), "cuda:0")
    right, _ = numa.topology().placement_target(dev)
    if right is None:
        pytest.skip("sysfs gives no node for cuda:0")
    wrong = next((n for n in nodes if n != right and numa.topology().node_cpus(n)), None)
    if wrong is None:
        pytest.skip(f"no other node with CPUs than cuda:0's node {right}")
    t = _host(32 << 20, 0, node=wrong)
    placed = numa.tensor_nodes(t)
    assert placed is not None and set(placed.nodes) == {wrong}
    remote = numa.remote_host_memory([t], dev)
    assert [r.index for r in remote] == [0] and remote[0].remote_share == 1.0


def test_bench_devices_runs_every_gpu_at_once():
    """``kvswap bench --devices`` on every GPU here, small: each route checked byte for
    byte in each process, every window timed, alone and together."""
    from dataclasses import replace

    from kvswap.calibration import multi

    specs = [f"cuda:{i}" for i in DEVICES]
    settings = replace(multi.multi_settings(False, [4096, 64 * 1024], [256], 1, 0.05),
                       pool_bytes=256 << 20, ceiling_bytes=64 << 20, cycle_bytes=32 << 20)
    result = multi.run_multi(specs, settings, ["h2d", "d2h"])
    print(multi.multi_report(result))
    assert result["failures"] == []
    assert [(r["direction"], r["block_bytes"], r["route"]) for r in result["rows"]] == [
        (d, b, route) for d in ("h2d", "d2h") for b in (4096, 64 * 1024) for route in ("resolved", "batch")]
    for r in result["rows"]:
        assert all(v > 0 for v in [*r["alone"].values(), *r["together"].values()]), r
        assert r["over_ceilings"] is not None and r["over_shared_ceiling"] is not None
    wrong = [d for d in result["devices"] if d["wrong_node"] is not None]
    assert len({r["device"] for r in result["numa"]}) == len(wrong)
