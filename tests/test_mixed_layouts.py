"""Two sides that hold the same blocks in different layouts: a per-layer device cache
(FlashAttention's K and V planes apart) against a block-major host cache (a block's bytes
for every layer side by side), and :func:`kvswap.host_cache`, which allocates the latter.

Every route gets the pieces cut to the granularity the two sides share: the host
reference, the Triton kernel on descriptors and the Triton kernel deriving addresses from
ids (both in Triton's CPU interpreter). Checks cover whole allocations, guard bytes
included, on random data.
"""
from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import kvswap
from kvswap import BlockLayoutError, BlockMover, CopyImpl, Direction, Policy, hookimpl
from kvswap.memory.block_major import block_major_layout
from kvswap.registry.plugins import create_plugin_host, reset_plugin_host
from mover_layouts import INT_OF, Pool, expected_after, layouts

LAYOUTS = layouts()
PAIRS = [("flash", "cross_views"), ("cross_views", "flash")]


def _layout(name: str, dtype: torch.dtype):
    return dataclasses.replace(LAYOUTS[name], dtype=dtype)


def _install_kernel(by_ids: bool) -> None:
    """Route every copy through the Triton kernel (interpreted), by descriptors or by ids."""
    from kvswap.backends.triton_generic.by_ids import KernelCopyByIds

    kernel = KernelCopyByIds(num_sms=3, device_index=None)

    class Transfer:
        def __call__(self, src, dst, sizes, stream):
            return kernel(src, dst, sizes, stream)

        def by_ids(self, template):
            return kernel.by_ids(template) if by_ids else None

    class Plugin:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            if platform == "cpu":
                register(CopyImpl(name="test.kernel", kind="kernel", platforms=("cpu",),
                                  directions=(Direction.H2D, Direction.D2H), factory=lambda ctx: Transfer(),
                                  by_ids=True))

    reset_plugin_host(create_plugin_host(entry_points=[], env={}, extra=[("testplugin", Plugin())]))


def _route(route: str) -> dict:
    if route == "reference":
        return {}
    pytest.importorskip("triton")
    from kvswap.backends.triton_generic.launch import interpreting

    if not interpreting():
        pytest.skip("runs the kernel in Triton's CPU interpreter")
    _install_kernel(by_ids=route == "kernel-ids")
    return {"policy": Policy(force="test.kernel"), "device_descriptors": route == "kernel-ids"}


