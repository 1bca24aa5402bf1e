"""BlockMover over blocks of different sizes on the two sides (a block-size factor) and
over layouts that mix in one mover (``block_dim`` per tensor), on the host reference.

Random data, poisoned destinations: every byte of every allocation is compared with a
reference copied by torch indexing, padding and guard bytes included.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import kvswap
from kvswap import BlockMover
from kvswap.errors import BlockIdError, BlockLayoutError
from kvswap.addressing.regions import block_dims
from mover_shapes import KINDS, Side, expected_after

MIXED = [KINDS["flash"], KINDS["mla"], KINDS["flashinfer"]]
TOKENS = 4


def _run(src: Side, dst: Side, direction: str, block_dim, rng: np.random.Generator, sizes=(1, 7, 0, 19)):
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = []
    with BlockMover(src.tensors, dst.tensors, direction, block_dim=block_dim) as mover:
        for n in sizes:
            sid = rng.choice(mover.num_src_blocks, n, replace=False).astype(np.int64)
            did = rng.choice(mover.num_dst_blocks, n, replace=False).astype(np.int64)
            mover.submit(sid, did)
            jobs.append((sid, did))
        results = mover.poll()
    assert [r.bytes for r in results] == [len(s) * mover.block_bytes for s, _ in jobs]
    assert all(r.ok for r in results)
    assert dst.matches(expected_after(src, src_before, dst, before, jobs))
    assert src.matches(src_before)
    return mover, jobs


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_host_blocks_three_times_the_device_blocks_with_padded_rows(kind, direction):
    """vLLM's block_size_factor: host blocks of 3 x 4 tokens, each row padded, against
    device blocks of 4 tokens; ids on both sides count 4-token blocks."""
    gen, rng = torch.Generator().manual_seed(31), np.random.default_rng(31)
    k = [KINDS[kind]]
    host = Side(k, 9, 3 * TOKENS, gen, pad=96)
    device = Side(k, 30, TOKENS, gen)
    src, dst = (host, device) if direction == "h2d" else (device, host)
    mover, _ = _run(src, dst, direction, KINDS[kind].block_dim, rng)
    assert mover.block_size_factor == 3
    assert (mover.num_src_blocks, mover.num_dst_blocks) == ((27, 30) if direction == "h2d" else (30, 27))
    per_block = {"flash": 2, "flashinfer": 2, "mla": 1}[kind]   # FlashInfer's K and V are cut apart
    assert mover.chunks_per_block == per_block


@pytest.mark.parametrize("factor", [1, 3])
def test_flash_mla_and_flashinfer_in_one_mover(factor):
    gen, rng = torch.Generator().manual_seed(32 + factor), np.random.default_rng(32)
    device = Side(MIXED, 24, TOKENS, gen)
    host = Side(MIXED, 27 // factor, factor * TOKENS, gen, pad=64 if factor > 1 else 0)
    mover, _ = _run(device, host, "d2h", [1, 0, 0], rng)
    assert mover.block_size_factor == factor
    _run(host, device, "h2d", [1, 0, 0], rng)


def test_consecutive_sub_blocks_coalesce_into_one_run():
    """Sub-blocks 0..2 of one host block are adjacent: three ids, one descriptor a chunk."""
    gen = torch.Generator().manual_seed(33)
    host, device = Side([KINDS["flash"]], 4, 3 * TOKENS, gen, pad=64), Side([KINDS["flash"]], 12, TOKENS, gen)
    mover = BlockMover(device.tensors, host.tensors, "d2h", block_dim=1)
    assert len(mover.descriptors([4, 5, 6], [3, 4, 5])[2]) == 2            # K and V of host block 1
    assert len(mover.descriptors([4, 5, 6], [2, 3, 4])[2]) == 4            # crosses a padded row
    src, dst, sizes = mover.descriptors([0], [7])
    assert sizes.tolist() == [mover.block_bytes // 2] * 2
    v = host.tensors[0]
    chunk = mover.block_bytes // 2
    assert dst.tolist() == [v[0, 2].data_ptr() + chunk, v[1, 2].data_ptr() + chunk]  # block 2, sub-block 1


def test_larger_blocks_on_either_side_and_byte_pools():
    """The factor may be on the source side, and a raw uint8 pool that names its sub-block
    dimension (num_blocks, k, block bytes) pairs with typed tensors."""
    gen, rng = torch.Generator().manual_seed(34), np.random.default_rng(34)
    mla = KINDS["mla"]
    device = Side([mla], 16, TOKENS, gen)
    block = device.tensors[0][0].numel() * 2
    pool = torch.randint(0, 256, (6, 2, block), dtype=torch.uint8, generator=gen)
    ref = pool.clone()
    sid, did = rng.choice(16, 9, replace=False), rng.choice(12, 9, replace=False)
    with BlockMover(device.tensors, [pool], "d2h") as mover:
        assert (mover.block_size_factor, mover.num_dst_blocks) == (2, 12)
        mover.submit(sid, did)
    for i, j in zip(sid, did):
        ref[j // 2, j % 2] = device.tensors[0][i].contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(pool, ref)


def test_sizes_that_are_no_whole_multiple_or_cut_the_innermost_dim_are_refused():
    flash = torch.empty(2, 10, 4, 2, 16, dtype=torch.bfloat16)
    cases = [
        (torch.empty(2, 10, 6, 2, 16, dtype=torch.bfloat16), "must hold the same elements"),  # 1.5 x
        (torch.empty(2, 10, 4, 2, 32, dtype=torch.bfloat16), "must hold the same elements"),  # only head_dim 2 x
        (torch.empty(2, 5, 8, 2, 16, dtype=torch.float16), "is torch.float16"),
    ]
    for other, message in cases:
        with pytest.raises(BlockLayoutError, match=message):
            BlockMover([flash], [other], "h2d", block_dim=1)
    with pytest.raises(BlockLayoutError, match="differ in how many blocks of one side make a block"):
        BlockMover([flash, torch.empty(5, 8, 72, dtype=torch.bfloat16)],
                   [torch.empty(2, 5, 8, 2, 16, dtype=torch.bfloat16), torch.empty(10, 4, 72, dtype=torch.bfloat16)],
                   "h2d", block_dim=[1, 0])


def test_ids_count_the_smaller_block_on_both_sides():
    gen = torch.Generator().manual_seed(35)
    host, device = Side([KINDS["mla"]], 5, 3 * TOKENS, gen), Side([KINDS["mla"]], 8, TOKENS, gen)
    with BlockMover(host.tensors, device.tensors, "h2d") as mover:
        mover.submit([14], [7])
        with pytest.raises(BlockIdError, match="src_block_ids\\[0\\]=15 is out of range.*15 blocks"):
            mover.submit([15], [0])


def test_block_dim_forms():
    assert block_dims(1, 3) == [(1, 1)] * 3
    assert block_dims((1, 0), 2) == [(1, 0), (1, 0)]
    assert block_dims([1, (0, 1), 0], 3) == [(1, 1), (0, 1), (0, 0)]
    with pytest.raises(BlockLayoutError, match="list of 2 entries but there are 3 tensor pair"):
        block_dims([1, 0], 3)
    with pytest.raises(BlockLayoutError, match="block_dim\\[1\\]='x' must be an int"):
        block_dims([1, "x"], 2)
    with pytest.raises(BlockLayoutError, match="block_dim=\\(1, 0, 0\\)"):
        block_dims((1, 0, 0), 3)   # a tuple is always one (src, dst) pair


def test_calibration_and_profiles_pass_through_to_resolve(monkeypatch):
    import kvswap.mover.build
    from kvswap import Calibration

    seen = []
    real = kvswap.mover.build.resolve
    monkeypatch.setattr(kvswap.mover.build, "resolve", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    cal = Calibration(source="a calibration handed to the mover", platform="cpu", calibrated=False)
    gen = torch.Generator().manual_seed(36)
    s, d = Side([KINDS["mla"]], 4, TOKENS, gen), Side([KINDS["mla"]], 4, TOKENS, gen)
    mover = BlockMover(s.tensors, d.tensors, "h2d", calibration=cal, profiles=False)
    assert mover.swap_fn.plan.calibration["source"] == cal.source and "handed to the mover" in mover.explain()
    grouped = BlockMover.groups([(s.tensors, d.tensors)], "h2d", calibration=cal)
    assert grouped.swap_fn.plan.calibration["source"] == cal.source
    BlockMover(s.tensors, d.tensors, "h2d")
    assert [(kw["calibration"], kw["profiles"]) for kw in seen] == [(cal, False), (cal, True), (None, True)]


def test_sub_blocks_never_take_a_by_id_route():
    """A route that derives addresses from ``base + id * stride`` on the device cannot
    address sub-blocks: a mover with a block-size factor keeps to descriptors."""
    from kvswap import CopyImpl, Direction, hookimpl
    from kvswap.registry.plugins import create_plugin_host, reset_plugin_host
    from kvswap.registry.reference import host_copy

    asked = []

    class Transfer:
        def __call__(self, src, dst, sizes, stream=None):
            host_copy(src, dst, sizes)

        def by_ids(self, template):
            asked.append(template.factor)
            return None

    class Plugin:
        @hookimpl
        def kvswap_register_copy_impls(self, platform, register):
            if platform == "cpu":
                register(CopyImpl(name="test.by_ids", kind="kernel", platforms=("cpu",),
                                  directions=(Direction.H2D, Direction.D2H), factory=lambda ctx: Transfer(),
                                  by_ids=True))

    reset_plugin_host(create_plugin_host(entry_points=[], env={}, extra=[("p", Plugin())]))
    gen, rng = torch.Generator().manual_seed(37), np.random.default_rng(37)
    policy = kvswap.Policy(force="test.by_ids")
    for factor in (1, 3):
        host = Side([KINDS["flash"]], 27 // factor, factor * TOKENS, gen, pad=64 if factor > 1 else 0)
        device = Side([KINDS["flash"]], 27, TOKENS, gen)
        before, src_before = device.snapshot(), host.snapshot()
        sid, did = rng.permutation(27)[:11], rng.permutation(27)[:11]
        with BlockMover(host.tensors, device.tensors, "h2d", block_dim=1, policy=policy,
                        device_descriptors=True) as mover:
            mover.submit(sid, did)
        assert device.matches(expected_after(host, src_before, device, before, [(sid, did)]))
    assert asked == [1]   # offered to the k = 1 mover only
