"""``triton.staged`` on a GPU: per-layer device KV against a block-major pinned host cache
(kvswap.host_cache), chosen by a BlockMover's default, and raw descriptors through a forced
SwapFn. Budgets of a few blocks force slices through both halves of the staging buffer, and
jobs queue behind a spin so that many are in flight at once. Every byte of both sides is
checked against a reference on random data.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kvswap
from kvswap import BlockMover, Policy

pytestmark = pytest.mark.gpu

SPIN = 1_000_000_000  # GPU clock cycles torch.cuda._sleep spins: ~0.5-1 s
LAYERS, BS, HEADS, DIM = 6, 16, 4, 128  # 16 KiB K or V chunks (bf16); 192 KiB a block


def _device(dtype: torch.dtype, blocks: int, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(-2**15, 2**15 - 1, (2, blocks, BS, HEADS, DIM), dtype=torch.int16, generator=gen)
            .view(dtype).to("cuda") for _ in range(LAYERS)]


def _as_int(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _cache(device: list[torch.Tensor], blocks: int, gen: torch.Generator) -> kvswap.HostCache:
    cache = kvswap.host_cache(device, blocks, block_dim=1)
    assert cache.buffer.is_pinned()
    cache.buffer.copy_(torch.randint(0, 256, cache.buffer.shape, dtype=torch.uint8, generator=gen))
    return cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_default_mover_stages_a_block_major_host_cache(direction, dtype):
    gen, rng = torch.Generator().manual_seed(1), np.random.default_rng(2)
    device = _device(dtype, 96, gen)
    cache = _cache(device, 128, gen)
    block = cache.block_bytes
    src, dst = (device, list(cache.views)) if direction == "d2h" else (list(cache.views), device)
    host_before, dev_before = cache.buffer.clone(), [_as_int(t).cpu() for t in device]
    jobs = []
    with BlockMover(src, dst, direction, block_dim=1, policy=Policy(staging_bytes=8 * block)) as mover:
        assert "staged: triton.staged moves each block as 1 host run" in mover.explain()
        with torch.cuda.stream(mover.stream):
            torch.cuda._sleep(SPIN)                       # every job below is queued at once
        for n in (1, 5, 4, 17, 40, 3):
            sid = rng.choice(96 if direction == "d2h" else 128, n, replace=False)
            did = rng.choice(128 if direction == "d2h" else 96, n, replace=False)
            mover.submit(sid, did)
            jobs.append((sid, did))
        mover.wait()
        results = mover.poll()
    assert all(r.ok for r in results) and [r.bytes for r in results] == [len(s) * block for s, _ in jobs]
    if direction == "d2h":
        for sid, did in jobs:
            for i, j in zip(sid, did):
                host_before[j] = torch.cat([_as_int(t[:, i]).cpu().contiguous().view(torch.uint8).reshape(-1)
                                            for t in device])
        assert torch.equal(cache.buffer, host_before)
        assert all(torch.equal(_as_int(t).cpu(), b) for t, b in zip(device, dev_before))
    else:
        for sid, did in jobs:
            for t, v in zip(dev_before, cache.views):
                t[:, did] = _as_int(v[:, sid])
        assert all(torch.equal(_as_int(t).cpu(), b) for t, b in zip(device, dev_before))
        assert torch.equal(cache.buffer, host_before)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_staged_waits_for_the_compute_stream_and_none_waits_for_nothing(direction):
    """Default ``after``: the compute stream's rewrite of the device blocks, queued behind
    a spin, is what the copy sees (d2h) or lands after (h2d)."""
    gen, rng = torch.Generator().manual_seed(3), np.random.default_rng(4)
    device = _device(torch.bfloat16, 64, gen)
    cache = _cache(device, 64, gen)
    src, dst = (device, list(cache.views)) if direction == "d2h" else (list(cache.views), device)
    mover = BlockMover(src, dst, direction, block_dim=1, policy=Policy(staging_bytes=4 * cache.block_bytes))
    assert "staged:" in mover.explain()
    sid, did = rng.choice(64, 24, replace=False), rng.choice(64, 24, replace=False)
    fresh = [_as_int(t).clone().random_(-2**15, 2**15 - 1) for t in device]
    host_before = cache.buffer.clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN)
    for t, f in zip(device, fresh):
        _as_int(t).copy_(f)                               # queued behind the spin
    mover.wait(mover.submit(sid, did))
    if direction == "d2h":
        for i, j in zip(sid, did):
            host_before[j] = torch.cat([f[:, i].cpu().contiguous().view(torch.uint8).reshape(-1) for f in fresh])
        assert torch.equal(cache.buffer, host_before)
    else:
        for t, f, v in zip(device, fresh, cache.views):
            f[:, did] = _as_int(v[:, sid]).cuda()
            assert torch.equal(_as_int(t), f)
    mover.close()


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_forced_staged_swapfn_copies_raw_descriptors(direction):
    rng = np.random.default_rng(5)
    host = torch.randint(0, 256, (1 << 26,), dtype=torch.uint8).pin_memory()
    dev = torch.randint(0, 256, (1 << 26,), dtype=torch.uint8, device="cuda")
    n = 3000
    sizes = rng.integers(1, 8192, n)
    sizes[:4] = 3 << 20                                   # above half the budget: cut to fit
    slots = np.cumsum(np.concatenate(([0], sizes[:-1])))  # adjacent on the host side: merged
    scattered = rng.permutation(np.arange(n)) * 8192      # one 8 KiB cell each on the device side
    scattered[:4] = n * 8192 + np.arange(4) * (3 << 20)   # the long ones past the cells
    swap = kvswap.resolve(direction, device="cuda", policy=Policy(force="triton.staged", staging_bytes=4 << 20))
    if direction == "d2h":
        src, dst = dev.data_ptr() + scattered, host.data_ptr() + slots
        want = host.clone()
        dev_cpu = dev.cpu()
        for a, b, z in zip(scattered, slots, sizes):
            want[b:b + z] = dev_cpu[a:a + z]
        swap(src, dst, sizes, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        assert torch.equal(host, want)
    else:
        src, dst = host.data_ptr() + slots, dev.data_ptr() + scattered
        want = dev.cpu()
        for a, b, z in zip(slots, scattered, sizes):
            want[b:b + z] = host[a:a + z]
        swap(src, dst, sizes, stream=torch.cuda.current_stream())
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), want)


def test_a_per_layer_host_cache_keeps_the_resolved_route_and_says_why():
    gen = torch.Generator().manual_seed(6)
    device = _device(torch.bfloat16, 16, gen)
    host = [torch.empty(2, 32, BS, HEADS, DIM, dtype=torch.bfloat16).pin_memory() for _ in range(LAYERS)]
    with BlockMover(device, host, "d2h", block_dim=1) as mover:
        assert "staged route not used: the host side holds a block as 12 run(s) of 16384+ bytes" in mover.explain()
        assert "triton.staged" not in mover.swap_fn.impls
