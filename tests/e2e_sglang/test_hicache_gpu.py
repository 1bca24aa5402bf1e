"""kvswap's SGLang hooks on a GPU: HiCache's round trips with pinned host pools (every case of
test_hicache_roundtrip.py), and the order SGLang's events rely on: a layer's load and a backup
start after the work queued before them on the stream current at the call, and an event recorded
on that stream after the call completes only once their bytes are in place, also when the call
comes on another stream than the one the movers were built on.

Needs SGLang: on a GPU machine without an index, tests/bench/sglang_carry.sh and
tests/bench/sglang_env.sh provide it. ``pytest -m gpu tests/e2e_sglang``.
"""
from __future__ import annotations

import pytest

from hicache import CASES, DTYPES, P, bits, build, destroy_pinned, dtype_id, plugin, random_bits, round_trip, tokens  # noqa: F401

import torch  # noqa: E402

import kvswap.integrations.sglang as kvswap_sglang  # noqa: E402

pytestmark = pytest.mark.gpu
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time queued before the copy


@pytest.fixture(autouse=True)
def without_sglangs_own_kernels(monkeypatch):
    """SGLang's host pools build its JIT copy kernels (nvcc, minutes) where it could use them;
    the hooks copy instead, so the pools are built without them. After the test, the pinned host
    pools it built are unregistered."""
    from sglang.srt.mem_cache.pool_host import mha, mla

    for module in (mha, mla):
        for name in ("can_use_hicache_jit_kernel", "can_use_write_back_jit_kernel"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda **kw: False)
    yield
    destroy_pinned()


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind,layout,io", CASES)
def test_round_trip_with_pinned_host_pools(plugin, kind, layout, io, dtype):  # noqa: F811
    cache = round_trip(kind, layout, io, dtype, device="cuda", pin=True)
    assert cache.host.kv_buffer.is_pinned()
    text = kvswap_sglang.explain(cache.host)
    assert "pageable" not in text and "host.reference" not in text


def big(kind: str, layout: str):
    """Pages of 64 tokens, 8 heads of 128 (llama-3.1-8b at TP 1): a copy that takes a while."""
    cache = build(kind, layout, "kernel", torch.bfloat16, device="cuda", pin=True, page_size=64,
                  device_tokens=64 * 256, heads=8, head_dim=128, lora=512, rope=64)
    gen = torch.Generator().manual_seed(7)
    cache.host.kv_buffer.copy_(random_bits(cache.host.kv_buffer.shape, torch.bfloat16, "cpu", gen))
    for t in cache.device_tensors:
        t.copy_(random_bits(t.shape, t.dtype, t.device, gen))
    return cache


@pytest.mark.parametrize("other_stream", [False, True], ids=["built-on-stream", "other-stream"])
@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mla", "layer_first")])
def test_a_layer_load_is_ordered_on_the_current_stream(plugin, kind, layout, other_stream):  # noqa: F811
    cache = big(kind, layout)
    host, dev, page = cache.host, cache.device_pool, cache.host.page_size
    pages = list(range(1, 250))
    host_pages = [p + 3 for p in pages][::-1]
    # Indices on the host, as SGLang's direct io passes them: nothing here synchronises with the
    # stream (indices on the GPU are read once per transfer, which would wait for the stream).
    h, d = tokens(host_pages, page), tokens(pages, page)
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(first):  # builds the movers on this stream
        host.load_to_device_per_layer_physical(dev, h, d, 0, "direct")
    torch.cuda.synchronize()
    layer = 1
    targets = [t for i, t in enumerate(cache.device_tensors) if i % cache.host.layer_num == layer]
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(second if other_stream else first):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in targets:  # queued before the load: the load must land after it
            t.zero_()
        host.load_to_device_per_layer_physical(dev, h, d, layer, "direct")
        done = torch.cuda.Event()
        done.record()  # what SGLang's on_layer_done records
    consumer.wait_event(done)  # what the forward pass does before it reads the layer
    with torch.cuda.stream(consumer):
        seen = [t.clone() for t in targets]
    torch.cuda.synchronize()
    for t, s in zip(targets, seen):
        assert torch.equal(bits(s), bits(t)), "the layer's event completed before its load"
    pick = {"mha": lambda x: x[:, :, layer], "mla": lambda x: x[layer]}[kind]  # [2, P, L, H, D]; [L, P, 1, D']
    for hp, dp in zip(host_pages, pages):
        want, got = cache.in_host_order(cache.device_page(dp)), cache.host_page(hp)
        assert torch.equal(bits(pick(want)), bits(pick(got))), f"device page {dp}: zeros, or another page"


@pytest.mark.parametrize("kind,layout", [("mha", "page_first_direct"), ("mla", "page_first")])
def test_a_backup_reads_what_was_queued_before_it_and_ends_before_the_next_event(plugin, kind, layout):  # noqa: F811
    cache = big(kind, layout)
    host, dev, page = cache.host, cache.device_pool, cache.host.page_size
    pages = list(range(1, 250))
    host_pages = [p + 5 for p in pages]
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        for t in cache.device_tensors:  # new KV written just before the backup
            t.add_(1)
        host.backup_from_device_all_layer_physical(dev, tokens(host_pages, page), tokens(pages, page), "direct")
        done = torch.cuda.Event()
        done.record()  # SGLang's finish event
    done.synchronize()
    for hp, dp in zip(host_pages, pages):
        assert torch.equal(bits(cache.host_page(hp)), bits(cache.in_host_order(cache.device_page(dp)))), \
            f"host page {hp}: the backup ran before the writes queued ahead of it, or ended after its event"
