"""A storage tier beneath kvswap: HiCache's ``file`` backend moves pages between the host pool
and files while kvswap moves them between the host pool and the device.

device -> host (kvswap) -> file (SGLang's backup thread) -> host cleared -> file -> host
(SGLang's prefetch threads) -> device (kvswap): every byte checked at the end. The controller's
storage threads run as in a server; the test does the radix cache's part (hashing the pages,
taking the prefetch hit, giving it host pages). Runs where SGLang is installed.
"""
from __future__ import annotations

import pytest

from hicache import P, bits, build, pages_of, plugin, random_bits, tokens  # noqa: F401

import torch  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

TIMEOUT = 30.0


def prefetched_tokens(ctl) -> int:
    """The tokens a prefetch brought to the host, from its acks up to the last one."""
    done = 0
    while True:
        ack = ctl.ack_prefetch_queue.get(timeout=TIMEOUT)
        if ack.completed_req:
            return done
        done = max(done, ack.completed_tokens or 0)


@pytest.mark.parametrize("kind,layout,io", [("mha", "page_first", "kernel"), ("mla", "page_first_direct", "direct")])
def test_device_host_file_host_device_round_trip(plugin, monkeypatch, tmp_path, kind, layout, io):  # noqa: F811
    monkeypatch.setenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", str(tmp_path))
    cache = build(kind, layout, io, torch.bfloat16, storage="file")
    ctl, host = cache.controller, cache.host
    try:
        gen = torch.Generator().manual_seed(3)
        for t in cache.device_tensors:
            t.copy_(random_bits(t.shape, t.dtype, "cpu", gen))
        device_pages = [5, 1, 9]
        written = [cache.device_page(p) for p in device_pages]

        host_indices = ctl.write(tokens(device_pages))  # device -> host: kvswap
        ctl.ack_write_queue[-1].finish_event.synchronize()

        token_ids = torch.randint(0, 32000, (len(device_pages) * P,), generator=gen).tolist()
        hashes = get_storage_hash_str(token_ids, None, page_size=P)
        ctl.write_storage(host_indices, token_ids, hash_value=hashes)  # host -> files: SGLang's backup thread
        assert ctl.ack_backup_queue.get(timeout=TIMEOUT).completed_tokens == len(token_ids)
        assert sum(1 for f in tmp_path.rglob("*") if f.is_file()) >= len(device_pages)

        host.free(host_indices)  # the host tier loses the pages
        host.kv_buffer.copy_(random_bits(host.kv_buffer.shape, torch.bfloat16, "cpu", gen))

        op = ctl.prefetch("request-1", token_ids)  # files -> host: SGLang's prefetch threads
        hit = ctl.prefetch_hit_queue.get(timeout=TIMEOUT)
        assert hit is op and hit.storage_hit_count == len(token_ids)
        hit.host_indices = host.alloc(len(token_ids))
        ctl.prefetch_buffer.put(hit)
        assert prefetched_tokens(ctl) == len(token_ids)

        for t in cache.device_tensors:  # the device tier loses them too
            t.copy_(random_bits(t.shape, t.dtype, "cpu", gen))
        device_indices = ctl.load(hit.host_indices)  # host -> device: kvswap
        ctl.start_loading()
        ctl.ack_load_queue[-1].finish_event.synchronize()
        for page, want in zip(pages_of(device_indices), written):
            assert torch.equal(bits(cache.device_page(page)), bits(want)), f"device page {page} is wrong"
    finally:
        ctl.detach_storage_backend()
