"""``triton.kernel``'s by-id copy on the CPU: the real kernel in Triton's interpreter
(``TRITON_INTERPRET=1``) over host tensors, addresses derived from a mover's template.

Every check covers whole allocations (random guard bytes around each tensor, poisoned
destinations): copied blocks, blocks that must stay untouched and bytes just outside.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvswap.backends.triton_generic.by_ids import FIELDS, CopyByIds, KernelCopyByIds, bind_by_ids, pack_template  # noqa: E402
from kvswap.backends.triton_generic.launch import DEFAULT_PLANS, KernelCopy, TilePlan, interpreting  # noqa: E402
from kvswap.addressing.regions import pair_regions  # noqa: E402

from mover_layouts import Pool, expected_after, layouts  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreting(), reason="runs the kernel in Triton's CPU interpreter")


def pools(name, seed, src_blocks=23, dst_blocks=19, **shape):
    layout = layouts(**shape)[name]
    gen = torch.Generator().manual_seed(seed)
    return Pool(layout, src_blocks, gen), Pool(layout, dst_blocks, gen)


def random_ids(rng, n, src, dst):
    return (rng.integers(0, src.num_blocks, n).astype(np.int64),  # sources may repeat
            rng.permutation(dst.num_blocks)[:n].astype(np.int64))  # destinations never


@pytest.mark.parametrize("name", ["flash", "mla", "cross", "cross_views"])
def test_blocks_by_id_match_torch_indexing(name):
    rng = np.random.default_rng(11)
    src, dst = pools(name, 1)
    template = pair_regions(src.tensors, dst.tensors, src.layout.block_dim)
    fn = KernelCopyByIds(num_sms=3, device_index=None).by_ids(template)  # the capability, as a mover asks
    assert isinstance(fn, CopyByIds) and fn.pieces == template.count
    before, src_before = dst.snapshot(), src.snapshot()
    jobs = []
    for n in (1, 6, 19, 0, 13):
        sid, did = random_ids(rng, n, src, dst)
        launch = fn(sid, did)
        assert launch.n == n and launch.items == n * template.count
        assert launch.grid <= 3
        jobs.append((sid, did))
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


@pytest.mark.parametrize("plan, want_splits", [
    (TilePlan(), True),                 # few tiles, long pieces: programs share a tile's steps
    (TilePlan(align_max=8), True),      # the 8-byte word variant
    (TilePlan(tile_elems=64, row_max=32), False),  # many tiles per program, short rows
    (DEFAULT_PLANS["d2d"], True),       # the staged route's device side
])
def test_launch_shapes_copy_the_same_bytes(plan, want_splits):
    rng = np.random.default_rng(5)
    src, dst = pools("flash", 2, src_blocks=9, dst_blocks=7, heads=4, head_dim=512)  # 16 KiB pieces
    template = pair_regions(src.tensors, dst.tensors, 1)
    fn = bind_by_ids(KernelCopy(num_sms=8, device_index=None, tiles=plan), template)
    assert fn.each == 16384 // 8  # one piece size: the loop bound is given
    before, src_before = dst.snapshot(), src.snapshot()
    sid, did = random_ids(rng, 3, src, dst)
    launch = fn(sid, did)
    assert (launch.tile.splits > 1) == want_splits
    if plan.align_max == 8:
        assert launch.tile.align == 8
    assert dst.matches(expected_after(dst, before, src_before, src, [(sid, did)]))


def test_mixed_piece_sizes_in_one_launch():
    rng = np.random.default_rng(9)
    gen = torch.Generator().manual_seed(3)
    a_src, a_dst = (Pool(layouts()["flash"], nb, gen) for nb in (12, 10))
    b_src, b_dst = (Pool(layouts()["mla"], nb, gen) for nb in (12, 10))
    # MLA tensors seen with a leading dim of 1, so one block_dim serves both layouts.
    src_t = a_src.tensors + [t.unsqueeze(0) for t in b_src.tensors]
    dst_t = a_dst.tensors + [t.unsqueeze(0) for t in b_dst.tensors]
    template = pair_regions(src_t, dst_t, 1)
    assert len(set(template.sizes.tolist())) == 2
    fn = bind_by_ids(KernelCopy(num_sms=2, device_index=None), template)
    assert fn.each == 0  # each tile finds its longest row
    sid, did = rng.integers(0, 12, 7).astype(np.int64), rng.permutation(10)[:7].astype(np.int64)
    snaps = [(p, p.snapshot()) for p in (a_dst, b_dst)]
    src_snaps = {id(p): p.snapshot() for p in (a_src, b_src)}
    fn(sid, did)
    for (dst, before), src in zip(snaps, (a_src, b_src)):
        assert dst.matches(expected_after(dst, before, src_snaps[id(src)], src, [(sid, did)]))


def test_templates_the_kernel_cannot_take_are_declined():
    gen = torch.Generator().manual_seed(4)
    src = torch.randint(0, 256, (10, 12), dtype=torch.uint8, generator=gen)  # 12-byte blocks
    dst = torch.randint(0, 256, (10, 12), dtype=torch.uint8, generator=gen)
    assert bind_by_ids(KernelCopy(num_sms=2, device_index=None), pair_regions([src], [dst], 0)) is None
    odd = torch.randint(0, 256, (10, 17), dtype=torch.uint8, generator=gen)[:, 1:]  # 16 bytes, odd base
    assert bind_by_ids(KernelCopy(num_sms=2, device_index=None),
                       pair_regions([odd], [torch.empty(10, 16, dtype=torch.uint8)], 0)) is None


def test_pack_template_checks_its_fields():
    class T:
        src_base, src_stride, dst_base, dst_stride = ([1, 2], [3, 4], [5, 6], [7, 8])
        sizes = [9, 10]
    packed = pack_template(T)
    assert packed.tolist() == list(range(1, 11)) and len(FIELDS) == 5
    T.sizes = [9]
    with pytest.raises(ValueError, match="one length"):
        pack_template(T)


def test_the_binding_module_imports_neither_triton_nor_torch():
    import subprocess
    import sys

    code = ("import sys, kvswap.backends.triton_generic.by_ids\n"
            "print('triton' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


@pytest.mark.parametrize("count", [1, 1023, 1024, 1025, 5000])
def test_the_ids_upload_kernel_copies_exactly_count_ids(count):
    """load_ids_kernel (the upload before a long batch) in the interpreter: every id lands,
    nothing past ``count`` is written."""
    from kvswap.backends.triton_generic.by_ids import UPLOAD_BLOCK
    from kvswap.backends.triton_generic.by_ids_jit import load_ids_kernel

    rng = np.random.default_rng(count)
    src = torch.from_numpy(rng.integers(-2**62, 2**62, count + 64, dtype=np.int64))
    dst = torch.full((count + 64,), -7, dtype=torch.int64)
    load_ids_kernel[(-(-count // UPLOAD_BLOCK),)](src, dst, count, BLOCK=UPLOAD_BLOCK)
    assert torch.equal(dst[:count], src[:count])
    assert bool((dst[count:] == -7).all())