@pytest.mark.parametrize("route", ["reference", "kernel-descriptors", "kernel-ids"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("src_name, dst_name", PAIRS)
def test_per_layer_and_block_major_sides_pair_every_element(src_name, dst_name, direction, dtype, route):
    kw = _route(route)
    gen, rng = torch.Generator().manual_seed(3), np.random.default_rng(4)
    src, dst = Pool(_layout(src_name, dtype), 40, gen), Pool(_layout(dst_name, dtype), 56, gen)
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = []
    with BlockMover(src.tensors, dst.tensors, direction, block_dim=1, **kw) as mover:
        assert mover.chunks_per_block == 2 * 3  # K and V of 3 layers: the device side's chunks
        for n in (1, 7, 23, 0, 12):
            sid = rng.choice(40, n, replace=False).astype(np.int64)
            did = rng.choice(56, n, replace=False).astype(np.int64)
            mover.submit(sid, did)
            jobs.append((sid, did))
        results = mover.poll()
    assert all(r.ok for r in results)
    assert [r.bytes for r in results] == [n * mover.block_bytes for n in (1, 7, 23, 0, 12)]
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


def test_flash_and_flashinfer_blocks_pair_by_element():
    """K and V planes apart on one side, a block's K and V adjacent on the other."""
    gen = torch.Generator().manual_seed(5)
    flash = [torch.randn(2, 9, 4, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(2)]
    infer = [torch.randn(12, 2, 4, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(2)]
    before = [t.clone() for t in infer]
    with BlockMover(flash, infer, "h2d", block_dim=(1, 0)) as mover:
        mover.submit([8, 0, 3], [11, 2, 5])
    for f, i, b in zip(flash, infer, before):
        b[[11, 2, 5]] = f[:, [8, 0, 3]].transpose(0, 1)
        assert torch.equal(i, b)


def test_a_byte_pool_pairs_with_any_chunking_of_the_same_bytes():
    """A raw pool on one side takes the other side's chunks in order, whatever their size."""
    gen = torch.Generator().manual_seed(6)
    flash = torch.randint(-9, 9, (2, 8, 4, 2, 16), generator=gen).to(torch.float16)
    pool = torch.randint(0, 256, (5, 2 * 4 * 2 * 16 * 2), dtype=torch.uint8, generator=gen)
    before = pool.clone()
    with BlockMover([flash], [pool], "d2h", block_dim=(1, 0)) as mover:
        assert mover.chunks_per_block == 2
        mover.submit([6, 1], [4, 0])
    before[4] = flash[:, 6].contiguous().view(torch.uint8).reshape(-1)
    before[0] = flash[:, 1].contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(pool, before)


def test_elements_stored_in_other_orders_are_still_refused():
    flash = torch.empty(2, 8, 4, 2, 16, dtype=torch.bfloat16)
    swapped = torch.empty(2, 8, 2, 4, 16, dtype=torch.bfloat16).transpose(2, 3)  # heads outside tokens
    with pytest.raises(BlockLayoutError, match="different orders .* runs of 32 bytes"):
        BlockMover([flash], [swapped], "h2d", block_dim=1)


# -- kvswap.host_cache --------------------------------------------------------------------
def _device_side(gen: torch.Generator) -> tuple[list[torch.Tensor], list[int]]:
    """FlashAttention (bf16), FlashInfer (fp16), MLA (bf16) and an HND view (fp16), mixed."""
    flash = torch.randn(2, 12, 4, 2, 16, generator=gen).to(torch.bfloat16)
    infer = torch.randn(12, 2, 4, 2, 16, generator=gen).to(torch.float16)
    mla = torch.randn(12, 4, 72, generator=gen).to(torch.bfloat16)
    hnd = torch.randn(12, 2, 2, 4, 16, generator=gen).to(torch.float16).transpose(2, 3)  # (n, 2, tok, heads, d)
    return [flash, infer, mla, hnd], [1, 0, 0, 0]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(INT_OF[a.element_size()]), b.view(INT_OF[b.element_size()]))


def _block_bytes(t: torch.Tensor, b: int, i: int) -> torch.Tensor:
    """Block ``i`` of ``t`` as bytes, in ``t``'s own element order (its memory order)."""
    block = t.select(b, i)
    order = sorted(range(block.dim()), key=lambda d: -block.stride(d))
    return block.permute(*order).contiguous().view(torch.uint8).reshape(-1)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_host_cache_is_block_major_and_a_mover_fills_it_element_by_element(direction):
    gen, rng = torch.Generator().manual_seed(7), np.random.default_rng(8)
    device, dims = _device_side(gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kvswap.NumaWarning)  # no accelerator here: nothing to place or pin
        cache = kvswap.host_cache(device, 20, block_dim=dims)
    assert cache.buffer.dtype == torch.uint8 and cache.buffer.is_contiguous()
    assert cache.num_blocks == 20 and cache.block_bytes == sum(_block_bytes(t, b, 0).numel() for t, b in zip(device, dims))
    assert [v.dtype for v in cache.views] == [t.dtype for t in device]
    for v, t, b in zip(cache.views, device, dims):
        assert v.shape[b] == 20 and [n for k, n in enumerate(v.shape) if k != b] == [n for k, n in enumerate(t.shape) if k != b]
    cache.buffer.copy_(torch.randint(0, 256, cache.buffer.shape, dtype=torch.uint8, generator=gen))
    src, dst = (device, list(cache.views)) if direction == "d2h" else (list(cache.views), device)
    sid = rng.choice(12 if direction == "d2h" else 20, 9, replace=False)
    did = rng.choice(20 if direction == "d2h" else 12, 9, replace=False)
    host_before, dev_before = cache.buffer.clone(), [t.clone() for t in device]
    with BlockMover(src, dst, direction, block_dim=dims) as mover:
        assert mover.chunks_per_block == 2 + 1 + 1 + 1  # the device side's chunks, no finer
        mover.submit(sid, did)
    if direction == "d2h":
        for i, j in zip(sid, did):  # host block j: device block i of every tensor, in order
            host_before[j] = torch.cat([_block_bytes(t, b, int(i)) for t, b in zip(device, dims)])
        assert torch.equal(cache.buffer, host_before)
        assert all(torch.equal(t, b) for t, b in zip(device, dev_before))
    else:
        for t, b, v in zip(dev_before, dims, cache.views):
            t.index_copy_(b, torch.as_tensor(did), v.index_select(b, torch.as_tensor(sid)))
        assert all(_same_bytes(t, b) for t, b in zip(device, dev_before))  # random bytes hold NaNs
        assert torch.equal(cache.buffer, host_before)


def test_host_cache_places_and_pins_through_host_empty(monkeypatch):
    import kvswap.memory.block_major as module

    calls = []

    def fake(shape, dtype, *, device, pin, node):
        calls.append((tuple(shape), dtype, device, pin, node))
        return torch.empty(shape, dtype=dtype)

    monkeypatch.setattr(module, "host_empty", fake)
    t = torch.empty(2, 5, 4, 2, 16, dtype=torch.bfloat16)
    module.host_cache([t, t], 3, block_dim=1, pin=False, node=1)
    assert calls == [((3, 2 * 2 * 4 * 2 * 16 * 2), torch.uint8, t.device, False, 1)]


@pytest.mark.parametrize("args, kw, error, message", [
    (([], 4), {}, BlockLayoutError, "device_tensors is empty"),
    (([np.zeros(4)], 4), {}, BlockLayoutError, "not a torch.Tensor"),
    (([torch.empty(4, 8)], 0), {}, kvswap.ConfigurationError, "num_blocks=0 must be an int >= 1"),
    (([torch.empty(4, 8)], 2.0), {}, kvswap.ConfigurationError, "num_blocks=2.0"),
    (([torch.empty(4, 8)], 2), {"block_dim": 2}, BlockLayoutError, "block_dim=2 is out of range"),
    (([torch.empty(4, 8)] * 2, 2), {"block_dim": [0]}, BlockLayoutError, "one per tensor"),
    (([torch.empty(0, 8)], 2), {}, BlockLayoutError, "empty blocks"),
])
def test_host_cache_refuses_bad_input(args, kw, error, message):
    with pytest.raises(error, match=message):
        kvswap.host_cache(*args, **kw)


def test_block_major_layout_gives_host_caches_views_over_any_buffer():
    gen = torch.Generator().manual_seed(9)
    device, dims = _device_side(gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kvswap.NumaWarning)
        cache = kvswap.host_cache(device, 7, block_dim=dims)
    layout = block_major_layout(device, block_dim=dims)
    assert (layout.block_bytes, layout.offsets) == (cache.block_bytes, cache.offsets)
    mine = torch.randint(0, 256, (7, layout.block_bytes), dtype=torch.uint8, generator=gen)
    cache.buffer.copy_(mine)
    other = layout.over(mine)
    assert other.buffer is mine and other.offsets == cache.offsets
    for a, b in zip(other.views, cache.views):
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()) and _same_bytes(a, b)
    with pytest.raises(BlockLayoutError, match=rf"contiguous torch.uint8 tensor of shape \(num_blocks, {layout.block_bytes}\)"):
        layout.over(mine[:, :-1])
    with pytest.raises(BlockLayoutError, match="device_tensors is empty"):
        block_major_layout([])
