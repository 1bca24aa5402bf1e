"""HiCache's write and load through kvswap's hooks, with SGLang's real classes on a CPU.

kvswap is loaded by SGLang's own ``load_plugins()`` (SGLANG_PLUGINS=kvswap); a
``HiCacheController`` writes device pages to its host pool and loads them back, for MHA and MLA
pools in every layout and io backend SGLang accepts, bf16 and fp16. Pages are out of order on
both sides; every byte is checked, and so is every byte outside the job (poisoned first).
SGLang's own copy ops are not bound on a CPU: a copy that went SGLang's way would raise.

Run in the environment ``.ci/sglang-setup`` makes; skips where SGLang is absent, unless
KVSWAP_REQUIRE_SGLANG=1.
"""
from __future__ import annotations

import pytest

from hicache import CASES, P, bits, build, pages_of, plugin, random_bits, tokens  # noqa: F401

import torch  # noqa: E402  (after hicache: it skips the module where SGLang is absent)

import kvswap.integrations.sglang as kvswap_sglang  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16]
DEVICE_PAGES = [7, 2, 11, 4]  # written from, in this order
HOST_ORDER = [9, 2, 14, 5]  # the host pool hands these out first, in this order


def fill_device(cache, gen):
    for t in cache.device_tensors:
        t.copy_(random_bits(t.shape, t.dtype, t.device, gen))
    return [bits(t) for t in cache.device_tensors]


def check_host(cache, host_pages, device_pages, before):
    """Host page ``host_pages[i]`` holds device page ``device_pages[i]``; the rest is as before."""
    for h, d in zip(host_pages, device_pages):
        assert torch.equal(bits(cache.host_page(h)), bits(cache.in_host_order(cache.device_page(d)))), \
            f"host page {h} does not hold device page {d}"
    outside = ~cache.host_mask(host_pages)
    assert torch.equal(bits(cache.host.kv_buffer)[outside], before[outside]), "host bytes outside the job changed"


def check_device(cache, device_pages, expected_pages, before):
    """Device page ``device_pages[i]`` holds ``expected_pages[i]``; every other row is as before."""
    for d, want in zip(device_pages, expected_pages):
        assert torch.equal(bits(cache.device_page(d)), bits(want)), f"device page {d} is wrong"
    rows = torch.ones(cache.device_tensors[0].shape[0], dtype=torch.bool)
    for d in device_pages:
        rows[d * P:(d + 1) * P] = False
    for t, b in zip(cache.device_tensors, before):
        assert torch.equal(bits(t)[rows], b[rows]), "device rows outside the job changed"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind,layout,io", CASES)
def test_write_then_load_round_trip(plugin, kind, layout, io, dtype):  # noqa: F811
    gen = torch.Generator().manual_seed(hash((kind, layout, io, str(dtype))) & 0xFFFF)
    cache = build(kind, layout, io, dtype)
    ctl, host = cache.controller, cache.host
    fill_device(cache, gen)
    host.kv_buffer.copy_(random_bits(host.kv_buffer.shape, dtype, "cpu", gen))
    host_before = bits(host.kv_buffer)
    cache.host_pages_in_order(HOST_ORDER)

    # Write: device pages out of order -> the host pages the pool hands out (out of order too).
    written = {d: cache.device_page(d) for d in DEVICE_PAGES}
    host_indices = ctl.write(tokens(DEVICE_PAGES))
    ctl.ack_write_queue[-1].finish_event.synchronize()
    assert pages_of(host_indices) == HOST_ORDER
    check_host(cache, HOST_ORDER, DEVICE_PAGES, host_before)

    # Load: host pages in another order -> the device pages the allocator hands out.
    device_before = fill_device(cache, gen)
    load_order = [HOST_ORDER[i] for i in (2, 0, 3, 1)]
    device_indices = ctl.load(tokens(load_order))
    ctl.start_loading()
    ctl.ack_load_queue[-1].finish_event.synchronize()
    source = {h: written[d] for h, d in zip(HOST_ORDER, DEVICE_PAGES)}
    check_device(cache, pages_of(device_indices), [source[h] for h in load_order], device_before)
    assert bits(host.kv_buffer).equal(bits(host.kv_buffer)), "the host buffer is readable after the load"

    text = kvswap_sglang.explain(host)
    assert f"layout {layout}" in text and "loads, layer by layer" in text and "backups, all layers" in text
    assert "host.reference" in text  # the route a CPU resolves


@pytest.mark.parametrize("kind,layout,io", [c for c in CASES if c[2] == "kernel"])
def test_one_layer_loads_that_layer_only(plugin, kind, layout, io):  # noqa: F811
    # As SGLang's transfer engine calls it: one layer, inside a load of several.
    cache = build(kind, layout, io, torch.float16)
    host = cache.host
    gen = torch.Generator().manual_seed(5)
    host.kv_buffer.copy_(random_bits(host.kv_buffer.shape, torch.float16, "cpu", gen))
    before = fill_device(cache, gen)
    layer = 1
    host.load_to_device_per_layer_physical(cache.device_pool, tokens([3, 12]), tokens([6, 1]), layer, io)
    for h, d in ((3, 6), (12, 1)):
        got = cache.in_host_order(cache.device_page(d))
        want = cache.host_page(h)
        picked = {"mha": {"layer_first": lambda t: t[:, layer], "page_first": lambda t: t[:, :, layer],
                          "page_head": lambda t: t[..., layer, :]},
                  "mla": {"layer_first": lambda t: t[layer], "page_first": lambda t: t[:, layer]}}[kind][layout]
        assert torch.equal(bits(picked(got)), bits(picked(want))), f"layer {layer} of host page {h}"
    per_layer = len(cache.device_tensors) // (2 if kind == "mha" else 1)
    for i, (t, b) in enumerate(zip(cache.device_tensors, before)):
        if i % per_layer != layer:
            assert torch.equal(bits(t), b), f"device tensor {i} (not layer {layer}) changed"
