"""The by-id kernel copy on a GPU: every mover layout, both directions, ids read from
pinned memory and uploaded, the copy ordered on the stream it was given.

Host tensors are pinned; every check compares whole allocations (guards included) with a
reference computed by torch indexing on host copies, on random data.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from kvswap.regions import pair_regions
from mover_layouts import Pool, expected_after, layouts

pytestmark = pytest.mark.gpu

LAYOUTS = layouts(bs=16, heads=2, head_dim=64, layers=4)
SPIN = 200_000_000


def _pair(name, direction, seed, src_blocks=300, dst_blocks=400):
    gen = torch.Generator().manual_seed(seed)
    h2d = direction == "h2d"
    src = Pool(LAYOUTS[name], src_blocks, gen, device="cpu" if h2d else "cuda", pinned=h2d)
    dst = Pool(LAYOUTS[name], dst_blocks, gen, device="cuda" if h2d else "cpu", pinned=not h2d)
    return src, dst


def _bound(src, dst, direction, num_sms=8):
    from kvswap.backends.triton_generic.by_ids import KernelCopyByIds
    from kvswap.backends.triton_generic.launch import DEFAULT_PLANS

    copy = KernelCopyByIds(num_sms, torch.cuda.current_device(), tiles=DEFAULT_PLANS[direction])
    fn = copy.by_ids(pair_regions(src.tensors, dst.tensors, src.layout.block_dim))
    assert fn is not None
    return fn


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_both_directions(name, direction):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{direction}".encode()))
    src, dst = _pair(name, direction, seed=1)
    fn = _bound(src, dst, direction)
    before, src_before = dst.snapshot(), src.snapshot()
    stream = torch.cuda.Stream()
    jobs, where = [], set()
    for n in (1, 7, 64, 300):
        sid = rng.integers(0, src.num_blocks, n).astype(np.int64)
        did = rng.permutation(dst.num_blocks)[:n].astype(np.int64)
        where.add(fn(sid, did, stream).ids)
        jobs.append((sid, did))
    stream.synchronize()
    assert where <= {"host", "device"}
    assert dst.matches(expected_after(dst, before, src_before, src, jobs))
    assert src.matches(src_before)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_ordered_on_the_stream_both_ways(direction):
    """Work queued before the launch (a fill of the destinations) lands first; work queued
    after it (a snapshot of the destinations) sees the copied bytes."""
    rng = np.random.default_rng(3)
    src, dst = _pair("flash", direction, seed=2, src_blocks=2048, dst_blocks=2048)
    fn = _bound(src, dst, direction, num_sms=4)
    src_before = src.snapshot()
    stream = torch.cuda.Stream()
    sid = rng.integers(0, 2048, 2000).astype(np.int64)
    did = rng.permutation(2048)[:2000].astype(np.int64)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN)
        for f in dst.flats:
            f.fill_(0xA5)
    assert fn.launch_only(2000)  # the upload is a kernel launched directly, no stream switch
    launch = fn(sid, did, stream)
    assert launch.ids == "device"  # a long batch: ids uploaded first
    with torch.cuda.stream(stream):
        snaps = [f.to("cuda", non_blocking=True) if not f.is_cuda else f.clone() for f in dst.flats]
    stream.synchronize()
    poisoned = [torch.full_like(f.cpu(), 0xA5) for f in dst.flats]
    want = expected_after(dst, poisoned, src_before, src, [(sid, did)])
    for snap, w in zip(snaps, want):
        assert torch.equal(snap.cpu(), w)
    assert dst.matches(want)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_block_mover_on_the_kernel_route_sends_only_ids(direction):
    """Through BlockMover: the by-id path is bound at construction and taken by submit;
    a fill of the destinations queued on the compute stream before submit lands first."""
    from kvswap import BlockMover, Policy

    rng = np.random.default_rng(4)
    src, dst = _pair("flash", direction, seed=3, src_blocks=1024, dst_blocks=1024)
    src_before = src.snapshot()
    with BlockMover(src.tensors, dst.tensors, direction, block_dim=1, policy=Policy(force="triton.kernel"), device_descriptors=True) as mover:
        assert mover._ids_steps is not None and all(f is not None for f in mover._ids_steps[1])
        sid = rng.integers(0, 1024, 700).astype(np.int64)
        did = rng.permutation(1024)[:700].astype(np.int64)
        torch.cuda._sleep(SPIN)  # the compute stream is busy
        for f in dst.flats:
            f.fill_(0x3C)  # (on the host for d2h: done at once)
        job = mover.submit(sid, did)
        mover.wait(job)
        (r,) = mover.poll()
    assert r.ok and r.descriptors == 700 * mover.chunks_per_block
    poisoned = [torch.full_like(f.cpu(), 0x3C) for f in dst.flats]
    assert dst.matches(expected_after(dst, poisoned, src_before, src, [(sid, did)]))
