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

from hicache import CASES, DTYPES, bits, dtype_id, build, fill_device, plugin, random_bits, round_trip, tokens  # noqa: F401

import torch  # noqa: E402  (after hicache: it skips the module where SGLang is absent)

import kvswap.integrations.sglang as kvswap_sglang  # noqa: E402

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind,layout,io", CASES)
def test_write_then_load_round_trip(plugin, kind, layout, io, dtype):  # noqa: F811
    cache = round_trip(kind, layout, io, dtype)
    host = cache.host
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
